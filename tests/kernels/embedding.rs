//! Kernel tests: `kernels/embedding.cu` against the cpu backend.
