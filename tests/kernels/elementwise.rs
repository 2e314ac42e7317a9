//! Kernel tests: `kernels/elementwise.cu` against the cpu backend.
