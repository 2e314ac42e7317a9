//! PipeTransformer (He et al., ICML 2021): freeze the bottom layers that have converged while
//! training runs, take them out of the pipeline, pack the active layers into fewer devices,
//! give the freed devices to more data-parallel replicas, and cache the frozen layers' output
//! so later epochs skip them. Each module can be switched off for the ablation.
//!
//! | module | paper | defines |
//! |---|---|---|
//! | [`freeze`] | §3.1, Eq. 1 | `FreezeController`, `eq1`, `alpha_schedule`, `FreezeRule`, `settled` (the settling test, §8 item 8 of the reference) |
//! | [`autopipe`] | §3.2, Algorithm 1 | `choose_shape` (K by the planner's predicted throughput), `Tuner` (M timed on the devices) |
//! | [`autodp`] | §3.3 | `replicas_for`, `BatchPolicy` (`constant`, `scale-lr`), NCCL groups for the new shape |
//! | [`cache`] | §3.4 | `ActivationCache` (host arena, bf16 option, `memmap2` spill, incremental advance) |
//! | [`controller`] | the loop | `Elastic`: the [`Controller`](crate::train::Controller) that applies all four between steps, as transitions |

pub mod autodp;
pub mod autopipe;
pub mod cache;
pub mod controller;
pub mod freeze;

pub use autodp::{BatchPolicy, FreedDevices};
pub use cache::{ActivationCache, CacheDtype, CachedBatch};
pub use controller::Elastic;
pub use freeze::{FreezeController, FreezeRule};

use crate::error::{Result, config_error};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which freeze rule (`--freeze`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FreezeName {
    /// Never freeze: the baseline.
    #[default]
    Off,
    /// The paper's Eq. 1.
    Eq1,
    /// The α bound alone (the released code).
    Alpha,
    /// `elastic.table`.
    Table,
}

impl FreezeName {
    /// Every rule, in the order `--help` lists them.
    const ALL: [FreezeName; 4] = [FreezeName::Off, FreezeName::Eq1, FreezeName::Alpha, FreezeName::Table];

    /// Its name in a config and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FreezeName::Off => "off",
            FreezeName::Eq1 => "eq1",
            FreezeName::Alpha => "alpha",
            FreezeName::Table => "table",
        }
    }
}

impl std::str::FromStr for FreezeName {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|f| f.name()).collect();
            config_error("elastic.freeze", format!("`{s}` is not one of {}", names.join(", ")))
        })
    }
}

/// When the freeze rule runs (`--freeze-interval`): at each epoch's end (the paper), or every
/// `N` optimizer steps. In TOML: `"epoch"` or a positive integer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FreezeInterval {
    /// After each epoch's evaluation.
    #[default]
    Epoch,
    /// Every this many steps.
    Steps(u64),
}

impl std::str::FromStr for FreezeInterval {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "epoch" => Ok(Self::Epoch),
            n => match n.parse::<u64>() {
                Ok(n) if n > 0 => Ok(Self::Steps(n)),
                _ => Err(config_error(
                    "elastic.freeze_interval",
                    format!("`{s}` is neither `epoch` nor a positive number of steps"),
                )),
            },
        }
    }
}

impl Serialize for FreezeInterval {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Epoch => s.serialize_str("epoch"),
            Self::Steps(n) => s.serialize_u64(*n),
        }
    }
}

impl<'de> Deserialize<'de> for FreezeInterval {
    fn deserialize<De: serde::Deserializer<'de>>(d: De) -> std::result::Result<Self, De::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = FreezeInterval;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"epoch\" or a positive number of steps")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> std::result::Result<Self::Value, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> std::result::Result<Self::Value, E> {
                self.visit_str(&n.to_string())
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> std::result::Result<Self::Value, E> {
                s.parse().map_err(|e: crate::Error| E::custom(e))
            }
        }
        d.deserialize_any(V)
    }
}

fn default_alpha() -> f64 {
    1.0 / 3.0
}

fn default_true() -> bool {
    true
}

fn default_cache_bytes() -> usize {
    4 << 30
}

/// The `[elastic]` section of a run config: which PipeTransformer modules run, and how.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ElasticConfig {
    /// The freeze rule.
    pub freeze: FreezeName,
    /// α of Eq. 1 and of the α bound, in (0, 1). The paper's conservative choice, 1/3, by
    /// default.
    #[serde(default = "default_alpha")]
    pub alpha: f64,
    /// Frozen layers per interval for `freeze = "table"`: non-decreasing, at most the model's
    /// layers.
    pub table: Vec<usize>,
    /// When the rule runs.
    pub freeze_interval: FreezeInterval,
    /// A layer freezes only once it has settled: its weights moved by at most this fraction of
    /// their norm (`‖W_T − W_{T−1}‖ / ‖W_{T−1}‖`) over the last interval, it and every layer
    /// below it. Caps whatever the rule decides; unset, the rule alone decides (the paper).
    pub max_weight_change: Option<f64>,
    /// Re-partition the active units and shorten the pipeline after a freeze.
    pub auto_pipe: bool,
    /// Where AutoPipe's price of a shorter pipeline rests on a guess (cpu devices that share a
    /// pool or lend their threads, whose speed with more threads it takes to be ideal), time
    /// the pipeline length it chose against the one in force, each at its best micro-batch
    /// count, and keep the faster. Not in launched multi-process runs (rank 0's plan rules
    /// there), nor between shapes whose replica counts differ under `batch_policy =
    /// "scale-lr"`, where the trial would change the recipe. A run resumed with it off keeps
    /// the length in force. On by default; off, the planner's price alone decides.
    #[serde(default = "default_true")]
    pub time_pipeline_len: bool,
    /// Put freed devices to work: as replicas, or (cpu devices, `freed_devices = "threads"`)
    /// as threads of the devices still in the pipeline.
    pub auto_dp: bool,
    /// What freed cpu devices become under AutoDP.
    pub freed_devices: autodp::FreedDevices,
    /// The global batch when replicas change.
    pub batch_policy: BatchPolicy,
    /// Cache the frozen prefix's output (switched on only where reading it is measured to be
    /// cheaper than the forward it replaces).
    pub cache: bool,
    /// Bytes of host memory the cache may hold before it spills to disk: a count, or text
    /// with a unit (`"4GiB"`).
    #[serde(default = "default_cache_bytes", deserialize_with = "crate::bytes::deserialize")]
    pub cache_bytes: usize,
    /// Where the spill file goes (default: the run's output directory, `cache/`).
    pub cache_dir: Option<PathBuf>,
    /// Storage of cached values: f32, or bf16 (half the memory; rounded where activations
    /// are f32). Unset: the activations' own dtype, exact either way (bf16 on a bf16 GPU).
    pub cache_dtype: Option<CacheDtype>,
    /// Allow caching a dataset with random augmentation (a cached sample then keeps the
    /// augmented view it was first seen with).
    pub cache_augmented: bool,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        Self {
            freeze: FreezeName::Off,
            alpha: default_alpha(),
            table: Vec::new(),
            freeze_interval: FreezeInterval::Epoch,
            max_weight_change: None,
            auto_pipe: false,
            time_pipeline_len: true,
            auto_dp: false,
            freed_devices: autodp::FreedDevices::Replicas,
            batch_policy: BatchPolicy::Constant,
            cache: false,
            cache_bytes: default_cache_bytes(),
            cache_dir: None,
            cache_dtype: None,
            cache_augmented: false,
        }
    }
}

impl ElasticConfig {
    /// The keys among `given` (keys of `[elastic]` that were written down) that this config's
    /// switches leave unread, each with a sentence for a warning: a cache size with the cache
    /// off, α under a table, a freed-device policy without AutoDP. A setting left at its
    /// default is never named; a switch given as off names nothing. (AutoDP and the cache
    /// without freezing need no rule: [`validate`](Self::validate) refuses them.)
    pub fn inert_settings(&self, given: &dyn Fn(&str) -> bool) -> Vec<(&'static str, String)> {
        let freeze = self.freeze.name();
        let freezes = self.freeze != FreezeName::Off;
        // (key, whether its switch leaves it unread, the switch as the user would write it)
        let rules: [(&str, bool, String); 11] = [
            (
                "alpha",
                matches!(self.freeze, FreezeName::Off | FreezeName::Table),
                format!("elastic.freeze is {freeze}"),
            ),
            ("table", self.freeze != FreezeName::Table, format!("elastic.freeze is {freeze}")),
            ("freeze_interval", !freezes, "elastic.freeze is off".into()),
            ("max_weight_change", !freezes, "elastic.freeze is off".into()),
            ("time_pipeline_len", !self.auto_pipe, "elastic.auto_pipe is off".into()),
            ("freed_devices", !self.auto_dp, "elastic.auto_dp is off".into()),
            ("batch_policy", !self.auto_dp, "elastic.auto_dp is off".into()),
            ("cache_bytes", !self.cache, "elastic.cache is off".into()),
            ("cache_dir", !self.cache, "elastic.cache is off".into()),
            ("cache_dtype", !self.cache, "elastic.cache is off".into()),
            ("cache_augmented", !self.cache, "elastic.cache is off".into()),
        ];
        rules
            .into_iter()
            .filter(|(key, unread, _)| *unread && given(key))
            .map(|(key, _, why)| (key, format!("elastic.{key} is set, but {why}: it has no effect")))
            .collect()
    }

    /// Whether the devices a shorter pipeline frees lend their threads to `devices` at work:
    /// AutoDP on, `freed_devices = "threads"`, and cpu devices.
    pub fn lends_threads<D: crate::device::Device>(&self, devices: &[D]) -> bool {
        self.auto_dp && autodp::lends_threads(self.freed_devices, devices)
    }

    /// The freeze rule this config names.
    pub fn rule(&self) -> FreezeRule {
        match self.freeze {
            FreezeName::Off => FreezeRule::Off,
            FreezeName::Eq1 => FreezeRule::Eq1,
            FreezeName::Alpha => FreezeRule::Alpha,
            FreezeName::Table => FreezeRule::Table(self.table.clone()),
        }
    }

    /// Checks the switches against each other and the rule against a model of `layers`
    /// layers; `augmented` says whether the training data is randomly augmented.
    pub fn validate(&self, layers: usize, augmented: bool) -> Result<()> {
        // α's range under every rule: a value no rule could read is a typo that the warning
        // for an unread setting would leave standing.
        freeze::check_alpha(self.alpha)?;
        freeze::validate(&self.rule(), self.alpha, layers)?;
        if let Some(t) = self.max_weight_change.filter(|t| !(t.is_finite() && *t > 0.0)) {
            return Err(config_error(
                "elastic.max_weight_change",
                format!("must be a positive fraction of the weights' norm (e.g. 0.05), got {t}"),
            ));
        }
        let freezes = self.freeze != FreezeName::Off;
        let need = |on: bool, what: &str, needs: &str, ok: bool| {
            if on && !ok { Err(config_error(format!("elastic.{what}"), needs.to_string())) } else { Ok(()) }
        };
        need(
            self.auto_pipe,
            "auto_pipe",
            "needs a freeze rule (elastic.freeze): only frozen layers leave the pipeline",
            freezes,
        )?;
        need(
            self.auto_dp,
            "auto_dp",
            "needs elastic.auto_pipe: only a shorter pipeline frees devices",
            self.auto_pipe,
        )?;
        // `freed_devices` says what AutoDP makes of freed devices: without AutoDP it has
        // nothing to do (so switching AutoDP off in an ablation needs no second flag).
        need(
            self.auto_dp && self.freed_devices == autodp::FreedDevices::Threads,
            "batch_policy",
            "\"scale-lr\" grows the batch with the replicas, and freed cpu devices lending threads (elastic.freed_devices = \"threads\") add none: choose one",
            self.batch_policy == BatchPolicy::Constant,
        )?;
        need(
            self.cache,
            "cache",
            "needs elastic.auto_pipe: the cached prefix must sit on the first stage",
            self.auto_pipe,
        )?;
        need(
            self.cache && augmented,
            "cache",
            "the training data is randomly augmented, so a cached sample would keep one augmented view; set elastic.cache_augmented = true to accept that",
            self.cache_augmented,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_that_need_others_are_refused_by_name() {
        let on = ElasticConfig { freeze: FreezeName::Alpha, auto_pipe: true, ..Default::default() };
        assert!(on.validate(6, false).is_ok());
        let e = ElasticConfig { auto_pipe: true, ..Default::default() }.validate(6, false).unwrap_err().to_string();
        assert!(e.contains("elastic.auto_pipe"), "{e}");
        let e =
            ElasticConfig { auto_pipe: false, auto_dp: true, ..on.clone() }.validate(6, false).unwrap_err().to_string();
        assert!(e.contains("elastic.auto_dp"), "{e}");
        let e = ElasticConfig { cache: true, ..on.clone() }.validate(6, true).unwrap_err().to_string();
        assert!(e.contains("augmented"), "{e}");
        for bad in [0.0, -0.1, f64::NAN, f64::INFINITY] {
            let e = ElasticConfig { max_weight_change: Some(bad), ..on.clone() }.validate(6, false).unwrap_err();
            assert!(e.to_string().contains("elastic.max_weight_change"), "{bad}: {e}");
        }
        assert!(ElasticConfig { max_weight_change: Some(0.05), ..on.clone() }.validate(6, false).is_ok());
        assert!(ElasticConfig { cache: true, cache_augmented: true, ..on.clone() }.validate(6, true).is_ok());
        // Freed devices lending threads: idle without AutoDP (no error, so an ablation can
        // switch AutoDP off alone); with it, refused beside scale-lr, which needs replicas.
        let threads = ElasticConfig { freed_devices: FreedDevices::Threads, ..on.clone() };
        assert!(threads.validate(6, false).is_ok());
        let scale = ElasticConfig { auto_dp: true, batch_policy: BatchPolicy::ScaleLr, ..threads };
        let e = scale.validate(6, false).unwrap_err().to_string();
        assert!(e.contains("elastic.batch_policy") && e.contains("choose one"), "{e}");
        assert!(ElasticConfig { freed_devices: FreedDevices::Replicas, ..scale }.validate(6, false).is_ok());
        let e = ElasticConfig { alpha: 1.5, ..on.clone() }.validate(6, false).unwrap_err().to_string();
        assert!(e.contains("(0, 1)"), "{e}");
        // Under a rule that does not read it too.
        let off = ElasticConfig { freeze: FreezeName::Off, auto_pipe: false, auto_dp: false, cache: false, ..on };
        assert!(off.validate(6, false).is_ok());
        let e = ElasticConfig { alpha: 5.0, ..off }.validate(6, false).unwrap_err().to_string();
        assert!(e.contains("elastic.alpha") && e.contains("(0, 1)"), "{e}");
    }

    #[test]
    fn the_interval_reads_epoch_or_a_step_count() {
        let parse = |t: &str| toml::from_str::<ElasticConfig>(t).map(|c| c.freeze_interval);
        assert_eq!(parse("freeze_interval = \"epoch\"").unwrap(), FreezeInterval::Epoch);
        assert_eq!(parse("freeze_interval = 50").unwrap(), FreezeInterval::Steps(50));
        assert!(parse("freeze_interval = 0").unwrap_err().to_string().contains("positive"));
        assert!(parse("freeze_interval = \"weekly\"").is_err());
        assert_eq!("table".parse::<FreezeName>().unwrap(), FreezeName::Table);
        assert!("sometimes".parse::<FreezeName>().is_err());
    }
}
