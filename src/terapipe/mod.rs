//! TeraPipe (Li et al., ICML 2021): token-level pipelining for causal language models.
//!
//! Where each piece lives: the user's request and its lengths ([`slices`]); token-sliced
//! execution in the layers below — dropout masks by global coordinates
//! (`ops::dropout::DropoutCoords`), the key/value arena (`model::kv_arena`), attention over a
//! slice's context (`model::block`), `HostBatch::token_slices`, and the schedules over
//! (micro-batch, slice) pieces (`pipeline::schedule`, `pipeline::runtime`).

pub mod slices;

pub use slices::{TokenSlices, uniform};
