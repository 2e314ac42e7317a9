//! The reference kernels: every Transformer op as a `*_forward` / `*_backward` pair over plain
//! slices, generic over [`Float`](crate::scalar::Float). The `cpu` backend calls these directly;
//! the CUDA kernels (and their host emulation) are tested against them.
//!
//! Conventions, shared by every op:
//! - Tensors are row-major slices; shapes are passed as explicit dimensions and every slice's
//!   length is checked (a wrong length is an [`Error::Shape`](crate::Error::Shape) naming the
//!   argument).
//! - `*_backward` **writes** the input gradient (`dinp`) and **adds into** parameter gradients
//!   (`dweight`, `dbias`, `dtable`), so gradients accumulate over micro-batches.
//! - Activation layout is `[batch, seq, channels]`; attention heads are interleaved in the
//!   channel dimension (`[.., heads·head_dim]`), as a linear layer produces them.
//! - Work is parallel over rows with rayon (on the caller's pool); each row is reduced
//!   sequentially and parameter-gradient reductions run in a fixed order, so results are
//!   bitwise reproducible for a given thread count.

pub mod attention;
pub mod cross_entropy;
pub mod dropout;
pub mod embedding;
pub mod gelu;
pub mod gemm_bf16;
pub mod layernorm;
pub mod linear;
pub mod matmul;
pub mod optim;
pub mod patch;
pub mod pooling;
pub mod residual;
pub mod rows;
pub mod simd;
pub mod softmax;
pub mod tanh;
