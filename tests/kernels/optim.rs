//! Kernel tests: `kernels/optim.cu` against the cpu backend.
