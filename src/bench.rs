//! Workloads and measurements shared by the criterion benches (`benches/`) and the
//! `pipetransformer bench-step` report: the MiniLM-shaped encoder, synthetic batches, FLOP
//! counts and the machine's large-GEMM rate in each precision (the roofline the step is
//! compared against).

use crate::device::{Device, Precision};
use crate::model::{BertConfig, HostBatch, Model, ModelConfig, Pooling};
use crate::ops::gemm_bf16::matmul_bf16;
use crate::ops::matmul::{MatRef, matmul};
use crate::rng::Rng;
use std::time::Instant;

/// Whether a bench binary runs under `cargo bench`, which passes `--bench`: `cargo test
/// --all-targets` (the test suite) runs bench binaries too, without it, where a report that
/// takes seconds (or times loopback rings on a CI machine) only needs to build.
pub fn under_cargo_bench() -> bool {
    std::env::args().any(|a| a == "--bench")
}

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

/// FLOPs of one training step (forward + backward) of `batch` samples at hidden-state length
/// `seq`, from the units' analytic costs.
pub fn step_flops<D: Device>(model: &Model<D>, dev: &D, batch: usize, seq: usize) -> f64 {
    model.costs(dev, seq).iter().map(|c| c.forward_flops + c.backward_flops).sum::<f64>() * batch as f64
}

/// A pool of `threads` threads and two random `n×n` matrices: the GEMM that measures this
/// machine's practical peak for this engine in a precision ([`GemmProbe::gflops`]).
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

    /// The rate of one GEMM in GFLOP/s: through [`matmul`] in f32, through [`matmul_bf16`]
    /// (bf16 operands, f32 accumulation: the kernel a cpu device's bf16 products run) in
    /// bf16. The bf16 rate counts its operands' rounding and packing, as a step's products
    /// pay them.
    pub fn gflops(&mut self, precision: Precision) -> f64 {
        let n = self.n;
        let (a, b, c) = (MatRef::rows(&self.a, n), MatRef::rows(&self.b, n), &mut self.c);
        let t = Instant::now();
        self.pool.install(|| match precision {
            Precision::F32 => matmul(c, n, a, b, n, n, n, false),
            Precision::Bf16 => {
                matmul_bf16(c, n, a, b, n, n, n, false);
            }
        });
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
    /// The precision of the step's products, and of the GEMMs its floor was timed in.
    pub precision: Precision,
    /// The median rate of the GEMMs timed one after each step, in the step's precision, when
    /// asked for: the floor measured in the same seconds as the steps, so a VM whose speed
    /// drifts between runs moves both alike.
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

/// The middle value, or the mean of the two middle ones (as Python's `statistics.median`,
/// which the PyTorch side of `bench-step` uses).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n.is_multiple_of(2) { (v[n / 2 - 1] + v[n / 2]) / 2.0 } else { v[n / 2] }
}

/// Each step's time against its FLOPs at the rate of the GEMM timed right after it, the
/// median of those: a VM that drifts within a run moves a step and its own GEMM together, so
/// the pairs cancel the drift that a ratio of the two medians keeps.
pub fn paired_floor_ratio(times: &[f64], gflops: &[f64], flops: f64) -> f64 {
    median(times.iter().zip(gflops).map(|(t, g)| t / (flops / g / 1e9)).collect())
}

/// Times `steps` training steps (forward, backward, clipping at 1.0, AdamW) of the
/// MiniLM-shaped encoder on `dev`, after `warmup` untimed ones, on one random batch of
/// `batch` × `seq` tokens; with a `floor` probe, one GEMM after each timed step, in the
/// precision of `dev`'s products.
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
    let host = HostBatch::random(&config, batch, seq, 1);
    let batch_dev = Batch::upload(dev, model.spec(), &host, true, 2)?;
    let mut optimizer = Optimizer::new(OptimizerConfig::adamw())?;
    let flops = step_flops(&model, dev, batch, seq);
    let precision = dev.precision();
    for _ in 0..warmup {
        train_step(dev, &mut model, &mut optimizer, &batch_dev, 1e-4, Some(1.0))?;
    }
    dev.synchronize()?; // (a GPU's queued warm-up is not the first timed step's)
    crate::debug::take_op_times(); // the warm-up's
    let (mut times, mut rates) = (Vec::new(), Vec::new()); // (not reserved: `--steps` may be any number)
    for _ in 0..steps.max(1) {
        let t = Instant::now();
        train_step(dev, &mut model, &mut optimizer, &batch_dev, 1e-4, Some(1.0))?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
        if let Some(probe) = floor.as_deref_mut() {
            rates.push(probe.gflops(precision));
        }
    }
    crate::debug::print_op_times(&format!("{} timed steps", times.len()));
    let (min, max) = times.iter().fold((f64::INFINITY, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
    let paired_ratio = (!rates.is_empty()).then(|| paired_floor_ratio(&times, &rates, flops));
    let gemm_gflops = (!rates.is_empty()).then(|| median(rates));
    Ok(StepTiming { median: median(times), min, max, flops, precision, gemm_gflops, paired_ratio })
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

/// Datasheet peaks of the GPUs this project targets: the name's fragment as the driver reports
/// it, dense bf16 and f32 TFLOP/s, memory TB/s (NVIDIA's datasheets; bf16 is half the sparse
/// figure they lead with). A bare `H100` or `H200` is the SXM part.
const GPU_PEAKS: [(&str, f64, f64, f64); 5] = [
    ("H200", 989.4, 66.9, 4.8),
    ("H200 NVL", 835.5, 60.0, 4.8),
    ("H100", 989.4, 66.9, 3.35),
    ("H100 NVL", 835.5, 60.0, 3.9),
    ("H100 PCIe", 756.0, 51.2, 2.0),
];

/// The peaks of the GPU the driver calls `name` (e.g. `NVIDIA H200`), if it is one of ours: the
/// row whose fragment is the longest run of whole words in the name, so an `H100 NVL` is not
/// taken for an SXM `H100`, nor a `GH200` (another memory) for an `H200`.
pub fn gpu_peak(name: &str) -> Option<GpuPeak> {
    let words: Vec<&str> = name.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()).collect();
    let named = |fragment: &str| {
        let fragment: Vec<&str> = fragment.split(' ').collect();
        words.windows(fragment.len()).any(|w| w == fragment)
    };
    GPU_PEAKS.iter().filter(|(n, ..)| named(n)).max_by_key(|(n, ..)| n.len()).map(|&(_, bf16, f32, bw)| GpuPeak {
        bf16: bf16 * 1e12,
        f32: f32 * 1e12,
        bandwidth: bw * 1e12,
    })
}

/// What `bench-step` times: `steps` steps after `warmup` untimed ones, of `batch` sequences of
/// `seq` tokens, and PyTorch's steps with `python` (`none`: not).
#[derive(Clone, Debug, PartialEq)]
pub struct StepBench {
    /// Timed steps.
    pub steps: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The Python whose PyTorch times the same step, or `none`.
    pub python: String,
    /// Threads for PyTorch where our device has no pool of its own (a GPU's host side).
    pub threads: usize,
}

/// `bench-step`'s report, printed as a markdown table: our steps, the GEMM floor of each
/// precision on cpu, PyTorch's steps against the floor of theirs, and on a GPU the MFU against
/// its datasheet peak.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// The shape timed.
    pub bench: StepBench,
    /// Our steps, each with its row's name; each precision's floor is the GEMM rate of its
    /// first row.
    pub rows: Vec<(String, StepTiming)>,
    /// Threads of the cpu pool that timed the steps and the floor (none on a GPU).
    pub floor_threads: Option<usize>,
    /// PyTorch's steps and the device they ran on (`cpu`, `cuda`), when asked for.
    pub torch: Option<(TorchStep, &'static str)>,
    /// On a GPU, per row: the precision, its model FLOPs per second as a fraction of the
    /// datasheet peak, and that peak (FLOP/s).
    pub mfu: Vec<(Precision, f64, f64)>,
}

/// Times the MiniLM-shaped step on `first` in `precision`, then, when `second` is given, on the
/// device it opens in its precision (after `first` is dropped), with the GEMM floor on a cpu
/// pool's threads and PyTorch's step on the same kind of device (`kind`; never beside the
/// emulator). PyTorch failing is in the report ([`TorchStep::Failed`]), so our timings stand.
pub fn bench_step(
    first: crate::device::AnyDevice,
    precision: Precision,
    second: Option<(Precision, impl FnOnce() -> crate::Result<crate::device::AnyDevice>)>,
    kind: crate::device::DeviceKind,
    bench: StepBench,
) -> crate::Result<StepReport> {
    use crate::device::AnyDevice;
    let pool_threads = match &first {
        AnyDevice::Cpu(d) => d.threads(),
        AnyDevice::Gpu(_) => None,
    };
    let mut report = StepReport { bench, rows: Vec::new(), floor_threads: pool_threads, torch: None, mfu: Vec::new() };
    // The roofline of the CPU backend is its own large GEMM on the same threads, in the
    // step's precision, timed after each step so that the floor and the step see the same
    // moments of a drifting VM.
    let mut probe = pool_threads.map(|t| GemmProbe::new(t, 2048)).transpose()?;
    let b = &report.bench;
    let mut time = |dev: AnyDevice, precision: Precision| -> crate::Result<()> {
        let (name, t) = match &dev {
            AnyDevice::Cpu(d) => (d.name(), time_step(d, b.steps, b.warmup, b.batch, b.seq, probe.as_mut())?),
            AnyDevice::Gpu(d) => (d.name(), time_step(d, b.steps, b.warmup, b.batch, b.seq, None)?),
        };
        let peak = matches!(dev, AnyDevice::Gpu(_)).then(|| gpu_peak(&name)).flatten();
        if let Some(peak) = peak {
            let peak = if precision == Precision::Bf16 { peak.bf16 } else { peak.f32 };
            report.mfu.push((precision, t.flops / t.median / peak, peak));
        }
        report.rows.push((format!("ours, {} ({name})", format!("{precision:?}").to_lowercase()), t));
        Ok(())
    };
    time(first, precision)?;
    if let Some((precision, open)) = second {
        time(open()?, precision)?;
    }
    if let (Some(device), false) = (torch_device(kind), report.bench.python == "none") {
        let b = &report.bench;
        let threads = pool_threads.unwrap_or(b.threads);
        let step =
            torch_step(&b.python, b.steps, b.warmup, b.batch, b.seq, threads, device).unwrap_or_else(|e| match e {
                crate::Error::Data { message, .. } => TorchStep::Failed(message),
                e => TorchStep::Failed(e.to_string()),
            });
        report.torch = Some((step, device));
    }
    Ok(report)
}

impl std::fmt::Display for StepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = &self.bench;
        let Some(flops) = self.rows.first().map(|(_, t)| t.flops) else { return Ok(()) };
        // Each precision's floor: the GEMM rate timed with its first row's steps.
        let floor = |precision: Precision| {
            self.rows.iter().find(|(_, t)| t.precision == precision).and_then(|(_, t)| t.gemm_gflops)
        };
        writeln!(
            f,
            "MiniLM-shaped training step: 6 layers, hidden 384, 12 heads, MLP 1536, batch {} × seq {}, dropout 0.1, \
             clipping at 1.0, AdamW; {flops:.4e} FLOP; median of {} after {} warm-up{}",
            b.batch,
            b.seq,
            b.steps,
            b.warmup,
            match self.rows[0].1.gemm_gflops {
                Some(_) =>
                    "; the GEMM floor: these FLOPs at the median rate of a 2048³ GEMM in the step's precision (bf16: \
                     bf16 operands, f32 accumulation) timed after each step; step by step: the median of each step \
                     against the GEMM timed right after it",
                None => "",
            }
        )?;
        writeln!(
            f,
            "| step | ms | min–max ms | GFLOP/s | / GEMM floor (GEMM GFLOP/s in its steps) | / GEMM floor, step by step |"
        )?;
        writeln!(f, "|---|---|---|---|---|---|")?;
        for (name, t) in &self.rows {
            let ratio = match (t.floor_ratio(), t.gemm_gflops) {
                (Some(r), Some(g)) => format!("{r:.2}× ({g:.0})"),
                _ => String::new(),
            };
            let paired = t.paired_ratio.map_or_else(String::new, |p| format!("{p:.2}×"));
            writeln!(
                f,
                "| {name} | {:.1} | {:.1}–{:.1} | {:.1} | {ratio} | {paired} |",
                t.median * 1e3,
                t.min * 1e3,
                t.max * 1e3,
                flops / t.median / 1e9
            )?;
        }
        let floor_ms = |precision| floor(precision).map(|g| flops / g / 1e6);
        for precision in [Precision::F32, Precision::Bf16] {
            if let (Some(gemm), Some(threads)) = (floor(precision), self.floor_threads) {
                // (Named as our rows name the precision.)
                let (name, ms) = (format!("{precision:?}").to_lowercase(), flops / gemm / 1e6);
                writeln!(
                    f,
                    "| GEMM floor: these FLOPs at the {name} 2048³ GEMM rate ({threads} threads, timed with the {name} \
                     steps) | {ms:.1} | | {gemm:.1} | 1.00× | |"
                )?;
            }
        }
        match &self.torch {
            Some((TorchStep::Timed { version, threads, f32_ms, bf16_ms }, device)) => {
                let on = if *device == "cpu" { format!("{threads} threads") } else { device.to_string() };
                // Each against the floor of its precision, where this run timed one.
                for (what, ms, precision) in
                    [("eager, f32", f32_ms, Precision::F32), ("bf16 autocast", bf16_ms, Precision::Bf16)]
                {
                    let ratio = floor_ms(precision).map_or_else(String::new, |floor| format!("{:.2}×", ms / floor));
                    writeln!(
                        f,
                        "| PyTorch {version} {what} ({on}) | {ms:.1} | | {:.1} | {ratio} | |",
                        flops / ms / 1e6
                    )?;
                }
            }
            Some((TorchStep::Absent(why), _)) => writeln!(f, "PyTorch comparison skipped: {why}")?,
            Some((TorchStep::Failed(why), _)) => writeln!(f, "PyTorch comparison failed: {why}")?,
            None => {}
        }
        // After the table, which a line inside it would end.
        for (precision, fraction, peak) in &self.mfu {
            writeln!(f, "MFU, {precision:?}: {:.1} % of the datasheet's {:.1} TFLOP/s", 100.0 * fraction, peak / 1e12)?;
        }
        Ok(())
    }
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
    /// The script ran and failed (what [`torch_step`] returned as an error).
    Failed(String),
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
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said = if stderr.trim().is_empty() { String::new() } else { format!(": {}", stderr.trim()) };
        return Err(failed(format!("`{python}` exited with {}{said}", out.status)));
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
            precision: Precision::F32,
            gemm_gflops: Some(median(gflops.to_vec())),
            paired_ratio: None,
        };
        assert!((t.floor_ratio().unwrap() - 0.6).abs() < 1e-12);
    }

    /// The median of an even count is the mean of its two middle values, as the PyTorch side's
    /// `statistics.median` takes it: the two columns of `bench-step` are read alike.
    #[test]
    fn an_even_count_has_the_mean_of_its_middle_two_as_median() {
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
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
                Ok(TorchStep::Failed(why)) => panic!("{device}: torch_step returns failures as errors: {why}"),
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

    /// The table: our rows with their floor ratios, a floor's row per precision from its
    /// first row's GEMM rate, PyTorch's rows against the floor of theirs, and MFU lines only
    /// after the table.
    #[test]
    fn the_step_report_sets_every_row_against_the_floor_of_its_precision() {
        let timing = |median: f64, precision: Precision, gemm: Option<f64>| StepTiming {
            median,
            min: median * 0.9,
            max: median * 1.1,
            flops: 1e11,
            precision,
            gemm_gflops: gemm,
            paired_ratio: gemm.map(|_| 1.5),
        };
        let bench = StepBench { steps: 4, warmup: 1, batch: 16, seq: 128, python: "python3".into(), threads: 2 };
        let mut report = StepReport {
            bench,
            // 1e11 FLOP at 100 GFLOP/s: a floor of 1 s in f32; at 250 GFLOP/s, 0.4 s in bf16.
            rows: vec![
                ("ours, f32 (cpu:0)".into(), timing(1.2, Precision::F32, Some(100.0))),
                ("ours, bf16 (cpu:0)".into(), timing(0.8, Precision::Bf16, Some(250.0))),
            ],
            floor_threads: Some(2),
            torch: Some((
                TorchStep::Timed { version: "2.15.0".into(), threads: 2, f32_ms: 1500.0, bf16_ms: 900.0 },
                "cpu",
            )),
            mfu: Vec::new(),
        };
        let text = report.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains("batch 16 × seq 128") && lines[0].contains("median of 4 after 1 warm-up"), "{text}");
        assert!(lines[0].contains("the GEMM floor"), "{text}");
        assert_eq!(lines[3], "| ours, f32 (cpu:0) | 1200.0 | 1080.0–1320.0 | 83.3 | 1.20× (100) | 1.50× |");
        assert_eq!(lines[4], "| ours, bf16 (cpu:0) | 800.0 | 720.0–880.0 | 125.0 | 2.00× (250) | 1.50× |");
        assert!(
            lines[5].starts_with("| GEMM floor: these FLOPs at the f32 ")
                && lines[5].ends_with("| 1000.0 | | 100.0 | 1.00× | |"),
            "{text}"
        );
        assert!(
            lines[6].starts_with("| GEMM floor: these FLOPs at the bf16 ")
                && lines[6].ends_with("| 400.0 | | 250.0 | 1.00× | |"),
            "{text}"
        );
        assert_eq!(lines[7], "| PyTorch 2.15.0 eager, f32 (2 threads) | 1500.0 | | 66.7 | 1.50× | |");
        assert_eq!(lines[8], "| PyTorch 2.15.0 bf16 autocast (2 threads) | 900.0 | | 111.1 | 2.25× | |");
        assert_eq!(lines.len(), 9);
        // f32 alone: no bf16 floor, and PyTorch's bf16 row without a ratio.
        report.rows.truncate(1);
        let text = report.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[4].starts_with("| GEMM floor: these FLOPs at the f32 "), "{text}");
        assert_eq!(lines[6], "| PyTorch 2.15.0 bf16 autocast (2 threads) | 900.0 | | 111.1 |  | |");
        assert_eq!(lines.len(), 7);
        // On a GPU: no floor, PyTorch on cuda, the MFU after the table.
        report.rows = vec![("ours, bf16 (cuda:0)".into(), timing(0.01, Precision::Bf16, None))];
        report.floor_threads = None;
        report.torch = Some((TorchStep::Absent("no torch".into()), "cuda"));
        report.mfu = vec![(Precision::Bf16, 0.01, 989.4e12)];
        let text = report.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert!(!lines[0].contains("GEMM floor"), "{text}");
        assert_eq!(lines[3], "| ours, bf16 (cuda:0) | 10.0 | 9.0–11.0 | 10000.0 |  |  |");
        assert_eq!(
            lines[4..],
            ["PyTorch comparison skipped: no torch", "MFU, Bf16: 1.0 % of the datasheet's 989.4 TFLOP/s"]
        );
    }

    /// A PyTorch that fails is in the report beside our rows (f32, then the second device's
    /// bf16), which it does not take down with it; each row's floor is timed on our pool's
    /// threads in the row's precision.
    #[test]
    fn a_failing_pytorch_leaves_our_timings_in_the_report() {
        use crate::device::{AnyDevice, CpuDevice, DeviceKind};
        let first = AnyDevice::Cpu(CpuDevice::new(0, 1).unwrap());
        let second = Some((Precision::Bf16, || AnyDevice::open(DeviceKind::Cpu, 0, 1, Precision::Bf16)));
        let bench = StepBench { steps: 1, warmup: 0, batch: 1, seq: 8, python: "/bin/false".into(), threads: 2 };
        let report = bench_step(first, Precision::F32, second, DeviceKind::Cpu, bench).unwrap();
        let names: Vec<&str> = report.rows.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            names.len() == 2 && names[0].starts_with("ours, f32 (cpu:0") && names[1].starts_with("ours, bf16 (cpu:0")
        );
        assert!(report.rows.iter().all(|(_, t)| t.median > 0.0 && t.gemm_gflops.is_some()), "{report}");
        let precisions: Vec<Precision> = report.rows.iter().map(|(_, t)| t.precision).collect();
        assert_eq!(precisions, [Precision::F32, Precision::Bf16]);
        let floors = report.to_string().lines().filter(|l| l.starts_with("| GEMM floor")).count();
        assert_eq!(floors, 2, "{report}");
        assert_eq!(report.floor_threads, Some(1));
        assert!(
            matches!(&report.torch, Some((TorchStep::Failed(why), "cpu")) if why.contains("/bin/false")),
            "{report}"
        );
        assert!(report.to_string().lines().any(|l| l.starts_with("PyTorch comparison failed: ")), "{report}");
    }

    /// The probe runs the product of the precision asked for: bf16 operands round, so its
    /// result moves off the f32 one, by no more than bf16's rounding of 64-term sums.
    #[test]
    fn the_gemm_probe_multiplies_in_the_precision_asked_for() {
        let mut probe = GemmProbe::new(1, 64).unwrap();
        assert!(probe.gflops(Precision::F32) > 0.0);
        let f32_product = probe.c.clone();
        assert!(probe.gflops(Precision::Bf16) > 0.0);
        let off = f32_product.iter().zip(&probe.c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(off > 0.0 && off < 0.5, "bf16 against f32: {off}");
        probe.gflops(Precision::F32);
        assert_eq!(probe.c, f32_product, "f32 again: the same bits");
    }

    /// The driver's names find their datasheet rows; a PCIe H100 is not taken for an SXM one.
    #[test]
    fn gpus_are_found_by_the_drivers_name() {
        assert_eq!(gpu_peak("cuda:0 (NVIDIA H200, sm_90)").map(|p| p.bandwidth), Some(4.8e12));
        assert_eq!(gpu_peak("NVIDIA H100 PCIe").map(|p| p.bf16), Some(756e12));
        assert_eq!(gpu_peak("NVIDIA H100 80GB HBM3").map(|p| p.bandwidth), Some(3.35e12));
        assert_eq!(gpu_peak("NVIDIA H100 NVL").map(|p| (p.f32, p.bandwidth)), Some((60e12, 3.9e12)));
        assert_eq!(gpu_peak("NVIDIA H200 NVL").map(|p| (p.bf16, p.bandwidth)), Some((835.5e12, 4.8e12)));
        assert_eq!(gpu_peak("Tesla T4"), None);
        assert_eq!(gpu_peak("NVIDIA GH200 480GB"), None, "not an H200");
    }
}
