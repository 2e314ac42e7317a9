//! The `cuda` backend's kernels on a real GPU, at the shapes of a MiniLM training step (batch 16,
//! sequence 128, hidden 384, 12 heads, MLP 1536): time per launch, achieved TFLOP/s and GB/s,
//! the roofline floor (max of FLOPs at peak compute and bytes at peak bandwidth) and how far
//! above it we are; for the linear layer, the ratio to cuBLAS on the same shapes and stream
//! (sgemm in f32 mode; in bf16 mode a bf16 `cublasGemmEx` with f32 accumulation).
//!
//! Without a GPU it says so and exits: the emulator's timings mean nothing.

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use pipetransformer::bench::{GpuPeak, gpu_peak};
use pipetransformer::device::cuda::CudaRuntime;
use pipetransformer::device::{Device, GpuDevice, Precision};
use pipetransformer::ops::attention::AttentionDims;
use pipetransformer::ops::gelu::Activation;
use pipetransformer::ops::optim::AdamWStep;
use std::sync::Arc;
use std::time::Instant;

/// Launches of `f` queued back to back between two synchronisations in one sample: the host's
/// launch and synchronisation latency is spread over them, where a sync after every
/// launch added it to each kernel's time (and drew a 10 µs kernel's ratio to cuBLAS, timed the
/// same way, towards 1).
const LAUNCHES_PER_SAMPLE: usize = 10;

/// Median seconds of one run of `f` over `iters` samples of [`LAUNCHES_PER_SAMPLE`] runs each
/// (after 3 warm-up runs).
fn time(dev: &GpuDevice, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    dev.synchronize().expect("sync");
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let s = Instant::now();
            for _ in 0..LAUNCHES_PER_SAMPLE {
                f();
            }
            dev.synchronize().expect("sync");
            s.elapsed().as_secs_f64() / LAUNCHES_PER_SAMPLE as f64
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[iters / 2]
}

fn row(peak: &Option<GpuPeak>, precision: Precision, name: &str, secs: f64, flops: f64, bytes: f64, extra: &str) {
    let floor = peak.as_ref().map(|p| {
        let compute = if precision == Precision::Bf16 && flops > 0.0 { p.bf16 } else { p.f32 };
        (flops / compute).max(bytes / p.bandwidth)
    });
    println!(
        "| {name} | {:.1} | {:.2} | {:.0} | {} | {extra} |",
        secs * 1e6,
        flops / secs / 1e12,
        bytes / secs / 1e9,
        floor.map_or("-".into(), |f| format!("{:.0}%", 100.0 * f / secs)),
    );
}

fn bench(rt: Arc<CudaRuntime>, precision: Precision, peak: &Option<GpuPeak>) {
    let dev = GpuDevice::new(rt.clone(), precision, false);
    let (b, t, c, h, ff) = (16usize, 128usize, 384usize, 12usize, 1536usize);
    let rows = b * t;
    let act = dev.act().size() as f64;
    let rand = |n: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1).collect() };
    let a = |n: usize| {
        let mut buf = dev.alloc(n).expect("alloc");
        dev.copy(&mut buf, &dev.upload(&rand(n)).expect("upload")).expect("copy");
        buf
    };
    println!("\n### {}\n", dev.name());
    println!("| kernel | µs | TFLOP/s | GB/s | roofline floor / time | note |\n|---|---|---|---|---|---|");
    let blas = CudaBlas::new(rt.stream().clone()).expect("cuBLAS");
    for (label, n_in, n_out) in [("qkv", c, 3 * c), ("attn out", c, c), ("mlp up", c, ff), ("mlp down", ff, c)] {
        let (x, w, bias) =
            (a(rows * n_in), dev.upload(&rand(n_out * n_in)).expect("w"), dev.upload(&rand(n_out)).expect("b"));
        let mut y = dev.alloc(rows * n_out).expect("y");
        let secs =
            time(&dev, 20, || dev.linear_forward(&mut y, &x, &w, Some(&bias), rows, n_in, n_out).expect("linear"));
        let flops = 2.0 * (rows * n_in * n_out) as f64;
        let bytes = (rows * n_in) as f64 * act + (n_in * n_out) as f64 * 4.0 + (rows * n_out) as f64 * act;
        // cuBLAS on the same problem: sgemm in f32 mode; in bf16 mode a bf16 GEMM with f32
        // accumulation on a bf16 copy of the weight (cuBLAS has no bf16×f32 product).
        let mut w_act = dev.alloc(n_out * n_in).expect("w copy");
        dev.copy(&mut w_act, &w).expect("cast w");
        let (wf, xf, yf) = (if precision == Precision::F32 { w.ptr() } else { w_act.ptr() }, x.ptr(), y.ptr());
        let (op_t, op_n) = (blas_sys::cublasOperation_t::CUBLAS_OP_T, blas_sys::cublasOperation_t::CUBLAS_OP_N);
        // Row-major y[rows, out] = x[rows, in]·Wᵀ is column-major yᵀ = W·xᵀ.
        let (m, n, kk) = (n_out as i32, rows as i32, n_in as i32);
        let cublas = time(&dev, 20, || {
            let (alpha, beta) = (1.0f32, 0.0f32);
            let status = match precision {
                Precision::F32 => unsafe {
                    blas::sgemm(
                        *blas.handle(),
                        op_t,
                        op_n,
                        m,
                        n,
                        kk,
                        &alpha,
                        wf as *const f32,
                        kk,
                        xf as *const f32,
                        kk,
                        &beta,
                        yf as *mut f32,
                        m,
                    )
                },
                Precision::Bf16 => unsafe {
                    let bf16 = blas_sys::cudaDataType::CUDA_R_16BF;
                    blas::gemm_ex(
                        *blas.handle(),
                        op_t,
                        op_n,
                        m,
                        n,
                        kk,
                        &alpha as *const f32 as *const _,
                        wf as *const _,
                        bf16,
                        kk,
                        xf as *const _,
                        bf16,
                        kk,
                        &beta as *const f32 as *const _,
                        yf as *mut _,
                        bf16,
                        m,
                        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                    )
                },
            };
            status.expect("cuBLAS GEMM")
        });
        let name = if precision == Precision::F32 { "sgemm" } else { "gemm_ex bf16" };
        let note = format!("cuBLAS {name} {:.1} µs: ours/cuBLAS = {:.2}", cublas * 1e6, secs / cublas);
        row(peak, precision, &format!("linear_forward {label} {rows}×{n_in}→{n_out}"), secs, flops, bytes, &note);
        let (mut dx, mut dw, mut db) =
            (dev.alloc(rows * n_in).expect("dx"), dev.zeros(n_out * n_in).expect("dw"), dev.zeros(n_out).expect("db"));
        let dy = a(rows * n_out);
        let secs = time(&dev, 20, || {
            dev.linear_backward(Some(&mut dx), Some(&mut dw), Some(&mut db), &dy, &x, &w, rows, n_in, n_out)
                .expect("linear bwd")
        });
        row(peak, precision, &format!("linear_backward {label}"), secs, 2.0 * flops, 2.0 * bytes + bytes, "");
    }
    let d = AttentionDims {
        batch: b,
        q_len: t,
        kv_len: t,
        heads: h,
        head_dim: c / h,
        causal: false,
        dropout: 0.1,
        dropout_seed: 1,
        dropout_offset: 0,
        mask_seq: t,
    };
    let (q, k, v) = (a(rows * c), a(rows * c), a(rows * c));
    let mut out = dev.alloc(rows * c).expect("out");
    let mut lse = dev.alloc_stats(dev.attention_saved_len(&d)).expect("lse");
    let flops = 4.0 * (b * h * t * t * (c / h)) as f64;
    let bytes = 4.0 * (rows * c) as f64 * act;
    let secs = time(&dev, 20, || dev.attention_forward(&mut out, &mut lse, &q, &k, &v, None, &d).expect("attn"));
    row(peak, precision, "attention_forward", secs, flops, bytes, "");
    let dout = a(rows * c);
    let (mut dq, mut dk, mut dv) =
        (dev.alloc(rows * c).expect("dq"), dev.alloc(rows * c).expect("dk"), dev.alloc(rows * c).expect("dv"));
    let secs = time(&dev, 20, || {
        dev.attention_backward(&mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, &out, &lse, None, &d).expect("attn bwd")
    });
    row(peak, precision, "attention_backward", secs, 2.5 * flops, 2.0 * bytes, "");
    let x = a(rows * c);
    let (gamma, beta) = (dev.upload(&rand(c)).expect("g"), dev.upload(&rand(c)).expect("b"));
    let mut y = dev.alloc(rows * c).expect("y");
    let (mut mean, mut rstd) = (dev.alloc_stats(rows).expect("m"), dev.alloc_stats(rows).expect("r"));
    let secs = time(&dev, 50, || {
        dev.layernorm_forward(&mut y, &mut mean, &mut rstd, &x, &gamma, &beta, rows, c, 1e-12).expect("ln")
    });
    row(peak, precision, "layernorm_forward", secs, 0.0, 2.0 * (rows * c) as f64 * act, "");
    let (mut dx, mut dg, mut dbeta) =
        (dev.alloc(rows * c).expect("dx"), dev.zeros(c).expect("dg"), dev.zeros(c).expect("db"));
    let secs = time(&dev, 50, || {
        dev.layernorm_backward(&mut dx, &mut dg, &mut dbeta, &y, &x, &gamma, &mean, &rstd, rows, c).expect("ln bwd")
    });
    row(peak, precision, "layernorm_backward", secs, 0.0, 3.0 * (rows * c) as f64 * act, "");
    let h1 = a(rows * ff);
    let mut g = dev.alloc(rows * ff).expect("g");
    let secs = time(&dev, 50, || dev.gelu_forward(&mut g, &h1, Activation::GeluErf).expect("gelu"));
    row(peak, precision, "gelu_forward", secs, 0.0, 2.0 * (rows * ff) as f64 * act, "");
    let n = 22_700_000usize; // MiniLM's parameters
    let (mut p, grad, mut m, mut vv) = (
        dev.upload(&rand(n)).expect("p"),
        dev.upload(&rand(n)).expect("g"),
        dev.zeros(n).expect("m"),
        dev.zeros(n).expect("v"),
    );
    let hp = AdamWStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 1, grad_scale: 1.0 };
    let secs = time(&dev, 20, || dev.adamw_update(&mut p, &grad, &mut m, &mut vv, &hp).expect("adamw"));
    row(peak, precision, "adamw_update (22.7M params)", secs, 0.0, 7.0 * n as f64 * 4.0, "");
}

fn main() {
    if !pipetransformer::bench::under_cargo_bench() {
        println!("benchmarks run under `cargo bench`");
        return;
    }
    if !pipetransformer::device::cuda::available() {
        println!("kernels bench: no CUDA GPU on this machine; skipped (the emulator's timings mean nothing)");
        return;
    }
    let rt = Arc::new(CudaRuntime::new(0).expect("cuda:0"));
    let name = rt.name_string();
    let peak = gpu_peak(&name);
    println!("# kernels on {name}");
    for precision in [Precision::F32, Precision::Bf16] {
        bench(rt.clone(), precision, &peak);
    }
}
