//! The launch code of every op on a [`GpuDevice`](super::GpuDevice), one module per kernel file
//! (`kernels/<family>.cu`): checks lengths and element types, picks the kernel by the activation
//! type's suffix, sizes the grid, launches.

pub mod attention;
pub mod elementwise;
pub mod embedding;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod optim;

/// Placeholder error while a family's kernels are being written.
pub(crate) fn not_yet(op: &str) -> crate::Error {
    crate::Error::State { what: op.into(), message: "this op has no GPU kernel yet".into() }
}
