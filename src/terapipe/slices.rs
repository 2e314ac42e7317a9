//! What a user asks for with `--token-slices` (or `[pipeline] token_slices`): no slicing, a
//! number of near-equal slices, explicit lengths, or `auto` (the planner's choice); and the
//! lengths a request means for a sequence of a given length.

use crate::error::{Error, Result, config_error};
/// `n` near-equal lengths adding up to `seq` (the pipeline's planner needs it too: it lives there).
pub use crate::pipeline::plan::uniform_slices as uniform;
use std::fmt;
use std::str::FromStr;

/// A token-slicing request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TokenSlices {
    /// Whole sequences (no TeraPipe).
    #[default]
    Off,
    /// The slicing the planner chooses from the device's measured latencies.
    Auto,
    /// `n` slices of near-equal length (the first `L mod n` one token longer).
    Count(usize),
    /// These lengths, in order; they must add up to the sequence length.
    Lengths(Vec<usize>),
}

const EXPECTED: &str = "expected `off`, `auto`, a number of slices, or lengths such as `32,32,64`";

impl FromStr for TokenSlices {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |message: String| Err(config_error("pipeline.token_slices", message));
        match s.trim() {
            "off" => Ok(TokenSlices::Off),
            "" => bad(format!("an empty slicing; {EXPECTED}")),
            "auto" => Ok(TokenSlices::Auto),
            "0" => bad(format!("`0` slices: every sequence is at least one slice ({EXPECTED}; `off` for none)")),
            text => {
                let parts: Vec<&str> = text.split(',').map(str::trim).collect();
                let mut lengths = Vec::with_capacity(parts.len());
                for p in &parts {
                    match p.parse::<usize>() {
                        Ok(0) => return bad(format!("`{text}` has a zero-length slice; every slice needs a token")),
                        Ok(n) => lengths.push(n),
                        Err(_) => return bad(format!("`{text}` is not a slicing: `{p}` is not a length; {EXPECTED}")),
                    }
                }
                Ok(if lengths.len() == 1 { TokenSlices::Count(lengths[0]) } else { TokenSlices::Lengths(lengths) })
            }
        }
    }
}

impl fmt::Display for TokenSlices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenSlices::Off => f.write_str("off"),
            TokenSlices::Auto => f.write_str("auto"),
            TokenSlices::Count(n) => write!(f, "{n}"),
            TokenSlices::Lengths(l) => f.write_str(&l.iter().map(usize::to_string).collect::<Vec<_>>().join(",")),
        }
    }
}

impl serde::Serialize for TokenSlices {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for TokenSlices {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        // A TOML integer (`token_slices = 4`), string (`"auto"`, `"32,32,64"`) or list of
        // lengths (`[32, 32, 64]`), each read as its text would be (so `0` means the same in
        // every form); the message alone, the caller names the key.
        fn text<E: serde::de::Error>(t: &str) -> std::result::Result<TokenSlices, E> {
            t.parse().map_err(|e| match e {
                Error::Config { message, .. } => E::custom(message),
                e => E::custom(e),
            })
        }
        struct Request;
        impl<'de> serde::de::Visitor<'de> for Request {
            type Value = TokenSlices;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("`off`, `auto`, a number of slices, or lengths such as \"32,32,64\" or [32, 32, 64]")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> std::result::Result<TokenSlices, E> {
                text(&n.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> std::result::Result<TokenSlices, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!("{n} slices: {EXPECTED}"))),
                }
            }
            fn visit_str<E: serde::de::Error>(self, t: &str) -> std::result::Result<TokenSlices, E> {
                text(t)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<TokenSlices, A::Error> {
                let mut lengths: Vec<String> = Vec::new();
                while let Some(n) = seq.next_element::<u64>()? {
                    lengths.push(n.to_string());
                }
                if lengths.len() < 2 {
                    let what = if lengths.is_empty() { "an empty list" } else { "a list of one length" };
                    return Err(A::Error::custom(format!(
                        "{what} is no slicing: `off` for whole sequences, or at least two lengths"
                    )));
                }
                text(&lengths.join(","))
            }
        }
        d.deserialize_any(Request)
    }
}

impl TokenSlices {
    /// The lengths this request means for sequences of `seq` tokens (empty: unsliced). `Auto`
    /// is the planner's to resolve and is an error here.
    pub fn lengths(&self, seq: usize) -> Result<Vec<usize>> {
        let bad = |message: String| Err(config_error("pipeline.token_slices", message));
        match self {
            TokenSlices::Off | TokenSlices::Count(1) => Ok(Vec::new()),
            TokenSlices::Auto => {
                bad("`auto` is chosen by the slicing planner (terapipe::plan_slices), not here".into())
            }
            TokenSlices::Count(n) if *n > seq => {
                bad(format!("{n} slices of a {seq}-token sequence: more slices than tokens"))
            }
            TokenSlices::Count(n) => Ok(uniform(seq, *n)),
            TokenSlices::Lengths(l) => {
                // Checked: the lengths come from a config file.
                let total = l.iter().try_fold(0usize, |sum, &n| sum.checked_add(n));
                if total != Some(seq) {
                    let total = total.map_or("more than usize::MAX".to_string(), |t| t.to_string());
                    return bad(format!("{self} covers {total} tokens; the sequences have {seq}"));
                }
                Ok(l.clone())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_print_and_resolve() {
        for (text, want) in [
            ("off", TokenSlices::Off),
            ("auto", TokenSlices::Auto),
            ("4", TokenSlices::Count(4)),
            ("32, 32,64", TokenSlices::Lengths(vec![32, 32, 64])),
        ] {
            let got: TokenSlices = text.parse().unwrap();
            assert_eq!(got, want, "{text}");
            assert_eq!(got.to_string().parse::<TokenSlices>().unwrap(), want);
        }
        assert_eq!(TokenSlices::Count(3).lengths(8).unwrap(), vec![3, 3, 2]);
        assert_eq!(TokenSlices::Count(1).lengths(8).unwrap(), Vec::<usize>::new());
        assert_eq!(TokenSlices::Lengths(vec![5, 3]).lengths(8).unwrap(), vec![5, 3]);
    }

    /// Lengths whose sum overflows are an error, not a panic (a config file writes them).
    #[test]
    fn overflowing_lengths_are_an_error() {
        let request: TokenSlices = "18446744073709551615,1".parse().unwrap();
        let err = request.lengths(128).unwrap_err().to_string();
        assert!(err.contains("covers more than usize::MAX tokens; the sequences have 128"), "{err}");
    }

    #[test]
    fn bad_requests_name_what_is_wrong() {
        for (text, needle) in [
            ("3,0,5", "zero-length"),
            ("two", "`two` is not a length"),
            ("4,x", "`x` is not"),
            ("0", "`0` slices"),
            (" ", "an empty slicing"),
        ] {
            let err = text.parse::<TokenSlices>().unwrap_err().to_string();
            assert!(err.contains("token_slices") && err.contains(needle), "{text}: {err}");
        }
        // A TOML integer reads as its text: 0 is refused there too, 4 is four slices.
        #[derive(serde::Deserialize)]
        struct Section {
            token_slices: TokenSlices,
        }
        let err = toml::from_str::<Section>("token_slices = 0").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("`0` slices"), "{err}");
        assert_eq!(toml::from_str::<Section>("token_slices = 4").unwrap().token_slices, TokenSlices::Count(4));
        // A list of lengths is TOML's own form for them; the key is named once, by the caller.
        let lengths = toml::from_str::<Section>("token_slices = [64, 64]").unwrap().token_slices;
        assert_eq!(lengths, TokenSlices::Lengths(vec![64, 64]));
        for (toml, says) in [
            ("token_slices = [64]", "a list of one length is no slicing"),
            ("token_slices = []", "an empty list is no slicing"),
            ("token_slices = [64, 0]", "zero-length slice"),
            ("token_slices = [64, \"a\"]", "expected u64"),
            ("token_slices = -4", "-4 slices: expected `off`"),
            ("token_slices = 4.0", "expected `off`, `auto`, a number of slices, or lengths"),
            ("token_slices = true", "expected `off`, `auto`, a number of slices, or lengths"),
            ("token_slices = \"two\"", "`two` is not a length"),
        ] {
            let err = toml::from_str::<Section>(toml).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(says) && !err.contains("config field"), "{toml}: {err}");
        }
        let err = TokenSlices::Lengths(vec![5, 4]).lengths(8).unwrap_err().to_string();
        assert!(err.contains("covers 9 tokens; the sequences have 8"), "{err}");
        let err = TokenSlices::Count(9).lengths(8).unwrap_err().to_string();
        assert!(err.contains("more slices than tokens"), "{err}");
    }
}
