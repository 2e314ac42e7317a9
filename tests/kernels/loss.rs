//! Kernel tests: `kernels/loss.cu` against the cpu backend.
