"""f32 GEMM rates of the OpenBLAS inside numpy's wheel at the MiniLM step's shapes, for comparison
with the `gemm` crate's (docs/PERF.md). Needs numpy (any venv with torch has it); never a
dependency of the project.

    OPENBLAS_NUM_THREADS=1 python3 scripts/blas_rate.py
    OPENBLAS_NUM_THREADS=2 python3 scripts/blas_rate.py
"""

import time

import numpy as np

for m, k, n in [(2048, 2048, 2048), (2048, 384, 1536), (2048, 1536, 384), (384, 2048, 384), (128, 384, 1536)]:
    a = np.random.rand(m, k).astype(np.float32)
    b = np.random.rand(k, n).astype(np.float32)
    for _ in range(3):
        a @ b
    reps = max(3, int(2e10 / (2 * m * k * n)))
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    seconds = (time.perf_counter() - start) / reps
    print(f"{m}x{k}x{n}: {2 * m * k * n / seconds / 1e9:.1f} GFLOP/s")
