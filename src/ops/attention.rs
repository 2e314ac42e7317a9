//! Multi-head scaled-dot-product attention with a key padding mask, a causal mask, attention
//! dropout, and keys/values that may start with a prefix computed earlier (TeraPipe's token
//! slices: queries for positions `c..c+l` attend to keys `0..c+l`).
//!
//! Layout: `q` is `[batch, q_len, heads·head_dim]`, `k` and `v` are
//! `[batch, kv_len, heads·head_dim]` with `kv_len = prefix + q_len`, heads interleaved in the
//! last dimension. Query `i` sits at absolute position `prefix + i`; under the causal mask it
//! sees keys `j ≤ prefix + i`.

use crate::error::{Result, check_len, config_error};
use crate::ops::dropout::{keep_threshold, kept};
use crate::ops::matmul::{MatRef, matmul_with};
use crate::ops::simd::{exp, vectorized};
use crate::scalar::Float;
use gemm::Parallelism;
use rayon::prelude::*;

/// Dimensions and options of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionDims {
    /// Sequences in the batch.
    pub batch: usize,
    /// Query positions in this call.
    pub q_len: usize,
    /// Key/value positions: the prefix computed earlier plus `q_len`.
    pub kv_len: usize,
    /// Attention heads.
    pub heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Whether query `i` may only see keys `j ≤ prefix + i`.
    pub causal: bool,
    /// Drop probability applied to the attention probabilities (0 in eval).
    pub dropout: f32,
    /// Seed of the dropout mask; element `(b, h, i, j)` of the probabilities uses counter
    /// `dropout_offset + ((b·heads + h)·mask_seq + prefix + i)·mask_seq + j`: its coordinates in
    /// the whole sequence's `mask_seq × mask_seq` mask, so a token slice draws the unsliced mask.
    pub dropout_seed: u64,
    /// Counter offset of the dropout mask (see `dropout_seed`).
    pub dropout_offset: u64,
    /// Positions of the whole sequence the dropout mask spans (`kv_len` unless the call is a
    /// token slice of a longer sequence; at least `kv_len`).
    pub mask_seq: usize,
}

impl AttentionDims {
    /// Keys before the first query: `kv_len − q_len`.
    pub fn prefix(&self) -> usize {
        self.kv_len - self.q_len
    }
}

/// Writes `out = dropout(softmax(q·kᵀ/√head_dim + mask))·v` and saves the undropped
/// probabilities `probs[batch, heads, q_len, kv_len]` for the backward. With dropout on, an
/// element whose dropout factor is 0 (dropped, or hidden by the causal mask) is saved with its
/// sign bit set (`−P`; `−0.0` for a zero): probabilities are never negative, so the backward reads
/// the mask back from `probs` instead of hashing every element again. `key_mask[b, j] == 0`
/// hides key `j` of sequence `b`. A query that can see no key gets zero probabilities and a
/// zero output.
///
/// Errors: a wrong-length slice is an [`Error::Shape`](crate::Error::Shape) naming it;
/// `kv_len < q_len`, `head_dim == 0` or a dropout outside `[0, 1)` is an
/// [`Error::Config`](crate::Error::Config) on `attention.kv_len`, `attention.head_dim` or
/// `attention.dropout`.
///
/// Work is one rayon task per sequence, looping over its heads: heads are interleaved in the
/// channels, so a sequence's rows are the smallest piece of `out` (and of `dq`, `dk`, `dv`)
/// one task can own, and every product then writes straight into its head's column block with
/// no temporaries. (Parallelism is therefore `batch`-wide.) Each task reuses one
/// `q_len × kv_len` scratch across its heads (none in the forward without dropout), and nothing
/// depends on the thread count, so results are bitwise reproducible.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward<T: Float>(
    out: &mut [T],
    probs: &mut [T],
    q: &[T],
    k: &[T],
    v: &[T],
    key_mask: Option<&[u32]>,
    d: &AttentionDims,
) -> Result<()> {
    const OP: &str = "attention_forward";
    check_dims(d)?;
    let AttentionDims { batch, q_len, kv_len, heads, head_dim, .. } = *d;
    let c = heads * head_dim;
    check_len(OP, "out", out.len(), batch * q_len * c)?;
    check_len(OP, "probs", probs.len(), batch * heads * q_len * kv_len)?;
    check_len(OP, "q", q.len(), batch * q_len * c)?;
    check_len(OP, "k", k.len(), batch * kv_len * c)?;
    check_len(OP, "v", v.len(), batch * kv_len * c)?;
    if let Some(m) = key_mask {
        check_len(OP, "key_mask", m.len(), batch * kv_len)?;
    }
    if batch * heads * q_len == 0 {
        return Ok(()); // no query: `out` and `probs` are empty
    }
    let scale = T::from_f64(1.0 / (head_dim as f64).sqrt());
    let dropout = d.dropout > 0.0;

    // One task per sequence: it owns its rows of `out` and its heads' blocks of `probs`.
    out.par_chunks_mut(q_len * c).zip(probs.par_chunks_mut(heads * q_len * kv_len)).enumerate().for_each_init(
        || vec![T::ZERO; if dropout { q_len * kv_len } else { 0 }],
        |dropped, (b, (out_b, probs_b))| {
            let mask_b = key_mask.map(|m| &m[b * kv_len..(b + 1) * kv_len]);
            for (h, p) in probs_b.chunks_exact_mut(q_len * kv_len).enumerate() {
                let (qh, kh, vh) = (head(q, b, h, q_len, d), head(k, b, h, kv_len, d), head(v, b, h, kv_len, d));
                // 1. Scores S = q_h·k_hᵀ (q_len × kv_len), straight into this head's probs.
                matmul_with(p, kv_len, qh, kh.t(), q_len, kv_len, head_dim, false, Parallelism::None);
                // 2. P = softmax(S·scale) over the keys each query may see, in place.
                vectorized(
                    #[inline(always)]
                    || {
                        for (i, row) in p.chunks_exact_mut(kv_len).enumerate() {
                            softmax_row(row, visible_end(d, i), mask_b, scale);
                        }
                    },
                );
                // 3. Pd = dropout(P) in the scratch; `probs` keeps P, its sign bit set where
                //    the factor is 0.
                if dropout {
                    vectorized(
                        #[inline(always)]
                        || {
                            dropout_factors(dropped, d, b * heads + h);
                            // Every element stored, kept or not: written as "negate where
                            // dropped", the loop vectorises to masked stores, slow on AMD's
                            // cores (this forward 5 % faster without them on a Zen 3:
                            // docs/PERF.md). `|P|` is `P`: probabilities are never negative.
                            for (x, p) in dropped.iter_mut().zip(p.iter_mut()) {
                                let (factor, prob) = (*x, p.abs());
                                *x = factor * prob;
                                *p = if factor == T::ZERO { -prob } else { prob };
                            }
                        },
                    );
                }
                let pd = if dropout { &dropped[..] } else { &p[..] };
                // 4. out_h = Pd·v_h, into head h's channels of this sequence's rows.
                let pd = MatRef::rows(pd, kv_len);
                let out_h = &mut out_b[h * head_dim..];
                matmul_with(out_h, c, pd, vh, q_len, head_dim, kv_len, false, Parallelism::None);
            }
        },
    );
    Ok(())
}

/// Writes `dq`, `dk` and `dv` (gradients for the whole key/value range, prefix included) from
/// `dout` and the saved `probs`.
///
/// The forward's steps, reversed, for each head of each sequence (one task per sequence, as in
/// the forward): `dv = Pdᵀ·dout`,
/// `dP = dropout(dout·vᵀ)` (same mask and scaling as `Pd = dropout(P)`),
/// `dS = P ⊙ (dP − rowsum(P ⊙ dP))`, `dq = dS·k·scale`, `dk = dSᵀ·q·scale`. The dropout mask
/// is read from the sign bits of `probs`, where the forward left it: `probs` must come from
/// [`attention_forward`] with the same `d` (probabilities from elsewhere, unsigned, would read as
/// all kept). Errors as in [`attention_forward`].
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Float>(
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    dout: &[T],
    q: &[T],
    k: &[T],
    v: &[T],
    probs: &[T],
    key_mask: Option<&[u32]>,
    d: &AttentionDims,
) -> Result<()> {
    const OP: &str = "attention_backward";
    check_dims(d)?;
    let AttentionDims { batch, q_len, kv_len, heads, head_dim, .. } = *d;
    let c = heads * head_dim;
    check_len(OP, "dq", dq.len(), batch * q_len * c)?;
    check_len(OP, "dk", dk.len(), batch * kv_len * c)?;
    check_len(OP, "dv", dv.len(), batch * kv_len * c)?;
    check_len(OP, "dout", dout.len(), batch * q_len * c)?;
    check_len(OP, "q", q.len(), batch * q_len * c)?;
    check_len(OP, "k", k.len(), batch * kv_len * c)?;
    check_len(OP, "v", v.len(), batch * kv_len * c)?;
    check_len(OP, "probs", probs.len(), batch * heads * q_len * kv_len)?;
    if let Some(m) = key_mask {
        check_len(OP, "key_mask", m.len(), batch * kv_len)?;
    }
    if batch * heads * q_len == 0 {
        // No query looked at any key: every gradient is zero.
        dq.fill(T::ZERO);
        dk.fill(T::ZERO);
        dv.fill(T::ZERO);
        return Ok(());
    }
    let scale = T::from_f64(1.0 / (head_dim as f64).sqrt());
    let dropout = d.dropout > 0.0;
    let inv_keep = T::from_f64(1.0 / (1.0 - d.dropout as f64));

    // One task per sequence: it owns its rows of dq, dk and dv.
    dq.par_chunks_mut(q_len * c)
        .zip(dk.par_chunks_mut(kv_len * c))
        .zip(dv.par_chunks_mut(kv_len * c))
        .zip(probs.par_chunks(heads * q_len * kv_len))
        .enumerate()
        .for_each_init(
            // Scratch: one q_len × kv_len matrix for Pd, then dPd, then dS.
            || vec![T::ZERO; q_len * kv_len],
            |scratch, (b, (((dq_b, dk_b), dv_b), probs_b))| {
                for (h, p) in probs_b.chunks_exact(q_len * kv_len).enumerate() {
                    let (qh, kh, vh) = (head(q, b, h, q_len, d), head(k, b, h, kv_len, d), head(v, b, h, kv_len, d));
                    let douth = head(dout, b, h, q_len, d);
                    let (dq_h, dk_h, dv_h) =
                        (&mut dq_b[h * head_dim..], &mut dk_b[h * head_dim..], &mut dv_b[h * head_dim..]);

                    // 4. out_h = Pd·v_h: dv_h = Pdᵀ·dout_h, with Pd = dropout(P) rebuilt from
                    //    the saved P and its sign bits; then dPd = dout_h·v_hᵀ into the scratch.
                    let pd = if dropout {
                        vectorized(
                            #[inline(always)]
                            || {
                                for (x, &s) in scratch.iter_mut().zip(p) {
                                    *x = saved_factor(s, inv_keep) * s.abs();
                                }
                            },
                        );
                        &scratch[..]
                    } else {
                        p
                    };
                    let pd = MatRef::rows(pd, kv_len);
                    matmul_with(dv_h, c, pd.t(), douth, kv_len, head_dim, q_len, false, Parallelism::None);
                    matmul_with(scratch, kv_len, douth, vh.t(), q_len, kv_len, head_dim, false, Parallelism::None);
                    // 3. Pd = P ⊙ factors: dP = dPd ⊙ factors, in place.
                    // 2. P = softmax(S·scale): dS = P ⊙ (dP − Σⱼ P⊙dP), times the score scale
                    //    of step 1 so the products below are dq and dk directly. Hidden keys
                    //    have P = 0, hence dS = 0: the masks need no second look. (P is the
                    //    saved value's magnitude: with dropout off its sign bit is never set.)
                    vectorized(
                        #[inline(always)]
                        || {
                            if dropout {
                                for (x, &s) in scratch.iter_mut().zip(p) {
                                    *x *= saved_factor(s, inv_keep);
                                }
                            }
                            for (ds, p) in scratch.chunks_exact_mut(kv_len).zip(p.chunks_exact(kv_len)) {
                                let pdp = lane_dot_magnitude(p, ds);
                                for (ds, &p) in ds.iter_mut().zip(p) {
                                    *ds = p.abs() * (*ds - pdp) * scale;
                                }
                            }
                        },
                    );
                    // 1. S = q_h·k_hᵀ: dq_h = dS·k_h and dk_h = dSᵀ·q_h (the scale is in dS).
                    let ds = MatRef::rows(&scratch[..], kv_len);
                    matmul_with(dq_h, c, ds, kh, q_len, head_dim, kv_len, false, Parallelism::None);
                    matmul_with(dk_h, c, ds.t(), qh, kv_len, head_dim, q_len, false, Parallelism::None);
                }
            },
        );
    Ok(())
}

/// The dimension checks shared by forward and backward (lengths are checked by each).
fn check_dims(d: &AttentionDims) -> Result<()> {
    if d.kv_len < d.q_len {
        return Err(config_error(
            "attention.kv_len",
            format!(
                "kv_len {} is below q_len {}: keys are a prefix plus the queries' own positions",
                d.kv_len, d.q_len
            ),
        ));
    }
    if d.head_dim == 0 {
        return Err(config_error("attention.head_dim", "must be at least 1 (scores are scaled by 1/√head_dim)"));
    }
    if !(0.0..1.0).contains(&d.dropout) {
        return Err(config_error("attention.dropout", format!("{} is not in [0, 1)", d.dropout)));
    }
    if d.mask_seq < d.kv_len {
        return Err(config_error(
            "attention.mask_seq",
            format!("{} is below kv_len {}: the dropout mask spans the whole sequence", d.mask_seq, d.kv_len),
        ));
    }
    Ok(())
}

/// Head `h` of sequence `b` of a `[batch, len, heads·head_dim]` tensor, as a `len × head_dim`
/// view whose rows are `heads·head_dim` apart (no copy).
fn head<'a, T>(x: &'a [T], b: usize, h: usize, len: usize, d: &AttentionDims) -> MatRef<'a, T> {
    let c = d.heads * d.head_dim;
    MatRef::strided(&x[b * len * c + h * d.head_dim..(b + 1) * len * c], c)
}

/// Keys `j < visible_end(d, i)` may be seen by query `i` (before the padding mask): all of them,
/// or under the causal mask those up to its own absolute position `prefix + i`.
fn visible_end(d: &AttentionDims, i: usize) -> usize {
    if d.causal { d.prefix() + i + 1 } else { d.kv_len }
}

/// In place: `row[j] ← softmax(row·scale)[j]` over the visible keys (`j < end` and not
/// masked), exact zeros elsewhere. Masked keys become −∞ before the max is subtracted, so
/// `exp` maps them to exactly 0 and no visible key overflows; a row with no visible key
/// becomes all zeros, and a row with a NaN score all NaNs (also where `lane_max` skipped them
/// all).
#[inline(always)]
fn softmax_row<T: Float>(row: &mut [T], end: usize, mask: Option<&[u32]>, scale: T) {
    let neg_inf = T::from_f64(f64::NEG_INFINITY);
    let (seen, hidden) = row.split_at_mut(end);
    hidden.fill(T::ZERO);
    match mask {
        Some(m) => {
            for (x, &m) in seen.iter_mut().zip(m) {
                *x = if m != 0 { *x * scale } else { neg_inf };
            }
        }
        None => seen.iter_mut().for_each(|x| *x *= scale),
    }
    let max = lane_max(seen);
    if max == neg_inf {
        // No visible key, or only NaN scores.
        let nan = seen.iter().any(|x| x.to_f64().is_nan());
        seen.fill(if nan { T::from_f64(f64::NAN) } else { T::ZERO });
        return;
    }
    for x in seen.iter_mut() {
        *x = exp(*x - max);
    }
    // sum ≥ 1: the maximal key contributes exp(0).
    let inv = T::ONE / lane_sum(seen);
    seen.iter_mut().for_each(|x| *x *= inv);
}

/// Partial results the row reductions keep: independent accumulators let the loop vectorise
/// (one sequential accumulator would serialise on the add latency). The combination order is
/// fixed, so results do not depend on threads.
const LANES: usize = 16;

/// The largest element of `x` (−∞ for an empty slice). NaNs are not propagated.
#[inline(always)]
fn lane_max<T: Float>(x: &[T]) -> T {
    let neg_inf = T::from_f64(f64::NEG_INFINITY);
    let mut acc = [neg_inf; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    for (a, &v) in acc.iter_mut().zip(rest) {
        *a = if v > *a { v } else { *a };
    }
    acc.into_iter().fold(neg_inf, |m, a| if a > m { a } else { m })
}

/// `Σ xᵢ`, in [`LANES`] interleaved partial sums.
#[inline(always)]
fn lane_sum<T: Float>(x: &[T]) -> T {
    let mut acc = [T::ZERO; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(rest) {
        *a += v;
    }
    acc.into_iter().fold(T::ZERO, |s, a| s + a)
}

/// `Σ |xᵢ|·yᵢ` (`x` and `y` of equal length), in [`LANES`] interleaved partial sums: `x` is
/// saved probabilities, whose sign bits carry the dropout mask.
#[inline(always)]
fn lane_dot_magnitude<T: Float>(x: &[T], y: &[T]) -> T {
    let mut acc = [T::ZERO; LANES];
    let (xc, yc) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (xc, yc) in xc.zip(yc) {
        for ((a, &v), &w) in acc.iter_mut().zip(xc).zip(yc) {
            *a += v.abs() * w;
        }
    }
    for ((a, &v), &w) in acc.iter_mut().zip(xr).zip(yr) {
        *a += v.abs() * w;
    }
    acc.into_iter().fold(T::ZERO, |s, a| s + a)
}

/// Writes head `bh = b·heads + h`'s dropout factors: `f[i, j] = 1/(1−p)` if element `(i, j)`
/// of its probabilities is kept, else 0, with counter
/// `dropout_offset + (bh·mask_seq + prefix + i)·mask_seq + j` (see
/// [`AttentionDims::dropout_seed`]). Keys a
/// query cannot see under the causal mask have `P = 0` whatever the factor: they get 0 unhashed.
#[inline(always)]
fn dropout_factors<T: Float>(f: &mut [T], d: &AttentionDims, bh: usize) {
    let kv_len = d.kv_len;
    for (i, row) in f.chunks_exact_mut(kv_len).enumerate() {
        let first = d.dropout_offset.wrapping_add(((bh * d.mask_seq + d.prefix() + i) * d.mask_seq) as u64);
        let (seen, hidden) = row.split_at_mut(visible_end(d, i));
        keep_factors(seen, d.dropout_seed, first, d.dropout);
        hidden.fill(T::ZERO);
    }
}

/// The dropout factor of a saved probability: 0 where its sign bit is set, else `inv_keep`
/// (`1/(1−p)`).
#[inline(always)]
fn saved_factor<T: Float>(saved: T, inv_keep: T) -> T {
    if saved.is_sign_negative() { T::ZERO } else { inv_keep }
}

/// `f[e] = keep(seed, first + e, p) ? 1/(1−p) : 0`. Hashing is most of attention dropout's
/// cost (four 64-bit multiplies per element), hence once per forward (the backward reads the
/// mask from the saved probabilities' sign bits); inside [`vectorized`] those multiplies
/// vectorise (AVX-512DQ's `vpmullq`, or AVX2's 32-bit pieces). Same bits either way.
#[inline(always)]
fn keep_factors<T: Float>(f: &mut [T], seed: u64, first: u64, p: f32) {
    let inv_keep = T::from_f64(1.0 / (1.0 - p as f64));
    let threshold = keep_threshold(p);
    for (e, x) in f.iter_mut().enumerate() {
        *x = if kept(seed, first.wrapping_add(e as u64), threshold) { inv_keep } else { T::ZERO };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::ops::dropout::dropout_keep;
    use crate::testing::{FD_STEP, Rng, assert_grad, dot, numeric_gradient, rel_err};

    fn dims(batch: usize, q_len: usize, kv_len: usize, heads: usize, head_dim: usize, causal: bool) -> AttentionDims {
        AttentionDims {
            batch,
            q_len,
            kv_len,
            heads,
            head_dim,
            causal,
            dropout: 0.0,
            dropout_seed: 0x5EED,
            dropout_offset: 1000,
            // Wider than the keys, as in a token slice: the mask's coordinates must use it.
            mask_seq: kv_len + 2,
        }
    }

    /// Random `q`, `k`, `v` for `d`, uniform in [-scale, scale).
    fn qkv(rng: &mut Rng, d: &AttentionDims, scale: f64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let c = d.heads * d.head_dim;
        (
            rng.vec(d.batch * d.q_len * c, scale),
            rng.vec(d.batch * d.kv_len * c, scale),
            rng.vec(d.batch * d.kv_len * c, scale),
        )
    }

    /// The definition in plain loops, in f64: returns `(out, probs)`, `probs` signed as
    /// [`attention_forward`] saves them.
    fn reference(q: &[f64], k: &[f64], v: &[f64], mask: Option<&[u32]>, d: &AttentionDims) -> (Vec<f64>, Vec<f64>) {
        let (hd, c, prefix) = (d.head_dim, d.heads * d.head_dim, d.prefix());
        let scale = 1.0 / (hd as f64).sqrt();
        let mut out = vec![0.0; d.batch * d.q_len * c];
        let mut probs = vec![0.0; d.batch * d.heads * d.q_len * d.kv_len];
        for b in 0..d.batch {
            for h in 0..d.heads {
                for i in 0..d.q_len {
                    let visible =
                        |j: usize| mask.is_none_or(|m| m[b * d.kv_len + j] != 0) && (!d.causal || j <= prefix + i);
                    let s: Vec<f64> = (0..d.kv_len)
                        .map(|j| {
                            (0..hd)
                                .map(|x| q[(b * d.q_len + i) * c + h * hd + x] * k[(b * d.kv_len + j) * c + h * hd + x])
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let max = (0..d.kv_len).filter(|&j| visible(j)).map(|j| s[j]).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = (0..d.kv_len).filter(|&j| visible(j)).map(|j| (s[j] - max).exp()).sum();
                    let row = ((b * d.heads + h) * d.q_len + i) * d.kv_len;
                    for j in 0..d.kv_len {
                        let p = if visible(j) { (s[j] - max).exp() / sum } else { 0.0 };
                        let mask_row = (b * d.heads + h) * d.mask_seq + prefix + i;
                        let counter = d.dropout_offset + (mask_row * d.mask_seq + j) as u64;
                        // Saved with the sign bit set where the dropout factor is 0.
                        let causally_hidden = d.causal && j > prefix + i;
                        let dropped = causally_hidden || !dropout_keep(d.dropout_seed, counter, d.dropout);
                        probs[row + j] = if d.dropout > 0.0 && dropped { -p } else { p };
                        let pd = if d.dropout == 0.0 {
                            p
                        } else if dropout_keep(d.dropout_seed, counter, d.dropout) {
                            p / (1.0 - d.dropout as f64)
                        } else {
                            0.0
                        };
                        for x in 0..hd {
                            out[(b * d.q_len + i) * c + h * hd + x] += pd * v[(b * d.kv_len + j) * c + h * hd + x];
                        }
                    }
                }
            }
        }
        (out, probs)
    }

    /// Runs the kernel forward: `(out, probs)`.
    fn forward<T: Float>(q: &[T], k: &[T], v: &[T], mask: Option<&[u32]>, d: &AttentionDims) -> (Vec<T>, Vec<T>) {
        let mut out = vec![T::ZERO; d.batch * d.q_len * d.heads * d.head_dim];
        let mut probs = vec![T::ZERO; d.batch * d.heads * d.q_len * d.kv_len];
        attention_forward(&mut out, &mut probs, q, k, v, mask, d).unwrap();
        (out, probs)
    }

    /// Runs the kernel backward: `(dq, dk, dv)`.
    #[allow(clippy::too_many_arguments)]
    fn backward<T: Float>(
        dout: &[T],
        q: &[T],
        k: &[T],
        v: &[T],
        probs: &[T],
        mask: Option<&[u32]>,
        d: &AttentionDims,
    ) -> (Vec<T>, Vec<T>, Vec<T>) {
        let (mut dq, mut dk, mut dv) = (vec![T::ZERO; q.len()], vec![T::ZERO; k.len()], vec![T::ZERO; v.len()]);
        attention_backward(&mut dq, &mut dk, &mut dv, dout, q, k, v, probs, mask, d).unwrap();
        (dq, dk, dv)
    }

    /// Kernel forward against the plain-loop reference: 1e-12 relative (f64 rounding only), and
    /// every saved probability's sign bit (the dropout mask, zeros included) exactly.
    fn check_forward(d: &AttentionDims, mask: Option<&[u32]>, seed: u64) -> (Vec<f64>, Vec<f64>) {
        let (q, k, v) = qkv(&mut Rng::new(seed), d, 2.0);
        let (want_out, want_probs) = reference(&q, &k, &v, mask, d);
        let (out, probs) = forward(&q, &k, &v, mask, d);
        assert!(rel_err(&out, &want_out) < 1e-12, "out: {:e}", rel_err(&out, &want_out));
        assert!(rel_err(&probs, &want_probs) < 1e-12, "probs: {:e}", rel_err(&probs, &want_probs));
        let signs = |x: &[f64]| x.iter().map(|x| x.is_sign_negative()).collect::<Vec<_>>();
        assert_eq!(signs(&probs), signs(&want_probs), "sign bits (the dropout mask)");
        (out, probs)
    }

    #[test]
    fn forward_no_mask_matches_reference() {
        check_forward(&dims(2, 7, 7, 3, 4, false), None, 1);
        check_forward(&dims(1, 1, 1, 1, 1, false), None, 2);
    }

    /// Padding mask: random keys hidden in sequence 0, every key hidden in sequence 1, so its
    /// queries see nothing and get exactly zero probabilities and output.
    #[test]
    fn forward_padding_mask_matches_reference() {
        let d = dims(3, 9, 9, 2, 4, false);
        let mut mask = vec![1u32; 3 * 9];
        for j in [1, 4, 5, 8] {
            mask[j] = 0;
        }
        mask[9..18].fill(0);
        mask[18 + 6..27].fill(0); // sequence 2: trailing padding
        let (out, probs) = check_forward(&d, Some(&mask), 3);
        let c = d.heads * d.head_dim;
        assert!(out[9 * c..18 * c].iter().all(|&x| x == 0.0));
        assert!(probs[2 * 9 * 9..4 * 9 * 9].iter().all(|&x| x == 0.0));
        // Hidden keys get exact zeros; visible rows sum to one.
        for row in probs.chunks(9).take(2 * 9) {
            assert!([1, 4, 5, 8].iter().all(|&j| row[j] == 0.0));
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }

    #[test]
    fn forward_causal_matches_reference() {
        let d = dims(2, 11, 11, 3, 4, true);
        let (_, probs) = check_forward(&d, None, 4);
        for (r, row) in probs.chunks(11).enumerate() {
            let i = r % 11;
            assert!(row[i + 1..].iter().all(|&x| x == 0.0), "row {r} sees the future");
        }
    }

    /// Causal with a prefix of 4 cached keys, plus padding that hides keys 0..6 of sequence 0,
    /// so its first two queries (which see keys ≤ 4 and ≤ 5) see nothing.
    #[test]
    fn forward_causal_prefix_matches_reference() {
        let d = dims(2, 9, 13, 2, 4, true);
        check_forward(&d, None, 5);
        let mut mask = vec![1u32; 2 * 13];
        mask[..6].fill(0);
        let (out, _) = check_forward(&d, Some(&mask), 6);
        let c = d.heads * d.head_dim;
        assert!(out[..2 * c].iter().all(|&x| x == 0.0));
        assert!(out[2 * c..3 * c].iter().any(|&x| x != 0.0));
    }

    #[test]
    fn forward_dropout_matches_reference() {
        let mut d = dims(2, 8, 12, 3, 4, true);
        d.dropout = 0.3;
        let mut mask = vec![1u32; 2 * 12];
        mask[12 + 10..].fill(0);
        let (q, k, v) = qkv(&mut Rng::new(7), &d, 2.0);
        let (out, _) = check_forward(&d, Some(&mask), 7);
        // Dropout did something: the output differs from the undropped one.
        let (out_nodrop, _) = reference(&q, &k, &v, Some(&mask), &AttentionDims { dropout: 0.0, ..d });
        assert!(rel_err(&out, &out_nodrop) > 0.1);
    }

    #[test]
    fn forward_f32_matches_f64() {
        let d = dims(2, 20, 24, 2, 16, true);
        let mut mask = vec![1u32; 2 * 24];
        mask[3] = 0;
        mask[24 + 20..].fill(0);
        let (q, k, v) = qkv(&mut Rng::new(8), &d, 2.0);
        let (out64, probs64) = forward(&q, &k, &v, Some(&mask), &d);
        let f32s = |x: &[f64]| x.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let (out32, probs32) = forward(&f32s(&q), &f32s(&k), &f32s(&v), Some(&mask), &d);
        assert!(rel_err(&out32, &out64) < 1e-5, "out {:e}", rel_err(&out32, &out64));
        assert!(rel_err(&probs32, &probs64) < 1e-5, "probs {:e}", rel_err(&probs32, &probs64));
    }

    /// Analytic dq, dk, dv against central finite differences of `L = Σ out ⊙ R` in f64.
    fn check_backward(d: &AttentionDims, mask: Option<&[u32]>, seed: u64) {
        let mut rng = Rng::new(seed);
        let (mut q, mut k, mut v) = qkv(&mut rng, d, 1.0);
        let r = rng.vec(q.len(), 1.0);
        let (_, probs) = forward(&q, &k, &v, mask, d);
        let (dq, dk, dv) = backward(&r, &q, &k, &v, &probs, mask, d);
        let loss = |q: &[f64], k: &[f64], v: &[f64]| dot(&forward(q, k, v, mask, d).0, &r);
        let (q0, k0, v0) = (q.clone(), k.clone(), v.clone());
        assert_grad("dq", &dq, &numeric_gradient(&mut q, FD_STEP, |x| loss(x, &k0, &v0)));
        assert_grad("dk", &dk, &numeric_gradient(&mut k, FD_STEP, |x| loss(&q0, x, &v0)));
        assert_grad("dv", &dv, &numeric_gradient(&mut v, FD_STEP, |x| loss(&q0, &k0, x)));
    }

    /// Odd shapes, prefix 4, causal + padding (sequence 2's first query sees nothing).
    #[test]
    fn backward_causal_padding_prefix_matches_finite_differences() {
        let d = dims(3, 13, 17, 3, 5, true);
        let mut mask = vec![1u32; 3 * 17];
        for j in [2, 7, 16] {
            mask[j] = 0;
        }
        mask[17 + 12..2 * 17].fill(0);
        mask[2 * 17..2 * 17 + 5].fill(0);
        check_backward(&d, Some(&mask), 10);
        check_backward(&AttentionDims { causal: false, ..d }, Some(&mask), 11);
    }

    /// The dropout mask is a fixed function of (seed, counter), so L stays smooth in q, k, v.
    #[test]
    fn backward_dropout_matches_finite_differences() {
        let mut d = dims(3, 13, 17, 3, 5, true);
        d.dropout = 0.2;
        let mut mask = vec![1u32; 3 * 17];
        mask[17 + 15..2 * 17].fill(0);
        check_backward(&d, Some(&mask), 12);
        check_backward(&AttentionDims { causal: false, ..d }, None, 13);
    }

    #[test]
    fn backward_small_shapes_match_finite_differences() {
        check_backward(&dims(2, 1, 6, 2, 3, true), None, 14); // one new token over a cached prefix
        check_backward(&dims(2, 1, 1, 2, 3, false), None, 15);
        let mut mask = vec![1u32; 9];
        mask[4] = 0;
        check_backward(&dims(1, 9, 9, 2, 4, false), Some(&mask), 16);
        check_backward(&dims(1, 5, 9, 1, 7, true), Some(&mask), 17);
    }

    /// Positions `[start, end)` of every sequence of a `[batch, len, c]` tensor.
    fn positions<T: Copy>(x: &[T], batch: usize, len: usize, c: usize, start: usize, end: usize) -> Vec<T> {
        (0..batch).flat_map(|b| x[(b * len + start) * c..(b * len + end) * c].iter().copied()).collect()
    }

    /// What token slicing relies on: causal attention over 17 positions equals the slice
    /// [0, 4) (no prefix) followed by the slice [4, 17) with the first 4 keys as its prefix, in
    /// the forward, in dq, and in dk/dv once the two slices' contributions are summed.
    #[test]
    fn prefix_slices_equal_full_sequence() {
        let (batch, len, cut, heads, hd) = (2, 17, 4, 3, 5);
        let c = heads * hd;
        let full = dims(batch, len, len, heads, hd, true);
        let first = dims(batch, cut, cut, heads, hd, true);
        let second = dims(batch, len - cut, len, heads, hd, true);
        let mut rng = Rng::new(20);
        let (q, k, v) = qkv(&mut rng, &full, 2.0);
        let dout = rng.vec(q.len(), 1.0);
        let mut mask = vec![1u32; batch * len];
        mask[len + 2] = 0;
        mask[len + 9] = 0;
        let mask_first = positions(&mask, batch, len, 1, 0, cut);
        let part = |x: &[f64], s, e| positions(x, batch, len, c, s, e);

        let (out, probs) = forward(&q, &k, &v, Some(&mask), &full);
        let (dq, dk, dv) = backward(&dout, &q, &k, &v, &probs, Some(&mask), &full);

        let (k1, v1) = (part(&k, 0, cut), part(&v, 0, cut));
        let (out1, probs1) = forward(&part(&q, 0, cut), &k1, &v1, Some(&mask_first), &first);
        let (dq1, dk1, dv1) =
            backward(&part(&dout, 0, cut), &part(&q, 0, cut), &k1, &v1, &probs1, Some(&mask_first), &first);
        let (out2, probs2) = forward(&part(&q, cut, len), &k, &v, Some(&mask), &second);
        let (dq2, dk2, dv2) =
            backward(&part(&dout, cut, len), &part(&q, cut, len), &k, &v, &probs2, Some(&mask), &second);

        assert!(rel_err(&out1, &part(&out, 0, cut)) < 1e-12);
        assert!(rel_err(&out2, &part(&out, cut, len)) < 1e-12);
        assert!(rel_err(&dq1, &part(&dq, 0, cut)) < 1e-12);
        assert!(rel_err(&dq2, &part(&dq, cut, len)) < 1e-12);
        // dk/dv: slice 1 covers keys [0, 4) only; slice 2 covers all 17.
        let sum = |g1: &[f64], g2: &[f64]| -> Vec<f64> {
            let mut s = g2.to_vec();
            for b in 0..batch {
                for (x, y) in s[b * len * c..(b * len + cut) * c].iter_mut().zip(&g1[b * cut * c..(b + 1) * cut * c]) {
                    *x += y;
                }
            }
            s
        };
        assert!(rel_err(&sum(&dk1, &dk2), &dk) < 1e-12);
        assert!(rel_err(&sum(&dv1, &dv2), &dv) < 1e-12);
    }

    #[test]
    fn wrong_lengths_are_shape_errors() {
        let d = dims(2, 3, 5, 2, 4, true);
        let (c, n) = (8, 2 * 2 * 3 * 5);
        let (q, k, v) = (vec![0.0f64; 2 * 3 * c], vec![0.0; 2 * 5 * c], vec![0.0; 2 * 5 * c]);
        let (out, probs, mask) = (vec![0.0f64; q.len()], vec![0.0f64; n], vec![1u32; 2 * 5]);
        let short = |x: &[f64]| x[1..].to_vec();
        let arg = |r: Result<()>| match r {
            Err(Error::Shape { arg, .. }) => arg,
            other => panic!("expected a shape error, got {other:?}"),
        };
        let fwd = |out: &[f64], probs: &[f64], q: &[f64], k: &[f64], v: &[f64], m: &[u32]| {
            attention_forward(&mut out.to_vec(), &mut probs.to_vec(), q, k, v, Some(m), &d)
        };
        assert_eq!(arg(fwd(&short(&out), &probs, &q, &k, &v, &mask)), "out");
        assert_eq!(arg(fwd(&out, &short(&probs), &q, &k, &v, &mask)), "probs");
        assert_eq!(arg(fwd(&out, &probs, &short(&q), &k, &v, &mask)), "q");
        assert_eq!(arg(fwd(&out, &probs, &q, &short(&k), &v, &mask)), "k");
        assert_eq!(arg(fwd(&out, &probs, &q, &k, &short(&v), &mask)), "v");
        assert_eq!(arg(fwd(&out, &probs, &q, &k, &v, &mask[1..])), "key_mask");
        fwd(&out, &probs, &q, &k, &v, &mask).unwrap();

        let bwd = |g: [&[f64]; 3], dout: &[f64], x: [&[f64]; 3], p: &[f64], m: &[u32]| {
            let [dq, dk, dv] = g.map(|g| g.to_vec());
            let (mut dq, mut dk, mut dv) = (dq, dk, dv);
            attention_backward(&mut dq, &mut dk, &mut dv, dout, x[0], x[1], x[2], p, Some(m), &d)
        };
        let (g, x) = ([&q[..], &k[..], &v[..]], [&q[..], &k[..], &v[..]]);
        assert_eq!(arg(bwd([&short(&q), &k, &v], &q, x, &probs, &mask)), "dq");
        assert_eq!(arg(bwd([&q, &short(&k), &v], &q, x, &probs, &mask)), "dk");
        assert_eq!(arg(bwd([&q, &k, &short(&v)], &q, x, &probs, &mask)), "dv");
        assert_eq!(arg(bwd(g, &short(&q), x, &probs, &mask)), "dout");
        assert_eq!(arg(bwd(g, &q, [&short(&q), &k, &v], &probs, &mask)), "q");
        assert_eq!(arg(bwd(g, &q, [&q, &short(&k), &v], &probs, &mask)), "k");
        assert_eq!(arg(bwd(g, &q, [&q, &k, &short(&v)], &probs, &mask)), "v");
        assert_eq!(arg(bwd(g, &q, x, &short(&probs), &mask)), "probs");
        assert_eq!(arg(bwd(g, &q, x, &probs, &mask[1..])), "key_mask");
        bwd(g, &q, x, &probs, &mask).unwrap();
    }

    /// `kv_len < q_len` (a negative prefix), `head_dim = 0` and a dropout outside [0, 1) are
    /// configuration errors naming the field.
    #[test]
    fn bad_dims_are_config_errors() {
        let field = |d: AttentionDims| {
            let c = d.heads * d.head_dim;
            let mut out = vec![0.0f32; d.batch * d.q_len * c];
            let mut probs = vec![0.0f32; d.batch * d.heads * d.q_len * d.kv_len];
            let (q, kv) = (vec![0.0f32; out.len()], vec![0.0f32; d.batch * d.kv_len * c]);
            let fwd = attention_forward(&mut out, &mut probs, &q, &kv, &kv, None, &d);
            let (mut dq, mut dk, mut dv) = (q.clone(), kv.clone(), kv.clone());
            let bwd = attention_backward(&mut dq, &mut dk, &mut dv, &q, &q, &kv, &kv, &probs, None, &d);
            match (fwd, bwd) {
                (Err(Error::Config { field: f1, .. }), Err(Error::Config { field: f2, .. })) if f1 == f2 => f1,
                other => panic!("expected config errors, got {other:?}"),
            }
        };
        assert_eq!(field(dims(2, 5, 4, 2, 3, true)), "attention.kv_len");
        assert_eq!(field(dims(2, 5, 5, 2, 0, true)), "attention.head_dim");
        assert_eq!(field(AttentionDims { dropout: 1.0, ..dims(2, 5, 5, 2, 3, true) }), "attention.dropout");
        assert_eq!(field(AttentionDims { dropout: -0.1, ..dims(2, 5, 5, 2, 3, true) }), "attention.dropout");
    }

    /// No query (q_len 0 over a prefix): nothing to compute, and dk/dv are written as zeros.
    #[test]
    fn empty_query_writes_zero_gradients() {
        let d = dims(2, 0, 3, 2, 4, true);
        let kv = vec![1.0f64; 2 * 3 * 8];
        let (out, probs) = forward(&[], &kv, &kv, None, &d);
        assert!(out.is_empty() && probs.is_empty());
        let (mut dk, mut dv) = (vec![7.0; kv.len()], vec![7.0; kv.len()]);
        attention_backward(&mut [], &mut dk, &mut dv, &[], &[], &kv, &kv, &[], None, &d).unwrap();
        assert!(dk.iter().chain(&dv).all(|&x| x == 0.0));
    }

    /// Bitwise-equal outputs and gradients in rayon pools of 1 and 2 threads (f32, dropout,
    /// masks), and the backward overwrites rather than accumulates.
    #[test]
    fn deterministic_across_thread_counts() {
        let mut d = dims(4, 19, 23, 4, 8, true);
        d.dropout = 0.1;
        let mut rng = Rng::new(30);
        let (q, k, v) = qkv(&mut rng, &d, 2.0);
        let dout = rng.vec(q.len(), 1.0);
        let f32s = |x: &[f64]| x.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let (q, k, v, dout) = (f32s(&q), f32s(&k), f32s(&v), f32s(&dout));
        let mut mask = vec![1u32; 4 * 23];
        mask[23 + 20..2 * 23].fill(0);
        mask[5] = 0;
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (out, probs) = forward(&q, &k, &v, Some(&mask), &d);
                let (mut dq, mut dk, mut dv) = (vec![9.0f32; q.len()], vec![9.0f32; k.len()], vec![9.0f32; v.len()]);
                attention_backward(&mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, &probs, Some(&mask), &d).unwrap();
                [out, probs, dq, dk, dv].map(|x| x.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())
            })
        };
        let one = run(1);
        assert_eq!(one, run(2));
        // Gradients are written, not added onto the 9.0s the buffers started with.
        let (_, probs) = forward(&q, &k, &v, Some(&mask), &d);
        let (dq, dk, dv) = backward(&dout, &q, &k, &v, &probs, Some(&mask), &d);
        for (got, want) in one[2..].iter().zip([dq, dk, dv]) {
            assert_eq!(*got, want.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
        }
    }
}
