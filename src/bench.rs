//! Workloads and measurements shared by the criterion benches (`benches/`) and the
//! `pipetransformer bench-step` report: the MiniLM-shaped encoder, synthetic batches, FLOP
//! counts and the machine's large-GEMM rate (the roofline the step is compared against).

use crate::device::Device;
use crate::model::{BertConfig, HostBatch, IGNORE_INDEX, Model, ModelConfig, Pooling};
use crate::ops::matmul::{MatRef, matmul};
use crate::rng::Rng;
use std::time::Instant;

/// all-MiniLM-L6-v2's shape: 6 layers, hidden 384, 12 heads, MLP 1536, vocabulary 30522, with a
/// 2-class mean-pooling head and Hugging Face's default dropout of 0.1.
pub fn minilm_shaped() -> ModelConfig {
    ModelConfig::Bert(BertConfig {
        vocab_size: 30522,
        hidden_size: 384,
        num_hidden_layers: 6,
        num_attention_heads: 12,
        intermediate_size: 1536,
        hidden_act: "gelu".into(),
        max_position_embeddings: 512,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.1,
        num_labels: 2,
        pooling: Pooling::Mean,
    })
}

/// A batch of random inputs for `config`: `batch` sequences of `seq` tokens (text), or
/// `batch` random images; random labels (next tokens for a language model).
pub fn random_batch(config: &ModelConfig, batch: usize, seq: usize, seed: u64) -> HostBatch {
    let mut rng = Rng::new(seed);
    let ids = |rng: &mut Rng, n: usize, below: usize| -> Vec<u32> {
        (0..n).map(|_| rng.below(below as u64) as u32).collect()
    };
    match config {
        ModelConfig::Bert(c) => HostBatch {
            batch,
            seq,
            tokens: Some(ids(&mut rng, batch * seq, c.vocab_size)),
            targets: ids(&mut rng, batch, c.num_labels),
            ..Default::default()
        },
        ModelConfig::Gpt(c) => {
            let tokens = ids(&mut rng, batch * seq, c.vocab_size);
            // Next-token targets: the sequence shifted left, the last position ignored.
            let targets =
                (0..batch * seq).map(|i| if (i + 1) % seq == 0 { IGNORE_INDEX } else { tokens[i + 1] }).collect();
            HostBatch { batch, seq, tokens: Some(tokens), targets, ..Default::default() }
        }
        ModelConfig::Vit(c) => {
            let n = batch * c.num_channels * c.image_size * c.image_size;
            let pixels = (0..n).map(|_| rng.uniform() as f32).collect();
            let targets = ids(&mut rng, batch, c.num_labels);
            HostBatch { batch, pixels: Some(pixels), targets, ..Default::default() }
        }
    }
}

/// FLOPs of one training step (forward + backward) of `batch` samples at hidden-state length
/// `seq`, from the units' analytic costs.
pub fn step_flops<D: Device>(model: &Model<D>, dev: &D, batch: usize, seq: usize) -> f64 {
    model.costs(dev, seq).iter().map(|c| c.forward_flops + c.backward_flops).sum::<f64>() * batch as f64
}

/// A pool of `threads` threads and two random `n×n` matrices: the f32 GEMM that measures this
/// machine's practical peak for this engine ([`GemmProbe::gflops`]).
pub struct GemmProbe {
    pool: rayon::ThreadPool,
    n: usize,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl GemmProbe {
    /// An `n×n×n` probe on `threads` threads.
    pub fn new(threads: usize, n: usize) -> crate::Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build().map_err(|e| {
            crate::Error::Config { field: "threads".into(), message: format!("cannot start {threads} threads: {e}") }
        })?;
        let mut rng = Rng::new(1);
        let a: Vec<f32> = rng.vec(n * n, 1.0).iter().map(|&x| x as f32).collect();
        let b: Vec<f32> = rng.vec(n * n, 1.0).iter().map(|&x| x as f32).collect();
        Ok(Self { pool, n, a, b, c: vec![0f32; n * n] })
    }

    /// The rate of one GEMM through [`matmul`], in GFLOP/s.
    pub fn gflops(&mut self) -> f64 {
        let n = self.n;
        let (a, b, c) = (&self.a, &self.b, &mut self.c);
        let t = Instant::now();
        self.pool.install(|| matmul(c, n, MatRef::rows(a, n), MatRef::rows(b, n), n, n, n, false));
        2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64() / 1e9
    }
}

/// A timed training step: the median, fastest and slowest of the timed steps, in seconds, and
/// the step's FLOPs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTiming {
    /// Median step time.
    pub median: f64,
    /// Fastest step.
    pub min: f64,
    /// Slowest step.
    pub max: f64,
    /// FLOPs of one step (forward and backward, from the units' analytic costs).
    pub flops: f64,
    /// The median rate of the f32 GEMMs timed one after each step, when asked for: the floor
    /// measured in the same seconds as the steps, so a VM whose speed drifts between runs
    /// moves both alike.
    pub gemm_gflops: Option<f64>,
    /// The median over the timed steps of each step against the GEMM timed right after it
    /// ([`paired_floor_ratio`]), when the floor was asked for.
    pub paired_ratio: Option<f64>,
}

impl StepTiming {
    /// The median step against its FLOPs at the interleaved GEMM rate (1.0: the step runs at
    /// the speed of its products alone).
    pub fn floor_ratio(&self) -> Option<f64> {
        self.gemm_gflops.map(|g| self.median / (self.flops / g / 1e9))
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Each step's time against its FLOPs at the rate of the GEMM timed right after it, the
/// median of those: a VM that drifts within a run moves a step and its own GEMM together, so
/// the pairs cancel the drift that a ratio of the two medians keeps.
pub fn paired_floor_ratio(times: &[f64], gflops: &[f64], flops: f64) -> f64 {
    median(times.iter().zip(gflops).map(|(t, g)| t / (flops / g / 1e9)).collect())
}

/// Times `steps` training steps (forward, backward, clipping at 1.0, AdamW) of the
/// MiniLM-shaped encoder on `dev`, after `warmup` untimed ones, on one random batch of
/// `batch` × `seq` tokens; with a `floor` probe, one GEMM after each timed step.
pub fn time_step<D: Device>(
    dev: &D,
    steps: usize,
    warmup: usize,
    batch: usize,
    seq: usize,
    mut floor: Option<&mut GemmProbe>,
) -> crate::Result<StepTiming> {
    use crate::model::Batch;
    use crate::optim::{Optimizer, OptimizerConfig, train_step};
    let config = minilm_shaped();
    let mut model = Model::new(dev, &config, 0)?;
    let host = random_batch(&config, batch, seq, 1);
    let batch_dev = Batch::upload(dev, model.spec(), &host, true, 2)?;
    let mut optimizer = Optimizer::new(OptimizerConfig::adamw())?;
    let flops = step_flops(&model, dev, batch, seq);
    for _ in 0..warmup {
        train_step(dev, &mut model, &mut optimizer, &batch_dev, 1e-4, Some(1.0))?;
    }
    crate::debug::take_op_times(); // the warm-up's
    let (mut times, mut rates) = (Vec::with_capacity(steps.max(1)), Vec::new());
    for _ in 0..steps.max(1) {
        let t = Instant::now();
        train_step(dev, &mut model, &mut optimizer, &batch_dev, 1e-4, Some(1.0))?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
        if let Some(probe) = floor.as_deref_mut() {
            rates.push(probe.gflops());
        }
    }
    crate::debug::print_op_times(&format!("{} timed steps", times.len()));
    let (min, max) = times.iter().fold((f64::INFINITY, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
    let paired_ratio = (!rates.is_empty()).then(|| paired_floor_ratio(&times, &rates, flops));
    let gemm_gflops = (!rates.is_empty()).then(|| median(rates));
    Ok(StepTiming { median: median(times), min, max, flops, gemm_gflops, paired_ratio })
}

/// Where PyTorch's side of `bench-step` runs for our device kind: the CPU, or a real GPU; none
/// for the emulator, whose timings mean nothing.
pub fn torch_device(kind: crate::device::DeviceKind) -> Option<&'static str> {
    use crate::device::DeviceKind;
    match kind {
        DeviceKind::Cpu => Some("cpu"),
        DeviceKind::Cuda => Some("cuda"),
        DeviceKind::CudaEmu | DeviceKind::Auto => None,
    }
}

/// A GPU's datasheet peaks, in FLOP/s and bytes/s: what a step's MFU and a kernel's roofline
/// floor are measured against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuPeak {
    /// Dense bf16 on the tensor cores (f32 accumulation).
    pub bf16: f64,
    /// f32 on the SIMT cores (no TF32).
    pub f32: f64,
    /// Memory bandwidth.
    pub bandwidth: f64,
}

/// Datasheet peaks of the GPUs this project targets (SXM parts unless named): the name's
/// fragment as the driver reports it, dense bf16 and f32 TFLOP/s, memory TB/s. Longer
/// fragments first: "H100 PCIe" is not an SXM H100.
const GPU_PEAKS: [(&str, f64, f64, f64); 3] =
    [("H200", 989.4, 66.9, 4.8), ("H100 PCIe", 756.0, 51.2, 2.0), ("H100", 989.4, 66.9, 3.35)];

/// The peaks of the GPU the driver calls `name` (e.g. `NVIDIA H200`), if it is one of ours.
pub fn gpu_peak(name: &str) -> Option<GpuPeak> {
    GPU_PEAKS.iter().find(|(n, ..)| name.contains(n)).map(|&(_, bf16, f32, bw)| GpuPeak {
        bf16: bf16 * 1e12,
        f32: f32 * 1e12,
        bandwidth: bw * 1e12,
    })
}

/// The PyTorch script beside the report (`scripts/bench_torch.py`), embedded so an installed
/// binary carries it.
const TORCH_SCRIPT: &str = include_str!("../scripts/bench_torch.py");

/// PyTorch's step on the same shape, as `scripts/bench_torch.py` times it.
#[derive(Clone, Debug, PartialEq)]
pub enum TorchStep {
    /// Median milliseconds in f32 and under bf16 autocast, with torch's version and threads.
    Timed {
        /// `torch.__version__`.
        version: String,
        /// Torch's intra-op threads.
        threads: usize,
        /// Median f32 step.
        f32_ms: f64,
        /// Median step under bf16 autocast.
        bf16_ms: f64,
    },
    /// Why there is no comparison (no such Python, or no torch in it).
    Absent(String),
}

/// Runs the embedded PyTorch script with `python` on the same step shape, on `device` (`cpu` or
/// `cuda`). A Python without
/// torch (or no Python) is [`TorchStep::Absent`]; a script that fails otherwise is an error.
pub fn torch_step(
    python: &str,
    steps: usize,
    warmup: usize,
    batch: usize,
    seq: usize,
    threads: usize,
    device: &str,
) -> crate::Result<TorchStep> {
    let args = [("--steps", steps), ("--warmup", warmup), ("--batch", batch), ("--seq", seq), ("--threads", threads)];
    let mut command = std::process::Command::new(python);
    command.arg("-c").arg(TORCH_SCRIPT).arg("--device").arg(device);
    for (flag, value) in args {
        command.arg(flag).arg(value.to_string());
    }
    let out = match command.output() {
        Ok(out) => out,
        Err(e) => return Ok(TorchStep::Absent(format!("cannot run `{python}`: {e}"))),
    };
    let failed =
        |why: String| crate::Error::Data { what: "PyTorch comparison (scripts/bench_torch.py)".into(), message: why };
    if !out.status.success() {
        return Err(failed(format!(
            "`{python}` exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| failed(format!("printed `{line}`: {e}")))?;
    if let Some(why) = v.get("absent").and_then(|w| w.as_str()) {
        return Ok(TorchStep::Absent(format!("`{python}`: {why}")));
    }
    let num =
        |k: &str| v.get(k).and_then(serde_json::Value::as_f64).ok_or_else(|| failed(format!("no `{k}` in `{line}`")));
    Ok(TorchStep::Timed {
        version: v.get("torch").and_then(|t| t.as_str()).unwrap_or("?").to_string(),
        threads: num("threads")? as usize,
        f32_ms: num("f32_ms")?,
        bf16_ms: num("bf16_ms")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VM that slows down to half speed right after the third step: the steps take 1.2× their
    /// floor before and after; the step-by-step ratio says so, the ratio of the two medians
    /// (three fast steps, three slow GEMMs) says 0.6×.
    #[test]
    fn paired_floor_ratio_cancels_drift_within_a_run() {
        let (times, gflops) = ([0.012, 0.012, 0.012, 0.024, 0.024], [100.0, 100.0, 50.0, 50.0, 50.0]);
        assert!((paired_floor_ratio(&times, &gflops, 1e9) - 1.2).abs() < 1e-12);
        let t = StepTiming {
            median: median(times.to_vec()),
            min: 0.012,
            max: 0.024,
            flops: 1e9,
            gemm_gflops: Some(median(gflops.to_vec())),
            paired_ratio: None,
        };
        assert!((t.floor_ratio().unwrap() - 0.6).abs() < 1e-12);
    }

    #[test]
    fn the_pytorch_comparison_is_skipped_with_a_reason_not_an_error() {
        let none = torch_step("/nonexistent/python3", 1, 0, 1, 8, 1, "cpu").unwrap();
        assert!(matches!(&none, TorchStep::Absent(why) if why.contains("cannot run")), "{none:?}");
        // `python3`: absent, or without torch (the usual CI machine), or (for cuda) without a
        // GPU, each said so; or with torch, timing both precisions.
        for device in ["cpu", "cuda"] {
            match torch_step("python3", 1, 0, 1, 8, 1, device) {
                Ok(TorchStep::Absent(why)) => assert!(
                    why.contains("no torch")
                        || why.contains("cannot run")
                        || (device == "cuda" && why.contains("no CUDA GPU")),
                    "{why}"
                ),
                Ok(TorchStep::Timed { f32_ms, bf16_ms, threads, .. }) => {
                    assert!(f32_ms > 0.0 && bf16_ms > 0.0 && (device == "cuda" || threads == 1))
                }
                Err(e) => panic!("{device}: {e}"),
            }
        }
    }

    /// PyTorch is timed on the CPU and on a real GPU, never beside the emulator.
    #[test]
    fn pytorch_runs_where_our_step_does_except_on_the_emulator() {
        use crate::device::DeviceKind;
        assert_eq!(torch_device(DeviceKind::Cpu), Some("cpu"));
        assert_eq!(torch_device(DeviceKind::Cuda), Some("cuda"));
        assert_eq!(torch_device(DeviceKind::CudaEmu), None);
    }

    /// The driver's names find their datasheet rows; a PCIe H100 is not taken for an SXM one.
    #[test]
    fn gpus_are_found_by_the_drivers_name() {
        assert_eq!(gpu_peak("cuda:0 (NVIDIA H200, sm_90)").map(|p| p.bandwidth), Some(4.8e12));
        assert_eq!(gpu_peak("NVIDIA H100 PCIe").map(|p| p.bf16), Some(756e12));
        assert_eq!(gpu_peak("NVIDIA H100 80GB HBM3").map(|p| p.bandwidth), Some(3.35e12));
        assert_eq!(gpu_peak("Tesla T4"), None);
    }
}
