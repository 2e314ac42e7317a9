//! Running a configured training job: the TOML configuration and its overrides.

pub mod config;

pub use config::{DataSection, DatasetName, ModelSection, OutputSection, RunConfig};
