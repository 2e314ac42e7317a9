//! The freeze algorithm (PipeTransformer §3.1): how many of the bottom Transformer layers are
//! frozen after each interval. Three rules:
//!
//! - **Eq. 1** (the paper): `F(T) = min(⌈B(T)⌉, ℓ* + 1)` where `B(T) = B(T−1) + α·(L − B(T−1))`
//!   is the α bound and `ℓ*` the active layer (`ℓ ≥ F(T−1)`) whose gradient norm over interval
//!   `T` was smallest. The bound is carried unrounded (and restarts from `F(T)` when the norms
//!   decide), so while it decides it is the released code's schedule, as the paper's rewrite
//!   (Eq. 2) says; rounded up at every interval it would freeze at least one more layer per
//!   interval whatever α is;
//! - **α bound** (the released code): `F(T) = ⌈L·(1 − (1−α)^T)⌉`, gradients ignored;
//! - **table**: the counts the user lists, one per interval.
//!
//! Any rule can be capped by a settling test (`elastic.max_weight_change`, [`settled`]): a
//! layer freezes only when it and every layer below it moved by at most a fraction `τ` of their
//! weights' norm over the interval. The paper's signal is the gradient norm, which ranks the
//! layers but says nothing of whether they have converged: training a ViT from scratch, the
//! bottom layer's gradient is the largest yet the α bound still freezes it after the first
//! epoch, when it has moved 40 % (docs/RESULTS.md); fine-tuning MiniLM, every layer moves
//! about 2 % per epoch.
//!
//! The count never decreases and never exceeds `L`: the final norm and the head always train,
//! and nothing here ever re-creates them (the released code re-initialises its classifier at
//! every transition). `‖g_ℓ(T)‖` is the mean over the interval's steps of the L2 norm of layer
//! `ℓ`'s gradient (attention and MLP unit together), after the replicas' all-reduce and before
//! clipping — one value every replica shares, so every replica decides the same.

use crate::error::{Result, config_error};
use serde::{Deserialize, Serialize};

/// Which rule decides the frozen count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FreezeRule {
    /// Never freeze.
    Off,
    /// Eq. 1: the α bound, lowered to the layer with the smallest gradient norm.
    Eq1,
    /// The α bound alone (the released code's schedule).
    Alpha,
    /// Frozen layers per interval, as listed (`table[T]` during interval `T`; the last entry
    /// holds after the list ends).
    Table(Vec<usize>),
}

impl std::fmt::Display for FreezeRule {
    /// As a config writes it: `eq1`, `table [1, 2]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FreezeRule::Off => f.write_str("off"),
            FreezeRule::Eq1 => f.write_str("eq1"),
            FreezeRule::Alpha => f.write_str("alpha"),
            FreezeRule::Table(t) => write!(f, "table {t:?}"),
        }
    }
}

/// Slack for float noise in the α bound: `12·(1 − 2/3)` evaluates to 3.9999999999999996,
/// whose ceiling must be 4.
const CEIL_SLACK: f64 = 1e-9;

/// `⌈x⌉`, forgiving float noise just above an integer.
fn ceil(x: f64) -> usize {
    (x - CEIL_SLACK).ceil().max(0.0) as usize
}

/// The released code's schedule: `⌈L·(1 − (1−α)^T)⌉` frozen layers after `T` intervals.
pub fn alpha_schedule(layers: usize, alpha: f64, intervals: u32) -> usize {
    ceil(layers as f64 * (1.0 - (1.0 - alpha).powi(intervals as i32))).min(layers)
}

/// Eq. 1's α bound after an interval that started from the bound `before` (unrounded):
/// `before + α·(L − before)`.
pub fn alpha_bound(layers: usize, before: f64, alpha: f64) -> f64 {
    before + alpha * (layers as f64 - before)
}

/// Eq. 1: `⌈bound⌉` layers, or fewer when an active layer's gradient norm is smallest lower
/// down; never fewer than the `frozen` now. `norms[ℓ]` is layer `ℓ`'s gradient norm over the
/// interval (frozen layers' are ignored).
pub fn eq1(layers: usize, frozen: usize, bound: f64, norms: &[f64]) -> usize {
    let bound = ceil(bound).min(layers);
    let argmin = (frozen..layers.min(norms.len())).min_by(|&a, &b| norms[a].total_cmp(&norms[b]));
    let by_norm = argmin.map_or(bound, |l| l + 1);
    bound.min(by_norm).max(frozen)
}

/// The settling test: how many of the bottom layers, `frozen` of them already, have each moved
/// by at most `max_change` of their norm over the interval (`changes[ℓ]`, relative), counting
/// up from the first active layer and stopping at the first that has not.
pub fn settled(frozen: usize, changes: &[f64], max_change: f64) -> usize {
    frozen + changes.iter().skip(frozen).take_while(|&&c| c <= max_change).count()
}

/// Checks α of Eq. 1 and of the α bound: in (0, 1).
pub fn check_alpha(alpha: f64) -> Result<()> {
    match alpha > 0.0 && alpha < 1.0 {
        true => Ok(()),
        false => Err(config_error("elastic.alpha", format!("must be in (0, 1), got {alpha}"))),
    }
}

/// Checks a rule against a model of `layers` Transformer layers.
pub fn validate(rule: &FreezeRule, alpha: f64, layers: usize) -> Result<()> {
    if matches!(rule, FreezeRule::Eq1 | FreezeRule::Alpha) {
        check_alpha(alpha)?;
    }
    if let FreezeRule::Table(t) = rule {
        if t.is_empty() {
            return Err(config_error("elastic.table", "is empty; list the frozen layers per interval"));
        }
        if let Some(w) = t.windows(2).find(|w| w[1] < w[0]) {
            return Err(config_error(
                "elastic.table",
                format!("decreases from {} to {}: frozen layers never thaw", w[0], w[1]),
            ));
        }
        if let Some(&bad) = t.iter().find(|&&n| n > layers) {
            return Err(config_error(
                "elastic.table",
                format!("freezes {bad} layers but the model has {layers}: the final norm and the head always train"),
            ));
        }
    }
    Ok(())
}

/// Accumulates per-layer gradient norms over an interval and applies the rule at its end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FreezeController {
    rule: FreezeRule,
    alpha: f64,
    layers: usize,
    /// Frozen layers now.
    pub frozen: usize,
    /// Eq. 1's α bound, unrounded.
    #[serde(default)]
    bound: f64,
    /// Intervals completed.
    pub intervals: u32,
    /// Per layer: the sum of the steps' gradient norms in the current interval.
    norm_sums: Vec<f64>,
    steps: u64,
}

impl FreezeController {
    /// A controller for a model of `layers` Transformer layers, nothing frozen.
    pub fn new(rule: FreezeRule, alpha: f64, layers: usize) -> Result<Self> {
        validate(&rule, alpha, layers)?;
        Ok(Self { rule, alpha, layers, frozen: 0, bound: 0.0, intervals: 0, norm_sums: vec![0.0; layers], steps: 0 })
    }

    /// How the rule of `saved` (a checkpoint's) differs from this one's (the config's), each
    /// difference a phrase (all of them, so that one resume says what to set back): a resumed
    /// run goes on under the rule it began with. α where either rule reads it.
    pub fn rule_changes(&self, saved: &Self) -> Vec<String> {
        let uses_alpha = |r: &FreezeRule| matches!(r, FreezeRule::Eq1 | FreezeRule::Alpha);
        let mut changes = Vec::new();
        if self.rule != saved.rule {
            changes.push(format!("elastic.freeze / elastic.table: {} then, {} now", saved.rule, self.rule));
        }
        if (uses_alpha(&self.rule) || uses_alpha(&saved.rule)) && self.alpha.to_bits() != saved.alpha.to_bits() {
            changes.push(format!("elastic.alpha: {} then, {} now", saved.alpha, self.alpha));
        }
        if self.layers != saved.layers {
            changes.push(format!("the model's layers: {} then, {} now", saved.layers, self.layers));
        }
        changes
    }

    /// Frozen layers during the first interval (a table may start above 0).
    pub fn initial(&self) -> usize {
        match &self.rule {
            FreezeRule::Table(t) => t[0],
            _ => 0,
        }
    }

    /// Records one step's per-layer squared gradient norms.
    pub fn observe(&mut self, layer_grad_sq: &[f64]) {
        for (sum, sq) in self.norm_sums.iter_mut().zip(layer_grad_sq) {
            *sum += sq.sqrt();
        }
        self.steps += 1;
    }

    /// The mean gradient norm of each layer over the interval so far.
    pub fn norms(&self) -> Vec<f64> {
        let n = self.steps.max(1) as f64;
        self.norm_sums.iter().map(|s| s / n).collect()
    }

    /// Ends an interval: the frozen layers for the next one (never fewer than now, never more
    /// than `cap`: the settled layers, when a settling test runs).
    pub fn end_interval(&mut self, cap: Option<usize>) -> usize {
        // No step trained in the interval: no weight moved, so every layer passes a settling
        // test without having settled. The test then holds the count where it is.
        let cap = if self.steps == 0 { cap.map(|_| self.frozen) } else { cap };
        self.intervals += 1;
        let t = self.intervals;
        let next = match &self.rule {
            FreezeRule::Off => 0,
            FreezeRule::Alpha => alpha_schedule(self.layers, self.alpha, t),
            // No step trained in the interval (every one skipped for a gradient that was not
            // finite): all norms read 0, and the lowest active layer would win by default.
            FreezeRule::Eq1 if self.steps == 0 => self.frozen,
            FreezeRule::Eq1 => {
                let bound = alpha_bound(self.layers, self.bound, self.alpha);
                let n = eq1(self.layers, self.frozen, bound, &self.norms());
                // The recursion goes on from the bound while it decides, from the count when
                // the norms do (Eq. 1's F(T−1) is the count that was frozen).
                self.bound = if n < ceil(bound).min(self.layers) { n as f64 } else { bound };
                n
            }
            FreezeRule::Table(table) => table[(t as usize).min(table.len() - 1)],
        };
        self.frozen = next.min(cap.unwrap_or(usize::MAX)).max(self.frozen).min(self.layers);
        // Held back by the settling test, Eq. 1 goes on from the count frozen (its F(T−1)), as
        // when the norms decide, rather than from a bound that kept climbing meanwhile.
        if matches!(self.rule, FreezeRule::Eq1) && self.frozen < next {
            self.bound = self.frozen as f64;
        }
        self.norm_sums.iter_mut().for_each(|s| *s = 0.0);
        self.steps = 0;
        self.frozen
    }
}

#[cfg(test)]
mod tests {
    /// Under a settling test, an interval without a trained step freezes nothing for any rule:
    /// its weight changes are all 0 because nothing trained, not because the layers settled.
    #[test]
    fn a_settling_test_holds_after_an_interval_without_a_step() {
        for rule in [FreezeRule::Table(vec![0, 2, 4]), FreezeRule::Alpha] {
            let mut c = FreezeController::new(rule.clone(), 1.0 / 3.0, 6).unwrap();
            assert_eq!(c.end_interval(Some(6)), 0, "{rule:?}: no step, every layer 'settled'");
            c.observe(&[1.0; 6]);
            assert!(c.end_interval(Some(6)) > 0, "{rule:?}: a trained interval freezes as the rule says");
        }
        let mut c = FreezeController::new(FreezeRule::Table(vec![0, 2]), 1.0 / 3.0, 6).unwrap();
        assert_eq!(c.end_interval(None), 2, "without a settling test the table decides alone");
    }

    /// An interval in which no step trained (each skipped for a gradient that was not finite)
    /// gives Eq. 1 no norms: nothing more freezes, where the lowest active layer's 0 would win.
    #[test]
    fn eq1_freezes_nothing_after_an_interval_without_a_step() {
        let mut c = FreezeController::new(FreezeRule::Eq1, 1.0 / 3.0, 6).unwrap();
        assert_eq!(c.end_interval(None), 0);
        c.observe(&[4.0, 1.0, 9.0, 9.0, 9.0, 9.0]);
        assert_eq!(c.end_interval(None), 2, "layer 1's norm is the smallest");
    }

    /// A checkpoint keeps the interval's gradient-norm sums and the α bound bit for bit (JSON
    /// read back with serde_json's exact float parsing): a resumed Eq. 1 compares the same
    /// numbers the straight run does, near-ties included.
    #[test]
    fn the_state_survives_json_bit_for_bit() {
        let mut c = FreezeController::new(FreezeRule::Eq1, 1.0 / 3.0, 6).unwrap();
        let mut rng = crate::rng::Rng::new(5);
        for _ in 0..50 {
            let sq: Vec<f64> = (0..6).map(|_| rng.uniform() * 1e3).collect();
            c.observe(&sq);
        }
        c.bound = 6.0 * (1.0 - (2.0f64 / 3.0).powi(3));
        let back: FreezeController = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        let bits =
            |c: &FreezeController| (c.bound.to_bits(), c.norm_sums.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        assert_eq!(bits(&back), bits(&c));
    }

    use super::*;

    #[test]
    fn the_alpha_schedule_matches_the_released_code() {
        // pipetransformer.md §2.2: the code's float formula, then ceil, epochs 0..9.
        let table: [(usize, f64, [usize; 10]); 6] = [
            (12, 1.0 / 2.0, [0, 6, 9, 11, 12, 12, 12, 12, 12, 12]),
            (12, 2.0 / 5.0, [0, 5, 8, 10, 11, 12, 12, 12, 12, 12]),
            (12, 1.0 / 3.0, [0, 4, 7, 9, 10, 11, 11, 12, 12, 12]),
            (12, 1.0 / 4.0, [0, 3, 6, 7, 9, 10, 10, 11, 11, 12]),
            (12, 1.0 / 5.0, [0, 3, 5, 6, 8, 9, 9, 10, 10, 11]),
            (24, 1.0 / 3.0, [0, 8, 14, 17, 20, 21, 22, 23, 24, 24]),
        ];
        for (l, alpha, want) in table {
            let got: Vec<usize> = (0..10).map(|t| alpha_schedule(l, alpha, t)).collect();
            assert_eq!(got, want, "L={l} α={alpha}");
            let mut c = FreezeController::new(FreezeRule::Alpha, alpha, l).unwrap();
            let run: Vec<usize> = std::iter::once(0).chain((1..10).map(|_| c.end_interval(None))).collect();
            assert_eq!(run, want, "controller, L={l} α={alpha}");
        }
    }

    #[test]
    fn eq1_takes_the_smaller_of_the_bound_and_the_flattest_active_layer() {
        // Bound after B=0 with α=1/2 over 6 layers: 3. Layer 1 has the smallest norm: 2.
        assert_eq!(alpha_bound(6, 0.0, 0.5), 3.0);
        assert_eq!(eq1(6, 0, 3.0, &[5.0, 0.1, 3.0, 2.0, 4.0, 6.0]), 2);
        // The smallest norm above the bound: the bound wins.
        assert_eq!(eq1(6, 0, 3.0, &[5.0, 4.0, 3.0, 2.0, 0.5, 6.0]), 3);
        // A fractional bound rounds up.
        assert_eq!(eq1(6, 0, 2.4, &[5.0, 4.0, 3.0, 2.0, 0.5, 6.0]), 3);
        // Frozen layers' norms are not scanned (layer 0 is already frozen).
        assert_eq!(eq1(6, 2, 4.0, &[0.0, 0.0, 3.0, 0.2, 4.0, 6.0]), 4);
        // Never fewer than now, never more than L.
        assert_eq!(eq1(6, 6, 6.0, &[1.0; 6]), 6);
        assert_eq!(eq1(6, 3, 7.5, &[6.0, 5.0, 4.0, 3.0, 2.0, 1.0]), 6);
    }

    #[test]
    fn while_its_bound_decides_eq1_is_the_released_schedule() {
        // Gradient norms falling towards the top (as fine-tuning MiniLM and ViT measure them)
        // put the argmin on the last layer, so the α bound decides every interval. Unrounded,
        // it is the released code's schedule for any α; rounded up per interval, α = 1/5 over
        // 12 layers would give 3, 5, 7, 9, … and α = 0.1 over 4 layers 1, 2, 3, 4.
        for (l, alpha) in [(12, 0.5), (12, 0.4), (12, 1.0 / 3.0), (12, 0.25), (12, 0.2), (24, 1.0 / 3.0), (4, 0.1)] {
            let falling: Vec<f64> = (0..l).map(|i| (l - i) as f64 * (l - i) as f64).collect();
            let mut c = FreezeController::new(FreezeRule::Eq1, alpha, l).unwrap();
            for t in 1..10 {
                c.observe(&falling);
                assert_eq!(c.end_interval(None), alpha_schedule(l, alpha, t), "L={l} α={alpha} T={t}");
            }
        }
        // When the norms decide, the bound goes on from the count they chose: α = 1/2 over 8
        // layers, layer 0 flattest → 1 frozen; next bound 1 + 7/2 = 4.5 → 5.
        let mut c = FreezeController::new(FreezeRule::Eq1, 0.5, 8).unwrap();
        c.observe(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        assert_eq!(c.end_interval(None), 1);
        c.observe(&[0.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0]);
        assert_eq!(c.end_interval(None), 5);
    }

    #[test]
    fn the_controller_averages_norms_over_the_interval_and_never_thaws() {
        let mut c = FreezeController::new(FreezeRule::Eq1, 0.5, 4).unwrap();
        // Squared norms: layer 2's mean norm (1 and 3 → 2) is not the smallest; layer 1's (1, 1) is.
        c.observe(&[16.0, 1.0, 1.0, 25.0]);
        c.observe(&[16.0, 1.0, 9.0, 25.0]);
        assert_eq!(c.norms(), vec![4.0, 1.0, 2.0, 5.0]);
        assert_eq!(c.end_interval(None), 2);
        assert_eq!(c.norms(), vec![0.0; 4], "a new interval starts empty");
        c.observe(&[0.0, 0.0, 9.0, 1.0]);
        assert_eq!(c.end_interval(None), 3);
        let mut t = FreezeController::new(FreezeRule::Table(vec![1, 1, 3]), 0.0, 4).unwrap();
        assert_eq!(t.initial(), 1);
        assert_eq!([t.end_interval(None), t.end_interval(None), t.end_interval(None)], [1, 3, 3]);
    }

    #[test]
    fn the_settling_test_caps_the_rule_at_the_first_layer_still_moving() {
        // Layers 0 and 1 moved 2 %, layer 2 30 %, layer 3 1 %: two have settled (layer 3 is
        // above one that has not).
        assert_eq!(settled(0, &[0.02, 0.02, 0.3, 0.01], 0.05), 2);
        assert_eq!(settled(0, &[0.4, 0.02, 0.02, 0.02], 0.05), 0, "a ViT from scratch after epoch 0");
        // Frozen layers (no change) stay counted; the scan starts above them.
        assert_eq!(settled(2, &[0.0, 0.0, 0.04, 0.5], 0.05), 3);
        // The α bound would freeze 3 of 6 (α = 1/2); settled, only 1 may; next interval 3.
        // (Each interval trained a step: `a_settling_test_holds_after_an_interval_without_a_step`
        // has one that did not.)
        let mut c = FreezeController::new(FreezeRule::Alpha, 0.5, 6).unwrap();
        let mut end = |cap| {
            c.observe(&[1.0; 6]);
            c.end_interval(Some(cap))
        };
        assert_eq!(end(1), 1);
        assert_eq!(end(6), alpha_schedule(6, 0.5, 2));
        // The cap never thaws.
        assert_eq!(end(0), alpha_schedule(6, 0.5, 2));
        // Eq. 1 held back goes on from what is frozen: α = 1/2 over 8 layers, norms falling to
        // the top (the bound decides). Bound 4, capped at 1 → 1; next bound 1 + 7/2 = 4.5 → 5,
        // not 4 + 4/2 = 6 as it would from the uncapped bound.
        let falling = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0].map(|n: f64| n * n);
        let mut e = FreezeController::new(FreezeRule::Eq1, 0.5, 8).unwrap();
        e.observe(&falling);
        assert_eq!(e.end_interval(Some(1)), 1);
        e.observe(&falling);
        assert_eq!(e.end_interval(Some(8)), 5);
    }

    #[test]
    fn bad_rules_are_refused_with_the_field_named() {
        let err = |r: FreezeRule, a: f64| FreezeController::new(r, a, 6).unwrap_err().to_string();
        assert!(err(FreezeRule::Eq1, 1.0).contains("elastic.alpha"));
        assert!(err(FreezeRule::Alpha, 0.0).contains("(0, 1)"));
        assert!(err(FreezeRule::Table(vec![2, 1]), 0.5).contains("decreases from 2 to 1"));
        assert!(err(FreezeRule::Table(vec![2, 7]), 0.5).contains("head always train"));
        assert!(err(FreezeRule::Table(vec![]), 0.5).contains("empty"));
        assert!(FreezeController::new(FreezeRule::Table(vec![0, 6]), 7.0, 6).is_ok(), "α is not read by a table");
    }
}
