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
