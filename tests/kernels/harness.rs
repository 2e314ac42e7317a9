//! What every kernel test shares: the devices under test, uploads in the right element type,
//! and the comparison with written tolerances.

#![allow(dead_code)]

use pipetransformer::device::{CpuDevice, Device, GpuDevice, Precision};

/// ‖got−want‖/‖want‖ bound in f32 mode.
pub const F32_TOL: f64 = 1e-5;
/// The same bound in bf16 mode.
pub const BF16_TOL: f64 = 1e-2;

/// Block- and thread-order seeds every kernel test runs under (a missing barrier, or a block
/// reading what another writes, fails one of them), each with the OS threads that share a
/// launch's blocks (two: blocks of one launch run at once, as on a GPU).
pub const SEEDS: [(u64, usize); 2] = [(1, 1), (2, 2)];

/// The reference device.
pub fn cpu() -> CpuDevice<f32> {
    CpuDevice::new(0, 1).expect("cpu device")
}

/// The devices under test in `precision`: one emulated device per seed, or the GPU when
/// `PT_TEST_DEVICE=cuda`.
pub fn devices(precision: Precision) -> Vec<GpuDevice> {
    match std::env::var("PT_TEST_DEVICE").as_deref() {
        Ok("cuda") => vec![pipetransformer::device::cuda::device(0, precision).expect("cuda device")],
        _ => {
            let emulated = |seed, threads| {
                let rt = pipetransformer::device::emu::EmuRuntime::new(0, seed, threads).expect("emu device");
                GpuDevice::new(std::sync::Arc::new(rt), precision, true)
            };
            SEEDS.iter().map(|&(seed, threads)| emulated(seed, threads)).collect()
        }
    }
}

/// Tolerance for `precision`.
pub fn tol(precision: Precision) -> f64 {
    match precision {
        Precision::F32 => F32_TOL,
        Precision::Bf16 => BF16_TOL,
    }
}

/// An activation buffer (the device's activation type) holding `data`.
pub fn act<D: Device>(dev: &D, data: &[f32]) -> D::Buf {
    let staged = dev.upload(data).expect("upload");
    let mut buf = dev.alloc(data.len()).expect("alloc");
    dev.copy(&mut buf, &staged).expect("copy");
    buf
}

/// A parameter-like buffer (f32 on every device) holding `data`.
pub fn param<D: Device>(dev: &D, data: &[f32]) -> D::Buf {
    dev.upload(data).expect("upload")
}

/// `n` values uniform in `[-scale, scale)` from a fixed seed.
pub fn rand(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = pipetransformer::rng::Rng::new(seed);
    (0..n).map(|_| (rng.uniform() as f32 * 2.0 - 1.0) * scale).collect()
}

/// ‖got−want‖/‖want‖ (‖got‖ when `want` is zero).
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    if den == 0.0 { num.sqrt() } else { (num / den).sqrt() }
}

/// Asserts `got` is NaN-free, as long as `want`, and within `tol` of it.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|x| x.is_nan()) {
        panic!("{what}: element {i} is NaN (never written, or a NaN computed)");
    }
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

/// Downloads `buf` from `dev` as f32.
pub fn host<D: Device>(dev: &D, buf: &D::Buf) -> Vec<f32> {
    dev.download(buf).expect("download")
}
