//! Running a configured training job: the TOML configuration and its overrides.

pub mod config;
pub mod job;
pub mod source;

pub use config::{DataSection, DatasetName, ModelSection, OutputSection, RunConfig};
pub use job::{DataInfo, Job, Summary, build_model, prepare_data, unigram_loss};
pub use source::{SampleSource, subset};
