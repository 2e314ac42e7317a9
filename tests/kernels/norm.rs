//! Kernel tests: `kernels/norm.cu` against the cpu backend.
