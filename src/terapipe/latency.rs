//! The per-slice latency model TeraPipe plans with (reference notes, pipelines.md A.4):
//!
//! ```text
//! t(b, l, c) = t0(b, l) + Δ(b, l, c) + comm(b·l)
//! Δ(b, l, c) = a0 + a1·b·l + a2·b·c + a3·b·l·c      (c > 0; Δ = 0 at c = 0)
//! comm(n)    = c0 + c1·n
//! ```
//!
//! for a micro-batch of `b` sequences, a slice of `l` tokens and `c` tokens of context before
//! it, on ONE pipeline stage, forward and backward merged into one number (the paper's DP
//! models an F-then-B pipeline in which both passes use the same slicing).
//!
//! - `t0` is measured, not modelled: a dense table over every `b` in `1..=B` and every slice
//!   length on the token grid (`step, 2·step, …, max_len`), at context 0.
//! - `Δ` is a least-squares fit (normal equations on the four features, f64) to the samples
//!   measured with context. It is applied only for `c > 0`: a first slice is measured directly
//!   by `t0`, and the fit's intercept stands for what attending to a cache costs at all, which a
//!   first slice does not pay.
//! - `comm` is what one slice's transfers across a stage boundary cost per step: the activation
//!   sent forward and its gradient sent back (TeraPipe's `2·comm`). Time both, or double a
//!   one-way measurement, before fitting.
//!
//! The planner works on the grid: its slice lengths and contexts are multiples of the step. A
//! slicing given by hand off the grid (`--token-slices 3` on 128 tokens is `43,43,42`) is
//! priced by [`LatencyModel::slice_time_interpolated`].

use crate::error::{Result, config_error};
use std::fmt;
use std::sync::Arc;

/// The token grid a latency model is defined on: slice lengths and contexts are multiples of
/// `step` tokens, at most `max_len`, for micro-batches of `1..=max_batch` sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatencyGrid {
    /// Tokens per grid unit (TeraPipe uses 8).
    pub step: usize,
    /// The longest sequence the model covers, in tokens: a multiple of `step`.
    pub max_len: usize,
    /// The largest micro-batch the model covers, in sequences.
    pub max_batch: usize,
}

impl LatencyGrid {
    /// Checks that the grid is usable: `step > 0`, `max_len` a positive multiple of `step`,
    /// `max_batch > 0`.
    pub fn validate(&self) -> Result<()> {
        if self.step == 0 {
            return Err(config_error("terapipe.latency.step", "the token grid step must be at least 1"));
        }
        if self.max_len == 0 || !self.max_len.is_multiple_of(self.step) {
            return Err(config_error(
                "terapipe.latency.max_len",
                format!("{} is not a positive multiple of the grid step {}", self.max_len, self.step),
            ));
        }
        if self.max_batch == 0 {
            return Err(config_error("terapipe.latency.max_batch", "the model must cover at least one sequence"));
        }
        Ok(())
    }

    /// Grid units in the longest sequence (`max_len / step`).
    pub fn units(&self) -> usize {
        self.max_len / self.step
    }
}

/// One measured compute time: forward + backward of one stage on a slice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Sequences in the micro-batch.
    pub batch: usize,
    /// Slice length in tokens (on the grid).
    pub len: usize,
    /// Tokens before the slice (0 for the no-context table).
    pub context: usize,
    /// Measured seconds.
    pub seconds: f64,
}

/// Per-slice communication time `c0 + c1·n` for a slice of `n` tokens (all sequences of the
/// micro-batch together).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommModel {
    /// `c0`: seconds per slice, whatever its size (latency of the transfers).
    pub fixed_seconds: f64,
    /// `c1`: seconds per token of activation (inverse bandwidth).
    pub seconds_per_token: f64,
}

impl CommModel {
    /// No communication (one stage, or a model that already includes it).
    pub const NONE: CommModel = CommModel { fixed_seconds: 0.0, seconds_per_token: 0.0 };

    /// Least-squares line through measured `(tokens, seconds)` transfer times. Needs at least
    /// two different token counts.
    pub fn fit(samples: &[(usize, f64)]) -> Result<CommModel> {
        if let Some(&(n, s)) = samples.iter().find(|&&(_, s)| !s.is_finite() || s < 0.0) {
            return Err(config_error(
                "terapipe.latency.transfers",
                format!("the sample for {n} tokens has {s} seconds; expected a finite, non-negative time"),
            ));
        }
        let (x, y): (Vec<[f64; 2]>, Vec<f64>) = samples.iter().map(|&(n, s)| ([1.0, n as f64], s)).unzip();
        let beta = least_squares(&x, &y).ok_or_else(|| {
            config_error(
                "terapipe.latency.transfers",
                format!(
                    "{} transfer samples do not determine a line: need at least two different token counts",
                    samples.len()
                ),
            )
        })?;
        Ok(CommModel { fixed_seconds: beta[0], seconds_per_token: beta[1] })
    }

    /// Seconds for a slice of `tokens` tokens.
    pub fn seconds(&self, tokens: usize) -> f64 {
        self.fixed_seconds + self.seconds_per_token * tokens as f64
    }
}

/// The fitted context increment `Δ(b, l, c) = a0 + a1·b·l + a2·b·c + a3·b·l·c` (tokens).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ContextFit {
    /// `[a0, a1, a2, a3]`.
    pub coefficients: [f64; 4],
    /// Coefficient of determination on the fitted samples (in-sample; 1 is a perfect fit).
    pub r_squared: f64,
    /// Samples the fit used.
    pub samples: usize,
}

impl ContextFit {
    /// `Δ(b, l, c)`, with `l` and `c` in tokens.
    pub fn delta(&self, batch: usize, len: usize, context: usize) -> f64 {
        let [a0, a1, a2, a3] = self.coefficients;
        let (b, l, c) = (batch as f64, len as f64, context as f64);
        a0 + a1 * b * l + a2 * b * c + a3 * b * l * c
    }
}

/// A closure giving the whole slice time `t(b, l, c)` (tokens) in seconds.
type LatencyFn = dyn Fn(usize, usize, usize) -> f64 + Send + Sync;

#[derive(Clone)]
enum Source {
    Measured { t0: Vec<f64>, fit: ContextFit, comm: CommModel },
    Function(Arc<LatencyFn>),
}

/// `t(b, l, c)` for one stage: seconds of forward + backward (plus transfers) of a slice of `l`
/// tokens after `c` tokens of context, for a micro-batch of `b` sequences.
#[derive(Clone)]
pub struct LatencyModel {
    grid: LatencyGrid,
    source: Source,
}

impl fmt::Debug for LatencyModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("LatencyModel");
        d.field("grid", &self.grid);
        match &self.source {
            Source::Measured { fit, comm, .. } => d.field("context_fit", fit).field("comm", comm),
            Source::Function(_) => d.field("source", &"closure"),
        };
        d.finish()
    }
}

impl LatencyModel {
    /// A model from measurements. The context-0 `compute` samples fill the `t0` table (repeats
    /// of one point are averaged) and must cover every `(b, l)` of the grid; the others, whose
    /// `(b, l)` must be on the grid too, fit `Δ` against `t0`. `comm` is given or
    /// [`CommModel::fit`]ted from transfer samples.
    pub fn from_samples(grid: LatencyGrid, compute: &[Sample], comm: CommModel) -> Result<LatencyModel> {
        grid.validate()?;
        let units = grid.units();
        let mut sum = vec![0.0; grid.max_batch * units];
        let mut count = vec![0usize; grid.max_batch * units];
        for s in compute {
            let on_grid = (1..=grid.max_batch).contains(&s.batch)
                && s.len > 0
                && s.len.is_multiple_of(grid.step)
                && s.context.is_multiple_of(grid.step)
                && s.len + s.context <= grid.max_len;
            if !on_grid {
                return Err(config_error(
                    "terapipe.latency.samples",
                    format!(
                        "sample (batch {}, length {}, context {}) is off the grid: batch in 1..={}, length a positive \
                         multiple of {} tokens and context a multiple of it, length + context at most {}",
                        s.batch, s.len, s.context, grid.max_batch, grid.step, grid.max_len
                    ),
                ));
            }
            if !s.seconds.is_finite() || s.seconds < 0.0 {
                return Err(config_error(
                    "terapipe.latency.samples",
                    format!(
                        "sample (batch {}, length {}, context {}) has {} seconds; expected a finite, non-negative time",
                        s.batch, s.len, s.context, s.seconds
                    ),
                ));
            }
            if s.context == 0 {
                let i = (s.batch - 1) * units + s.len / grid.step - 1;
                sum[i] += s.seconds;
                count[i] += 1;
            }
        }
        if let Some(i) = count.iter().position(|&n| n == 0) {
            return Err(config_error(
                "terapipe.latency.samples",
                format!(
                    "no context-0 sample for batch {}, length {} tokens: the no-context table needs every batch \
                     1..={} and every length {}, {}, …, {}",
                    i / units + 1,
                    (i % units + 1) * grid.step,
                    grid.max_batch,
                    grid.step,
                    2 * grid.step,
                    grid.max_len
                ),
            ));
        }
        // Each batch's row of the table, made non-decreasing in length (a slice of more
        // tokens never takes less time; a dip in measured times is noise the planner would
        // otherwise seize, and the plan would change from one measurement to the next).
        let means: Vec<f64> = sum.iter().zip(&count).map(|(s, &n)| s / n as f64).collect();
        let weights: Vec<f64> = count.iter().map(|&n| n as f64).collect();
        let t0: Vec<f64> =
            means.chunks(units).zip(weights.chunks(units)).flat_map(|(row, w)| non_decreasing(row, w)).collect();
        let (x, y): (Vec<[f64; 4]>, Vec<f64>) = compute
            .iter()
            .filter(|s| s.context > 0)
            .map(|s| {
                let (b, l, c) = (s.batch as f64, s.len as f64, s.context as f64);
                ([1.0, b * l, b * c, b * l * c], s.seconds - t0[(s.batch - 1) * units + s.len / grid.step - 1])
            })
            .unzip();
        let coefficients = least_squares(&x, &y).ok_or_else(|| {
            config_error(
                "terapipe.latency.samples",
                format!(
                    "{} samples with context > 0 do not determine Δ's 4 coefficients (singular design): need at \
                     least 4, varied in batch·length, batch·context and batch·length·context",
                    x.len()
                ),
            )
        })?;
        let fit = ContextFit { coefficients, r_squared: r_squared(&x, &y, &coefficients), samples: x.len() };
        Ok(LatencyModel { grid, source: Source::Measured { t0, fit, comm } })
    }

    /// A model given by a closure `t(b, l, c)` (tokens → seconds): analytic models and tests.
    pub fn from_fn(
        grid: LatencyGrid,
        f: impl Fn(usize, usize, usize) -> f64 + Send + Sync + 'static,
    ) -> Result<LatencyModel> {
        grid.validate()?;
        Ok(LatencyModel { grid, source: Source::Function(Arc::new(f)) })
    }

    /// The grid the model is defined on.
    pub fn grid(&self) -> LatencyGrid {
        self.grid
    }

    /// `t(b, l, c)` in seconds. Errors off the grid: `b` outside `1..=max_batch`, `l` not a
    /// positive multiple of the step, `c` not a multiple of it, or `l + c > max_len`.
    pub fn slice_time(&self, batch: usize, len: usize, context: usize) -> Result<f64> {
        let g = self.grid;
        if !(1..=g.max_batch).contains(&batch) {
            return Err(config_error("terapipe.batch", format!("{batch} is outside the model's 1..={}", g.max_batch)));
        }
        if len == 0 || !len.is_multiple_of(g.step) || !context.is_multiple_of(g.step) || len + context > g.max_len {
            return Err(config_error(
                "terapipe.slice",
                format!(
                    "slice of {len} tokens after {context} is off the grid: both multiples of {} tokens, length \
                     positive, length + context at most {}",
                    g.step, g.max_len
                ),
            ));
        }
        Ok(self.time_units(batch, len / g.step, context / g.step))
    }

    /// `t(b, l, c)` for any slice within the longest sequence, on the grid or off it: `t0`
    /// interpolated linearly between the grid lengths on either side of `l` (a slice shorter
    /// than the step at the step's time: it reads the same weights, which dominate so short
    /// a slice), `Δ` and `comm` as fitted, which take any lengths. On the grid it is
    /// [`slice_time`](Self::slice_time) exactly.
    pub fn slice_time_interpolated(&self, batch: usize, len: usize, context: usize) -> Result<f64> {
        let g = self.grid;
        if !(1..=g.max_batch).contains(&batch) || len == 0 || len + context > g.max_len {
            return Err(config_error(
                "terapipe.slice",
                format!(
                    "slice of {len} tokens after {context} for {batch} sequences is outside the latency model: \
                     length positive, length + context at most {}, sequences in 1..={}",
                    g.max_len, g.max_batch
                ),
            ));
        }
        let (t0, fit, comm) = match &self.source {
            Source::Function(f) => return Ok(f(batch, len, context)),
            Source::Measured { t0, fit, comm } => (t0, fit, comm),
        };
        let row = &t0[(batch - 1) * g.units()..batch * g.units()];
        let below = (len / g.step).max(1);
        let above = len.div_ceil(g.step).max(1);
        let fraction = len.saturating_sub(below * g.step) as f64 / g.step as f64;
        let base = row[below - 1] + (row[above - 1] - row[below - 1]) * fraction;
        Ok(base + beyond_t0(fit, comm, batch, len, context))
    }

    /// `t` on grid units, unchecked: the planner's inner loop (it checks its ranges once).
    pub(crate) fn time_units(&self, batch: usize, len_units: usize, context_units: usize) -> f64 {
        let step = self.grid.step;
        let (len, context) = (len_units * step, context_units * step);
        match &self.source {
            Source::Measured { t0, fit, comm } => {
                t0[(batch - 1) * self.grid.units() + len_units - 1] + beyond_t0(fit, comm, batch, len, context)
            }
            Source::Function(f) => f(batch, len, context),
        }
    }

    /// The context fit, for a model built from measurements.
    pub fn context_fit(&self) -> Option<&ContextFit> {
        match &self.source {
            Source::Measured { fit, .. } => Some(fit),
            Source::Function(_) => None,
        }
    }

    /// R² of the context fit, for a model built from measurements.
    pub fn r_squared(&self) -> Option<f64> {
        self.context_fit().map(|f| f.r_squared)
    }

    /// The communication model, for a model built from measurements.
    pub fn comm(&self) -> Option<&CommModel> {
        match &self.source {
            Source::Measured { comm, .. } => Some(comm),
            Source::Function(_) => None,
        }
    }
}

/// What a slice costs beyond its `t0`: the context term where it has context, and its
/// transfers. Attending to a context never makes a slice cheaper than the same slice without
/// one: a fit to noisy timings that extrapolates below zero is read as no cost.
fn beyond_t0(fit: &ContextFit, comm: &CommModel, batch: usize, len: usize, context: usize) -> f64 {
    let delta = if context > 0 { fit.delta(batch, len, context).max(0.0) } else { 0.0 };
    delta + comm.seconds(batch * len)
}

/// The non-decreasing sequence nearest `values` in least squares weighted by `weights`
/// (pool adjacent violators: a run that falls is replaced by its weighted mean, repeatedly).
/// Values already non-decreasing come back unchanged.
fn non_decreasing(values: &[f64], weights: &[f64]) -> Vec<f64> {
    // Pooled blocks: (mean, weight, members).
    let mut blocks: Vec<(f64, f64, usize)> = Vec::with_capacity(values.len());
    for (&v, &w) in values.iter().zip(weights) {
        let mut block = (v, w, 1);
        while let Some(&(mean, weight, n)) = blocks.last()
            && mean > block.0
        {
            blocks.pop();
            let pooled = weight + block.1;
            block = ((mean * weight + block.0 * block.1) / pooled, pooled, n + block.2);
        }
        blocks.push(block);
    }
    blocks.into_iter().flat_map(|(mean, _, n)| std::iter::repeat_n(mean, n)).collect()
}

/// Least squares by the normal equations. Columns are scaled to unit largest magnitude first
/// (features span 1 to ~1e10 tokens², and unscaled normal equations would square that range);
/// `None` when there are fewer points than features or the scaled Gram matrix is singular.
fn least_squares<const P: usize>(x: &[[f64; P]], y: &[f64]) -> Option<[f64; P]> {
    if x.len() < P {
        return None;
    }
    let mut scale = [0.0f64; P];
    for row in x {
        for j in 0..P {
            scale[j] = scale[j].max(row[j].abs());
        }
    }
    if scale.iter().any(|&s| s == 0.0 || !s.is_finite()) {
        return None;
    }
    // Augmented Gram matrix [XᵀX | Xᵀy] of the scaled columns.
    let mut a = [[0.0f64; 9]; P];
    for (row, &yi) in x.iter().zip(y) {
        for i in 0..P {
            let xi = row[i] / scale[i];
            for j in 0..P {
                a[i][j] += xi * row[j] / scale[j];
            }
            a[i][P] += xi * yi;
        }
    }
    let diag_max = (0..P).map(|i| a[i][i]).fold(0.0, f64::max);
    // Gaussian elimination with partial pivoting; a pivot this small relative to the largest
    // diagonal entry means the features are (numerically) collinear.
    for col in 0..P {
        let pivot = (col..P).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= 1e-12 * diag_max {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col];
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row[col..=P].iter_mut().zip(&pivot_row[col..=P]) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut beta = [0.0; P];
    for i in 0..P {
        beta[i] = a[i][P] / a[i][i] / scale[i];
    }
    beta.iter().all(|b| b.is_finite()).then_some(beta)
}

fn r_squared<const P: usize>(x: &[[f64; P]], y: &[f64], beta: &[f64; P]) -> f64 {
    let mean = y.iter().sum::<f64>() / y.len() as f64;
    let (mut res, mut tot) = (0.0, 0.0);
    for (row, &yi) in x.iter().zip(y) {
        let pred: f64 = row.iter().zip(beta).map(|(a, b)| a * b).sum();
        res += (yi - pred).powi(2);
        tot += (yi - mean).powi(2);
    }
    // Constant targets fitted exactly: a perfect fit, not 0/0.
    if tot == 0.0 { if res == 0.0 { 1.0 } else { 0.0 } } else { 1.0 - res / tot }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRID: LatencyGrid = LatencyGrid { step: 8, max_len: 64, max_batch: 3 };

    /// Synthetic measurements: a t0 table, Δ with known coefficients on a coarse grid, a small
    /// deterministic wobble on Δ when `noise` is set.
    fn samples(coefs: [f64; 4], noise: f64) -> Vec<Sample> {
        let mut out = Vec::new();
        for b in 1..=GRID.max_batch {
            for l in (GRID.step..=GRID.max_len).step_by(GRID.step) {
                out.push(Sample { batch: b, len: l, context: 0, seconds: 1e-3 + 1e-6 * (b * l) as f64 });
                for c in (16..=GRID.max_len - l).step_by(16) {
                    let fit = ContextFit { coefficients: coefs, r_squared: 1.0, samples: 0 };
                    let wobble = noise * (((b * 31 + l * 7 + c * 13) % 17) as f64 - 8.0) / 8.0;
                    let t0 = 1e-3 + 1e-6 * (b * l) as f64;
                    out.push(Sample { batch: b, len: l, context: c, seconds: t0 + fit.delta(b, l, c) + wobble });
                }
            }
        }
        out
    }

    #[test]
    fn fit_recovers_known_coefficients() {
        let coefs = [2e-5, 3e-7, 5e-8, 1e-9];
        let comm = CommModel { fixed_seconds: 5e-5, seconds_per_token: 1e-9 };
        let model = LatencyModel::from_samples(GRID, &samples(coefs, 0.0), comm).unwrap();
        let fit = model.context_fit().unwrap();
        for (got, want) in fit.coefficients.iter().zip(coefs) {
            assert!((got - want).abs() <= 1e-9 * want.abs(), "{:?} vs {coefs:?}", fit.coefficients);
        }
        assert!((fit.r_squared - 1.0).abs() < 1e-12);
        // t = t0 + Δ + comm on the grid; Δ = 0 at context 0.
        let want = 1e-3
            + 1e-6 * 48.0
            + ContextFit { coefficients: coefs, r_squared: 1.0, samples: 0 }.delta(2, 24, 32)
            + comm.seconds(48);
        assert!((model.slice_time(2, 24, 32).unwrap() - want).abs() < 1e-15);
        assert_eq!(model.slice_time(1, 8, 0).unwrap(), 1e-3 + 8e-6 + comm.seconds(8));
        // With noise the fit is close and R² drops below 1.
        let noisy = LatencyModel::from_samples(GRID, &samples(coefs, 1e-7), CommModel::NONE).unwrap();
        let r2 = noisy.r_squared().unwrap();
        assert!(r2 < 1.0 && r2 > 0.99, "R² {r2}");
    }

    /// A measured table that dips is pooled into its nearest non-decreasing one (a dip is
    /// noise: more tokens never take less time), and one that does not dip is kept as it is.
    #[test]
    fn the_no_context_table_never_falls_with_length() {
        assert_eq!(non_decreasing(&[1.0, 3.0, 2.0, 4.0], &[1.0; 4]), [1.0, 2.5, 2.5, 4.0]);
        assert_eq!(non_decreasing(&[5.0, 1.0, 1.0, 9.0], &[1.0, 1.0, 2.0, 1.0]), [2.0, 2.0, 2.0, 9.0]);
        let rising = [0.5, 0.5, 0.7, 2.0];
        assert_eq!(non_decreasing(&rising, &[1.0; 4]), rising);
        // Through the model: batch 2's 24-token time measured below its 16-token one.
        let coefs = [2e-5, 3e-7, 5e-8, 1e-9];
        let mut s = samples(coefs, 0.0);
        let at = |s: &[Sample], len| s.iter().position(|x| (x.batch, x.len, x.context) == (2, len, 0)).unwrap();
        let (t16, t24) = (s[at(&s, 16)].seconds, s[at(&s, 24)].seconds);
        let dip = at(&s, 24);
        s[dip].seconds = t16 - 4e-6;
        let model = LatencyModel::from_samples(GRID, &s, CommModel::NONE).unwrap();
        let pooled = (t16 + t16 - 4e-6) / 2.0;
        for len in [16, 24] {
            assert!((model.slice_time(2, len, 0).unwrap() - pooled).abs() < 1e-15, "{len}");
        }
        // Other rows and lengths as measured.
        assert_eq!(model.slice_time(2, 32, 0).unwrap(), s[at(&s, 32)].seconds);
        assert_eq!(model.slice_time(1, 24, 0).unwrap(), 1e-3 + 24e-6);
        assert!(t24 > t16);
    }

    /// A slice off the grid is priced between its neighbours on it: `t0` along the line
    /// between the grid lengths either side, the context term and the transfer at its own
    /// lengths; shorter than a step, at the step's time. On the grid, exactly `slice_time`.
    #[test]
    fn a_slice_off_the_grid_is_priced_between_its_neighbours() {
        let coefs = [2e-5, 3e-7, 5e-8, 1e-9];
        let comm = CommModel { fixed_seconds: 5e-5, seconds_per_token: 1e-9 };
        let model = LatencyModel::from_samples(GRID, &samples(coefs, 0.0), comm).unwrap();
        let fit = *model.context_fit().unwrap();
        for (b, l, c) in [(1, 8, 0), (2, 24, 32), (3, 64, 0)] {
            assert_eq!(model.slice_time_interpolated(b, l, c).unwrap(), model.slice_time(b, l, c).unwrap());
        }
        // 19 tokens after 5, two sequences: t0 three eighths of the way from 16 to 24 tokens.
        let t0 = |l: f64| 1e-3 + 1e-6 * 2.0 * l;
        let want = t0(16.0) + (t0(24.0) - t0(16.0)) * 3.0 / 8.0 + fit.delta(2, 19, 5) + comm.seconds(38);
        assert!((model.slice_time_interpolated(2, 19, 5).unwrap() - want).abs() < 1e-15);
        // 3 tokens (of one sequence): the 8-token step's table entry, its own transfer.
        assert_eq!(model.slice_time_interpolated(1, 3, 0).unwrap(), 1e-3 + 8e-6 + comm.seconds(3));
        // Outside the model: named.
        for (b, l, c) in [(0, 8, 0), (4, 8, 0), (1, 0, 0), (1, 60, 5)] {
            let e = model.slice_time_interpolated(b, l, c).unwrap_err().to_string();
            assert!(e.contains("outside the latency model"), "({b}, {l}, {c}): {e}");
        }
        // A model given as a function takes any lengths.
        let f = LatencyModel::from_fn(GRID, |b, l, c| (b * l + c) as f64).unwrap();
        assert_eq!(f.slice_time_interpolated(2, 13, 3).unwrap(), 29.0);
    }

    #[test]
    fn comm_fit_recovers_a_line() {
        let c = CommModel::fit(&[(100, 1.1e-4), (1000, 2.0e-4), (10_000, 1.1e-3)]).unwrap();
        assert!((c.fixed_seconds - 1e-4).abs() < 1e-15 && (c.seconds_per_token - 1e-7).abs() < 1e-18, "{c:?}");
        assert!(CommModel::fit(&[(100, 1e-4), (100, 2e-4)]).is_err());
        assert!(CommModel::fit(&[(100, f64::NAN), (200, 1e-4)]).is_err());
    }

    #[test]
    fn errors_name_the_problem() {
        let coefs = [2e-5, 3e-7, 5e-8, 1e-9];
        let mut s = samples(coefs, 0.0);
        // A missing table point is named.
        s.retain(|x| !(x.batch == 2 && x.len == 40 && x.context == 0));
        let e = LatencyModel::from_samples(GRID, &s, CommModel::NONE).unwrap_err().to_string();
        assert!(e.contains("batch 2, length 40 tokens"), "{e}");
        // Off-grid samples are refused, not interpolated.
        for (len, context) in [(12, 0), (8, 4)] {
            let off = [Sample { batch: 1, len, context, seconds: 1.0 }];
            let e = LatencyModel::from_samples(GRID, &off, CommModel::NONE).unwrap_err().to_string();
            assert!(e.contains("off the grid"), "{len} after {context}: {e}");
        }
        // Too few context samples: the design is singular.
        let s: Vec<Sample> = samples(coefs, 0.0).into_iter().filter(|x| x.context == 0 || x.len == 8).collect();
        let e = LatencyModel::from_samples(GRID, &s[..s.len()], CommModel::NONE).unwrap_err().to_string();
        assert!(e.contains("singular"), "{e}");
        let e = LatencyModel::from_samples(GRID, &samples(coefs, 0.0)[..0], CommModel::NONE).unwrap_err().to_string();
        assert!(e.contains("no context-0 sample"), "{e}");
        // Bad grids and off-grid queries.
        assert!(LatencyGrid { step: 0, ..GRID }.validate().is_err());
        assert!(LatencyGrid { max_len: 60, ..GRID }.validate().is_err());
        assert!(LatencyGrid { max_batch: 0, ..GRID }.validate().is_err());
        let m = LatencyModel::from_fn(GRID, |b, l, c| (b * l + c) as f64).unwrap();
        assert_eq!(m.slice_time(2, 16, 8).unwrap(), 40.0);
        for (b, l, c) in [(0, 8, 0), (4, 8, 0), (1, 0, 0), (1, 12, 0), (1, 8, 4), (1, 64, 8)] {
            assert!(m.slice_time(b, l, c).is_err(), "({b}, {l}, {c})");
        }
        assert!(m.r_squared().is_none() && m.comm().is_none());
    }
}
