//! The byte-string mutations of the fuzzer. Each takes its randomness from a seeded
//! [`Rng`], so a run replays exactly from its seed; each either changes the input or says it
//! could not apply (deleting from an empty input, growing one already at the size limit).

use crate::rng::Rng;

/// Byte values that sit on the boundaries parsers branch on: zero, sign bits, all ones, and
/// the JSON/CSV/line structure characters.
pub const INTERESTING_BYTES: [u8; 8] = [0, 0xff, 0x7f, 0x80, b'"', b'{', b'\n', b','];

/// Numbers that break integer and float parsing at its edges: one past `u64::MAX`, the
/// type maxima, negatives where only sizes are expected, floats that overflow or underflow.
pub const EXTREME_NUMBERS: [&str; 16] = [
    "18446744073709551616",
    "18446744073709551615",
    "9223372036854775807",
    "-9223372036854775808",
    "4294967296",
    "4294967295",
    "2147483648",
    "65536",
    "256",
    "-1",
    "0",
    "1e309",
    "-1e309",
    "1e-400",
    "nan",
    "99999999999999999999999999999999",
];

/// One kind of mutation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Flip one bit.
    BitFlip,
    /// Set one byte to one of [`INTERESTING_BYTES`].
    InterestingByte,
    /// Insert a few random bytes.
    InsertRandom,
    /// Delete a range.
    DeleteRange,
    /// Copy a range somewhere else (grows repeated structure: more records, deeper nesting).
    DuplicateRange,
    /// Cut the input short.
    Truncate,
    /// Take bytes from another corpus entry: crossover, inserted chunk or overwritten chunk.
    Splice,
    /// Replace a run of ASCII digits with one of [`EXTREME_NUMBERS`] (or insert one where the
    /// input has no digits).
    ExtremeNumber,
}

impl Mutation {
    /// Every mutation, in a fixed order (the order the random choice indexes).
    pub const ALL: [Mutation; 8] = [
        Mutation::BitFlip,
        Mutation::InterestingByte,
        Mutation::InsertRandom,
        Mutation::DeleteRange,
        Mutation::DuplicateRange,
        Mutation::Truncate,
        Mutation::Splice,
        Mutation::ExtremeNumber,
    ];
}

/// Up to `n` (≥ 1) with small values far more likely: most edits are small, a few are large.
fn small_len(rng: &mut Rng, n: usize) -> usize {
    let cap = if rng.below(8) == 0 { 256 } else { 16 };
    1 + rng.below(n.clamp(1, cap) as u64) as usize
}

fn index(rng: &mut Rng, n: usize) -> usize {
    rng.below(n as u64) as usize
}

/// Applies `m` to `data`, never growing it past `max_len`. `donor` is the other input a
/// [`Mutation::Splice`] takes bytes from. Returns whether `data` changed.
pub fn apply(m: Mutation, data: &mut Vec<u8>, rng: &mut Rng, donor: &[u8], max_len: usize) -> bool {
    let len = data.len();
    let room = max_len.saturating_sub(len);
    match m {
        Mutation::BitFlip => {
            if len == 0 {
                return false;
            }
            let at = index(rng, len);
            data[at] ^= 1 << rng.below(8);
            true
        }
        Mutation::InterestingByte => {
            if len == 0 {
                return false;
            }
            let at = index(rng, len);
            let mut k = index(rng, INTERESTING_BYTES.len());
            if data[at] == INTERESTING_BYTES[k] {
                // The values are distinct, so the next one differs from the byte.
                k = (k + 1) % INTERESTING_BYTES.len();
            }
            data[at] = INTERESTING_BYTES[k];
            true
        }
        Mutation::InsertRandom => {
            if room == 0 {
                return false;
            }
            let n = small_len(rng, room);
            let at = index(rng, len + 1);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            data.splice(at..at, bytes);
            true
        }
        Mutation::DeleteRange => {
            if len == 0 {
                return false;
            }
            let at = index(rng, len);
            let n = small_len(rng, len - at);
            data.drain(at..at + n);
            true
        }
        Mutation::DuplicateRange => {
            if len == 0 || room == 0 {
                return false;
            }
            let from = index(rng, len);
            let n = small_len(rng, (len - from).min(room));
            let chunk = data[from..from + n].to_vec();
            let at = index(rng, len + 1);
            data.splice(at..at, chunk);
            true
        }
        Mutation::Truncate => {
            if len == 0 {
                return false;
            }
            data.truncate(index(rng, len));
            true
        }
        Mutation::Splice => splice(data, rng, donor, room),
        Mutation::ExtremeNumber => extreme_number(data, rng, room),
    }
}

fn splice(data: &mut Vec<u8>, rng: &mut Rng, donor: &[u8], room: usize) -> bool {
    if donor.is_empty() {
        return false;
    }
    let before = data.clone();
    let from = index(rng, donor.len());
    match rng.below(3) {
        // Crossover: this input's head, the donor's tail (capped by the room left).
        0 => {
            let cut = index(rng, data.len() + 1);
            data.truncate(cut);
            let take = (donor.len() - from).min(room + (before.len() - cut));
            data.extend_from_slice(&donor[from..from + take]);
        }
        // A chunk of the donor inserted.
        1 if room > 0 => {
            let n = small_len(rng, (donor.len() - from).min(room));
            let at = index(rng, data.len() + 1);
            data.splice(at..at, donor[from..from + n].iter().copied());
        }
        // A chunk of the donor written over this input's bytes.
        _ => {
            if data.is_empty() {
                return false;
            }
            let at = index(rng, data.len());
            let n = small_len(rng, (donor.len() - from).min(data.len() - at));
            data[at..at + n].copy_from_slice(&donor[from..from + n]);
        }
    }
    *data != before
}

/// The `[start, end)` byte ranges of the ASCII digit runs in `data` (a `-` right before a run
/// belongs to it, so a negative number is replaced whole).
fn digit_runs(data: &[u8]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < data.len() {
        if data[i].is_ascii_digit() {
            let start = if i > 0 && data[i - 1] == b'-' { i - 1 } else { i };
            let mut end = i;
            while end < data.len() && data[end].is_ascii_digit() {
                end += 1;
            }
            runs.push((start, end));
            i = end;
        } else {
            i += 1;
        }
    }
    runs
}

fn extreme_number(data: &mut Vec<u8>, rng: &mut Rng, room: usize) -> bool {
    let mut k = index(rng, EXTREME_NUMBERS.len());
    let runs = digit_runs(data);
    if runs.is_empty() {
        let number = EXTREME_NUMBERS[k].as_bytes();
        if number.len() > room {
            return false;
        }
        let at = index(rng, data.len() + 1);
        data.splice(at..at, number.iter().copied());
        return true;
    }
    let (start, end) = runs[index(rng, runs.len())];
    if EXTREME_NUMBERS[k].as_bytes() == &data[start..end] {
        k = (k + 1) % EXTREME_NUMBERS.len();
    }
    let number = EXTREME_NUMBERS[k].as_bytes();
    if number.len() > room + (end - start) {
        return false;
    }
    data.splice(start..end, number.iter().copied());
    true
}

/// Stacks 1 to 8 random mutations on `data` (fewer far more often), taking splice donors from
/// `corpus`. Returns how many changed it.
pub fn mutate(data: &mut Vec<u8>, rng: &mut Rng, corpus: &[Vec<u8>], max_len: usize) -> usize {
    let spread = 1 << rng.below(4);
    let stack = 1 + rng.below(spread) as usize;
    let mut changed = 0;
    for _ in 0..stack {
        let m = Mutation::ALL[index(rng, Mutation::ALL.len())];
        let donor = if corpus.is_empty() { &[][..] } else { &corpus[index(rng, corpus.len())][..] };
        changed += usize::from(apply(m, data, rng, donor, max_len));
    }
    // Some mutations could not apply (an empty input): make sure the input still moves.
    if changed == 0 && apply(Mutation::InsertRandom, data, rng, &[], max_len) {
        changed = 1;
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    const INPUT: &[u8] = b"{\"shape\": [12, 3], \"offsets\": [0, -40]}\nfresh,\"a, b\",7\n";
    const DONOR: &[u8] = b"PTCKPT01 something entirely different 123456789";

    fn mutated(m: Mutation, seed: u64) -> Vec<u8> {
        let mut data = INPUT.to_vec();
        assert!(apply(m, &mut data, &mut Rng::new(seed), DONOR, 4096), "{m:?} did not apply (seed {seed})");
        data
    }

    /// Every mutation changes the input, gives the same bytes for the same seed, and
    /// different bytes across seeds.
    #[test]
    fn fuzz_each_mutation_changes_input_deterministically() {
        for m in Mutation::ALL {
            let mut distinct = std::collections::HashSet::new();
            for seed in 0..32 {
                let a = mutated(m, seed);
                assert_ne!(a, INPUT, "{m:?} left the input unchanged (seed {seed})");
                assert_eq!(a, mutated(m, seed), "{m:?} is not deterministic (seed {seed})");
                distinct.insert(a);
            }
            assert!(distinct.len() > 4, "{m:?}: only {} distinct outputs over 32 seeds", distinct.len());
        }
    }

    #[test]
    fn fuzz_mutations_respect_the_size_limit_and_empty_inputs() {
        let mut rng = Rng::new(5);
        for m in Mutation::ALL {
            let mut full = INPUT.to_vec();
            apply(m, &mut full, &mut rng, DONOR, INPUT.len());
            assert!(full.len() <= INPUT.len(), "{m:?} grew past the limit");
            let mut empty = Vec::new();
            let changed = apply(m, &mut empty, &mut rng, DONOR, 64);
            assert_eq!(changed, !empty.is_empty(), "{m:?} on an empty input");
        }
        let mut data = Vec::new();
        assert!(mutate(&mut data, &mut rng, &[], 64) > 0 && !data.is_empty());
    }

    #[test]
    fn fuzz_extreme_numbers_replace_whole_digit_runs() {
        assert_eq!(digit_runs(b"a12,-3 x"), [(1, 3), (4, 6)]);
        for seed in 0..32 {
            let out = mutated(Mutation::ExtremeNumber, seed);
            let text = String::from_utf8(out).unwrap();
            assert!(EXTREME_NUMBERS.iter().any(|n| text.contains(n)), "{text}");
        }
    }
}
