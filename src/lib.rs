//! # pipetransformer
//!
//! A Transformer training engine with hand-written forward and backward passes, scheduled across
//! devices as PipeTransformer (freeze, pack, replicate, cache) and TeraPipe (token slicing)
//! describe. No autograd: every op's backward sits next to its forward.
//!
//! ## Table of contents
//!
//! | module | defines |
//! |---|---|
//! | [`scalar`] | `Float` (f32/f64 element types), `DType` |
//! | [`error`] | `Error`, `Result`, `check_len` |
//! | [`rng`] | `Rng` (seeded SplitMix64), `hash_u64` (counter-based hash for dropout masks) |
//! | [`bytes`](mod@bytes) | byte counts as written (`8GiB`, `512MiB`, `1000000`): `parse`, and serde readers for config fields |
//! | [`files`] | `write_atomic` (temp file, fsync, rename) |
//! | [`debug`] | `level()`: the `PT_DEBUG` environment variable (1: per-step timings on stderr) |
//! | [`ops`] | reference kernels, each a `*_forward`/`*_backward` pair: `matmul`, `gemm_bf16` (bf16 products with f32 accumulation: `vdpbf16ps` and AMX kernels, fallback, reference), `linear`, `embedding`, `patch` (+ class token), `layernorm`, `gelu`, `softmax`, `tanh`, `residual`, `dropout`, `attention`, `pooling`, `cross_entropy`, `optim` (AdamW, SGD, norms); `simd` (`vectorized`: element-wise loops compiled for the CPU's widest vector unit, chosen at run time; a vectorisable `exp_f32`) |
//! | [`device`] | the `Device` trait (buffers + op set); backends `cpu` (`CpuDevice<T>`), `cuda` and `cuda-emu` (`GpuDevice`: one launch code over a `Runtime`); kernel sources and NVRTC/ptxas (`device::kernels`); `DeviceKind`, `AnyDevice` |
//! | [`model`] | configs (`BertConfig`, `GptConfig`, `VitConfig`), `HostBatch` (a batch in host memory: tokens or pixels, targets, sample ids; `HostBatch::random`, the benches' and tests' synthetic batch) and `Batch` (uploaded to a device), `Param`, the units (`Unit`: embedding, attention, MLP, final norm, head), `Model` (forward, backward, freezing, costs; random weights, or their draws put off for a load: `init`) |
//! | [`comm`] | `Communicator`: the in-process ring all-reduce and NCCL (opened by its own loader; one group over every launched process's GPUs); the authenticated TCP rendezvous; process groups across processes (`launch`), which sum over a TCP ring and split into rows and columns, each with its own ring; the watchdog that aborts collectives past the timeout |
//! | [`optim`] | `Optimizer` (AdamW, SGD + momentum), `LrSchedule` (warmup + linear/cosine), global-norm clipping, `train_step` (one step on one device) |
//! | [`pipeline`] | unit profiles, the partitioner (with activation recomputation chosen stage by stage, unit by unit), the schedule IR and its generators (GPipe, 1F1B, interleaved, zero bubble) and validator, `Plan`, the `Pipeline` runtime (stage workers, replicas whose gradients are summed in buckets as the backward goes, re-planning, freezing, evaluation; stages and replicas as processes, each holding its own stage), traces and bubbles |
//! | [`pipeline::simulate`](mod@pipeline::simulate) | the cluster simulator: a `Schedule` played against a `CostModel` (stage times from the profiles, a `Link` per message) → `Simulation` (per-device spans, makespan, busy time, bubble as measured) |
//! | [`train`] | `Trainer` (the epoch loop over a `Pipeline`, evaluation, checkpoints), `BatchSource`, `Event`, `EvalMetrics` and `Confusion` (accuracy, per-class precision/recall/F1), `Selection` (the best evaluation kept, early stopping), the `Controller` hook |
//! | [`elastic`] | PipeTransformer: the freeze controller (Eq. 1, α bound, table), AutoPipe, AutoDP, AutoCache (host arena + disk spill), transitions |
//! | [`terapipe`] | TeraPipe: `TokenSlices` (the request), `LatencyModel` (`t0` table + fitted context term + comm) and its measurement on a device, `MemoryModel`, `plan` (the `t_max` DP, exact pruning, joint batch × token, memory limits) → `SlicingPlan` |
//! | [`data`] | dataset loaders (Rotten Tomatoes, Reuters R8, digits, MNIST-5k, Fashion-MNIST, Hamlet) with stable sample ids, seeded stratified splits, `BatchOrder` (resumable per-epoch shuffle), image and LM batches (`model::HostBatch`); a user's PNG/JPEG/PGM/IDX images |
//! | [`run`] | `RunConfig` (a TOML run configuration with `--set` overrides), `open_devices`/`open_device` (the command line's devices), the data sources, `prepare_data` and `build_model` (a run's data and model), `Job` (devices, model, plan, pipeline, trainer and elastic controller from a config; metrics, checkpoints, export, `report.html`; `resume` → `Resumed`), `ProgressLines` (progress without a terminal) and `event_line` (the console's line for each event other than a step), `overfit` (a small model memorises one batch: the quickest end-to-end check of a device), `Predictor` (`predict` and `evaluate` on an export or checkpoint), `launch` (one process per device, torchrun's conventions) |
//! | [`weights`] | Hugging Face checkpoints: `load_safetensors` (memory-mapped), `load_into_model` (by name, with a `LoadReport` of missing/unexpected tensors), `read_hf_config`, `export_model` (a self-contained folder: safetensors under the HF class's names, `config.json` with labels, tokenizer or vocabulary, sentence-transformers modules, preprocessing; atomic), `read_export` |
//! | [`bench`](mod@bench) | the MiniLM-shaped benchmark workload, step FLOPs, the GEMM roofline, GPU datasheet peaks, `bench_step` → `StepReport` (the `bench-step` table, PyTorch beside it) |
//! | [`text`] | `TextTokenizer` (a Hugging Face `tokenizer.json`, our truncation, no padding), `text_batch` (labelled texts → per-batch-padded BERT `HostBatch`), `stream_batch`/`stream_batches` (a token stream's windows → next-token `HostBatch`es; `data::lm_batch` batches a corpus's sequences) |
//! | [`testing`] | finite-difference gradient checks and error metrics used by the tests |
//! | [`fuzz`] | structure-aware mutation fuzzing on stable Rust: `run` a target (safetensors, checkpoint, IDX, CSV, Orange .tab, `tokenizer.json`, run config, `config.json`, PNG/JPEG/PGM, rendezvous messages) from seeded mutations of valid seeds; panics, hangs and over-cap allocations (`check_allocation`) become `Finding`s |
//!
//! ## Training from code
//!
//! - A whole configured run, as the binary's `train` makes it: [`run::RunConfig::load`] (or
//!   `parse`), [`run::open_devices`], then [`run::Job::new`] and [`run::Job::run`], which
//!   trains, evaluates, checkpoints and exports to `output.dir`.
//! - The epoch loop over your own data: a [`train::BatchSource`], a [`pipeline::Pipeline`]
//!   (one device is a pipeline of one stage), [`train::Trainer::fit`] with a
//!   [`train::Controller`] between steps ([`elastic::Elastic`], after its
//!   [`start`](elastic::Elastic::start), which applies a freeze table's first entry, takes the
//!   settling test's first weights and begins AutoPipe's timing; or `()` for none), and
//!   [`weights::export_values`] of [`pipeline::Pipeline::parameter_tensors`] for an export.
//! - One step on one device: [`optim::train_step`] (`examples/train_tiny.rs`).

#![warn(missing_docs)]

pub mod bench;
pub mod bytes;
pub mod comm;
pub mod data;
pub mod debug;
pub mod device;
pub mod elastic;
pub mod error;
pub mod files;
pub mod fuzz;
pub mod model;
pub mod ops;
pub mod optim;
pub mod pipeline;
pub mod rng;
pub mod run;
pub mod scalar;
pub mod terapipe;
pub mod testing;
pub mod text;
pub mod train;
pub mod weights;

pub use device::{CpuDevice, Device};
pub use error::{Error, Result};
pub use scalar::{DType, Float};
