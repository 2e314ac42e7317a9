//! Every kernel against the `cpu` backend (the numerical reference), on awkward shapes, with
//! outputs poisoned, at two thread-order seeds. Runs on `cuda-emu` by default and on a real GPU
//! with `PT_TEST_DEVICE=cuda` (scripts/gpu-check.sh). Tolerances: ‖got−want‖/‖want‖ ≤ 1e-5 per
//! tensor in f32 mode, ≤ 1e-2 in bf16 mode; never NaN.

mod harness;

mod asan;
mod attention;
mod elementwise;
mod embedding;
mod loss;
mod matmul;
mod nccl;
mod norm;
mod optim;
