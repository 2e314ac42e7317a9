//! `LrSchedule`: linear warmup from 0, then a constant, linear or cosine decay to `min_lr` — the
//! shapes of Hugging Face's `get_{constant,linear,cosine}_schedule_with_warmup`.

use crate::error::{Result, config_error};
use serde::{Deserialize, Serialize};

/// What the learning rate does after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decay {
    /// Stays at `base_lr`.
    Constant,
    /// Falls linearly to `min_lr` at `total_steps`.
    Linear,
    /// Follows half a cosine period down to `min_lr` at `total_steps`.
    Cosine,
}

/// A learning rate per optimizer step. Step `s` (0-based) gets `base_lr·s/warmup_steps` during
/// warmup (so step 0 trains at lr 0, as in Hugging Face), then the decay, then `min_lr` from
/// `total_steps` on (`base_lr` for [`Decay::Constant`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Peak learning rate, reached at the end of warmup; ≥ 0.
    pub base_lr: f64,
    /// Final learning rate of the linear and cosine decays; in [0, `base_lr`].
    #[serde(default)]
    pub min_lr: f64,
    /// Steps of linear warmup from 0; ≤ `total_steps`.
    #[serde(default)]
    pub warmup_steps: u64,
    /// Steps of the whole run (warmup included).
    pub total_steps: u64,
    /// Shape after warmup.
    pub decay: Decay,
}

impl LrSchedule {
    /// A constant `lr` with no warmup.
    pub fn constant(lr: f64) -> Self {
        Self { base_lr: lr, min_lr: 0.0, warmup_steps: 0, total_steps: 0, decay: Decay::Constant }
    }

    /// Checks the fields; the error is an [`Error::Config`](crate::Error::Config) naming
    /// `lr_schedule.<field>`.
    pub fn validate(&self) -> Result<()> {
        if !(self.base_lr.is_finite() && self.base_lr >= 0.0) {
            return Err(config_error("lr_schedule.base_lr", format!("must be finite and ≥ 0, got {}", self.base_lr)));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.base_lr) {
            return Err(config_error(
                "lr_schedule.min_lr",
                format!("must be in [0, base_lr = {}], got {}", self.base_lr, self.min_lr),
            ));
        }
        if self.warmup_steps > self.total_steps {
            return Err(config_error(
                "lr_schedule.warmup_steps",
                format!("{} exceeds total_steps = {}", self.warmup_steps, self.total_steps),
            ));
        }
        Ok(())
    }

    /// The learning rate of 0-based optimizer step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.base_lr * step as f64 / self.warmup_steps as f64;
        }
        if self.decay == Decay::Constant {
            return self.base_lr;
        }
        if step >= self.total_steps {
            return self.min_lr;
        }
        // Here warmup_steps ≤ step < total_steps, so the span is ≥ 1.
        let progress = (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let factor = match self.decay {
            Decay::Linear => 1.0 - progress,
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            Decay::Constant => 1.0,
        };
        self.min_lr + (self.base_lr - self.min_lr) * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// Equal up to rounding (the formulas take a few f64 operations).
    #[track_caller]
    fn assert_close(got: f64, want: f64) {
        assert!((got - want).abs() <= 1e-15 * want.abs(), "lr {got:e}, expected {want:e}");
    }

    fn schedule(decay: Decay) -> LrSchedule {
        LrSchedule { base_lr: 1e-3, min_lr: 1e-5, warmup_steps: 10, total_steps: 110, decay }
    }

    #[test]
    fn warmup_rises_linearly_from_zero() {
        let s = schedule(Decay::Cosine);
        assert_eq!(s.lr_at(0), 0.0);
        assert_close(s.lr_at(1), 1e-4);
        assert_close(s.lr_at(5), 5e-4);
        assert_close(s.lr_at(9), 9e-4);
        assert_close(s.lr_at(10), 1e-3); // warmup ends at the base rate
    }

    #[test]
    fn linear_decay_reaches_min_lr() {
        let s = schedule(Decay::Linear);
        // Halfway through the 100 decay steps: min + (base − min)/2.
        assert_close(s.lr_at(60), 1e-5 + 0.5 * (1e-3 - 1e-5));
        // One step before the end: min + (base − min)·1/100.
        assert_close(s.lr_at(109), 1e-5 + 0.01 * (1e-3 - 1e-5));
        assert_eq!(s.lr_at(110), 1e-5);
        assert_eq!(s.lr_at(1_000), 1e-5, "stays at min_lr after total_steps");
    }

    #[test]
    fn cosine_midpoint_is_the_mean_of_base_and_min() {
        let s = schedule(Decay::Cosine);
        assert_close(s.lr_at(60), (1e-3 + 1e-5) / 2.0);
        assert!(s.lr_at(30) > s.lr_at(60) && s.lr_at(60) > s.lr_at(90), "decreasing");
        assert_eq!(s.lr_at(110), 1e-5);
    }

    #[test]
    fn constant_stays_at_base_after_warmup() {
        let s = schedule(Decay::Constant);
        assert_close(s.lr_at(5), 5e-4);
        assert_eq!(s.lr_at(10), 1e-3);
        assert_eq!(s.lr_at(10_000), 1e-3);
        let c = LrSchedule::constant(0.1);
        c.validate().unwrap();
        assert_eq!(c.lr_at(0), 0.1);
    }

    #[test]
    fn no_warmup_starts_at_base() {
        let s = LrSchedule { warmup_steps: 0, ..schedule(Decay::Linear) };
        assert_eq!(s.lr_at(0), 1e-3);
    }

    #[test]
    fn invalid_configs_name_the_field() {
        let field_of = |s: LrSchedule| match s.validate() {
            Err(Error::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        };
        let ok = schedule(Decay::Linear);
        ok.validate().unwrap();
        assert_eq!(field_of(LrSchedule { base_lr: -1e-3, ..ok }), "lr_schedule.base_lr");
        assert_eq!(field_of(LrSchedule { base_lr: f64::NAN, ..ok }), "lr_schedule.base_lr");
        assert_eq!(field_of(LrSchedule { min_lr: -1.0, ..ok }), "lr_schedule.min_lr");
        assert_eq!(field_of(LrSchedule { min_lr: 1.0, ..ok }), "lr_schedule.min_lr");
        assert_eq!(field_of(LrSchedule { warmup_steps: 111, ..ok }), "lr_schedule.warmup_steps");
    }

    #[test]
    fn serde_round_trip_and_names() {
        let s: LrSchedule =
            serde_json::from_str(r#"{"base_lr": 0.001, "total_steps": 100, "decay": "cosine"}"#).unwrap();
        assert_eq!(
            s,
            LrSchedule { base_lr: 1e-3, min_lr: 0.0, warmup_steps: 0, total_steps: 100, decay: Decay::Cosine }
        );
        let back: LrSchedule = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
