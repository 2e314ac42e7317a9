//! `Rng`: the one seeded generator every random draw comes from (weight init, shuffles, dropout
//! seeds), and `hash_u64`, the counter-based hash dropout masks are drawn from so that a kernel on
//! any backend can recompute the same mask from (seed, element index) without storing it.

/// SplitMix64's increment (2⁶⁴ divided by the golden ratio, odd).
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64: tiny, fast, statistically fine for initialisation and shuffling, and its whole
/// state is one `u64`, so checkpoints store it exactly (and a stream skips ahead in O(1)).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }
    /// Uniform in [0, 1), 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
    /// Uniform integer in [0, n) (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        // Lemire's multiply-shift; the bias (< n / 2^64) is irrelevant at our sizes.
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Moves the stream past its next `n` values, as `n` calls of `next_u64` would.
    pub fn skip(&mut self, n: u64) {
        self.state = self.state.wrapping_add(n.wrapping_mul(GAMMA));
    }
    /// Standard normal, by Box–Muller (two of the stream's values).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]: ln is finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
    /// `n` values uniform in [-scale, scale).
    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| (2.0 * self.uniform() - 1.0) * scale).collect()
    }
    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
    /// A new independent generator (for a sub-component), advancing this one.
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }
}

/// The SplitMix64 finaliser: a bijective avalanche mix of 64 bits.
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Counter-based hash of (seed, counter): the same bits on every backend and thread order.
#[inline(always)]
pub fn hash_u64(seed: u64, counter: u64) -> u64 {
    mix64(seed ^ mix64(counter.wrapping_add(GAMMA)))
}

/// FNV-1a, 64-bit, continuing from `h` (start from [`FNV_OFFSET`]): tiny and dependency-free;
/// enough to detect a damaged file or key a cache.
pub fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}
/// FNV-1a's offset basis.
pub const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_moves_the_stream_as_draws_do() {
        for n in [0u64, 1, 2, 7, 1 << 40] {
            let (mut drawn, mut skipped) = (Rng::new(3), Rng::new(3));
            for _ in 0..n.min(1000) {
                drawn.next_u64();
            }
            if n > 1000 {
                drawn.skip(n - 1000);
            }
            skipped.skip(n);
            assert_eq!(drawn.next_u64(), skipped.next_u64(), "n = {n}");
        }
    }
}
