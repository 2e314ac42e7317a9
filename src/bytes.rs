//! Byte counts as people write them: `8GiB`, `512MiB`, `64KiB`, `1000000`. One reading for
//! every place a size is given (a flag, `--set`, a TOML file), so a spelling that works in one
//! works in all.

use serde::de::{Deserializer, Visitor};

/// A byte count with an optional binary unit: `123`, `123B`, `64KiB`, `512MiB`, `8GiB`, `1TiB`.
pub fn parse(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() {
        return Err(format!("`{s}` is not a byte count: expected a whole number, e.g. 8GiB, 512MiB or 1000000"));
    }
    const UNITS: [(&str, usize); 5] =
        [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)];
    let scale_of = |unit: &str| UNITS.iter().find(|(name, _)| *name == unit).map(|&(_, scale)| scale);
    if unit.starts_with(['.', ',']) {
        // The same count whole in a smaller unit, where it is one (0.5MiB is 512KiB).
        let (number, name) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
        let bytes = number.trim().replace(',', ".").parse::<f64>().ok().zip(scale_of(name));
        let whole = bytes.map(|(n, scale)| n * scale as f64).and_then(|b| {
            UNITS
                .iter()
                .find(|&&(_, u)| b >= u as f64 && (b / u as f64).fract() == 0.0)
                .map(|(name, u)| (b / *u as f64, name))
        });
        let say = whole.map_or("1536MiB, not 1.5GiB".to_string(), |(n, name)| format!("here {n}{name}"));
        return Err(format!("`{s}`: expected a whole number of bytes or of a unit ({say})"));
    }
    let scale = match unit.trim() {
        "" => 1,
        // (`1e9` reads as 1 of a unit `e9`: said as the exponent it is.)
        u if u.starts_with(['e', 'E']) && u[1..].parse::<u32>().is_ok() => {
            return Err(format!("`{s}`: exponents are not read; write the count whole, or with a unit (512MiB)"));
        }
        u => scale_of(u)
            .ok_or_else(|| format!("unknown unit `{u}`: expected a byte count with B, KiB, MiB, GiB or TiB"))?,
    };
    // (A setting holds a TOML integer, a signed 64-bit one, whichever way it is written.)
    digits
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|&n| i64::try_from(n).is_ok())
        .ok_or_else(|| format!("`{s}` is beyond what a setting holds (at most {})", i64::MAX))
}

/// A byte count for people to read, in the largest binary unit it holds one of, to
/// `decimals` places: `0 B`, `512 B`, `16.0 KiB`, `1.5 MiB`, `2.0 GiB` at 1 (so a small count
/// never prints as `0.0 MiB`).
pub fn display(n: usize, decimals: usize) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let (mut value, mut unit) = (n as f64, None);
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        (value, unit) = (value / 1024.0, Some(u));
    }
    match unit {
        None => format!("{n} B"),
        Some(u) => format!("{value:.decimals$} {u}"),
    }
}

/// Reads a byte count written as a whole number or as text with a unit ([`parse`]); for
/// `#[serde(deserialize_with = "crate::bytes::deserialize")]`.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    d.deserialize_any(ByteCount)
}

/// [`deserialize`] for an optional count (with `#[serde(default)]`; a JSON `null` is none).
pub fn deserialize_option<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    d.deserialize_option(MaybeByteCount)
}

struct MaybeByteCount;

impl<'de> Visitor<'de> for MaybeByteCount {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        ByteCount.expecting(f)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Option<usize>, E> {
        Ok(None)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Option<usize>, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        deserialize(d).map(Some)
    }
}

struct ByteCount;

impl Visitor<'_> for ByteCount {
    type Value = usize;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a byte count: a whole number, or text such as \"512MiB\" or \"8GiB\"")
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<usize, E> {
        usize::try_from(v).map_err(|_| E::custom(format!("{v} bytes is more than this machine can address")))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<usize, E> {
        u64::try_from(v)
            .map_err(|_| E::custom(format!("{v}: a byte count is not negative")))
            .and_then(|v| self.visit_u64(v))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<usize, E> {
        parse(v).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    struct Sizes {
        #[serde(deserialize_with = "deserialize")]
        cap: usize,
        #[serde(default, deserialize_with = "deserialize_option")]
        limit: Option<usize>,
    }

    /// Printed in the largest unit the count holds one of.
    #[test]
    fn counts_print_in_the_unit_they_fill() {
        let cases = [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (16384, "16.0 KiB"), (3 << 19, "1.5 MiB")];
        for (n, want) in cases {
            assert_eq!(display(n, 1), want);
        }
        assert_eq!(display(2 << 30, 1), "2.0 GiB");
        assert_eq!(display(5 << 40, 1), "5.0 TiB");
        assert_eq!((display(1536, 3), display(1000, 3)), ("1.500 KiB".into(), "1000 B".into()));
    }

    #[test]
    fn units_read_alike_in_text_and_in_toml() {
        assert_eq!(parse("123"), Ok(123));
        assert_eq!(parse(" 64KiB "), Ok(64 << 10));
        assert_eq!(parse("512 MiB"), Ok(512 << 20));
        assert_eq!(parse("8GiB"), Ok(8 << 30));
        let read = |t: &str| toml::from_str::<Sizes>(t).map_err(|e| e.to_string());
        let s = read("cap = \"512MiB\"\nlimit = 4096").unwrap();
        assert_eq!((s.cap, s.limit), (512 << 20, Some(4096)));
        assert_eq!(read("cap = 7").unwrap().limit, None);
        assert!(read("cap = \"8GB\"").unwrap_err().contains("unknown unit `GB`"));
        // A fraction is said whole in a smaller unit where it is one; an exponent as one.
        assert!(parse("0.5MiB").unwrap_err().contains("(here 512KiB)"), "{:?}", parse("0.5MiB"));
        assert!(parse("1.5GiB").unwrap_err().contains("(here 1536MiB)"));
        assert!(parse("0,25KiB").unwrap_err().contains("(here 256B)"));
        assert!(parse("1.3B").unwrap_err().contains("(1536MiB, not 1.5GiB)"));
        assert!(parse("1e9").unwrap_err().contains("exponents are not read"));
        assert!(read("cap = -1").unwrap_err().contains("not negative"));
        assert!(read("cap = 1.5").unwrap_err().contains("a byte count"));
        assert!(parse("MiB").unwrap_err().contains("not a byte count"));
        assert!(parse("1.5GiB").unwrap_err().contains("whole number"));
        let json = |t: &str| serde_json::from_str::<Sizes>(t).map(|s| s.limit).map_err(|e| e.to_string());
        assert_eq!(json(r#"{"cap": 1, "limit": null}"#), Ok(None));
        assert_eq!(json(r#"{"cap": 1, "limit": "1KiB"}"#), Ok(Some(1024)));
        assert!(parse("99999999999TiB").unwrap_err().contains("is beyond what a setting holds"));
        // (The bound is a setting's, a TOML integer's, not the machine's: 8 EiB − 1.)
        assert_eq!(parse("8388607TiB"), Ok(8388607 << 40));
        let e = parse("8388608TiB").unwrap_err();
        assert!(e.contains("(at most 9223372036854775807)"), "{e}");
        assert!(parse("-1").unwrap_err().contains("`-1` is not a byte count: expected a whole number"));
    }
}
