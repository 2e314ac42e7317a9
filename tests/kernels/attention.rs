//! Kernel tests: `kernels/attention.cu` against the cpu backend.
