//! Kernel tests: `kernels/matmul.cu` against the cpu backend.
