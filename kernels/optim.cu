// optim.cu: the optimizer's whole update in one pass per tensor, and deterministic sums;
// reference src/ops/optim.rs. Parameters, gradients and optimizer state are f32.
//
//   adamw_update(param, grad, m, v, n, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
//                lr_wd, step_size, bc2_sqrt, grad_scale)              grid-stride
//   sgd_update(param, grad, momentum_buf, n, lr, momentum, weight_decay, nesterov, first,
//              grad_scale)                                            grid-stride
//                                                                     grid-stride
//   sum_{f32,bf16}(partials, x, n), sum_squares_{f32,bf16}(partials, x, n)
//       SUM_THREADS threads per block; block b writes its f64 sum to partials[b], which the host
//       adds in block order. Which thread adds which elements, and the tree that combines a
//       block's threads, depend on n and the grid only: the result is the same bits for every
//       thread order, with no float atomics.
//
// Device helpers are `static`: the emulator links every kernel file into one library, where two
// files' same-named helpers would otherwise silently share one definition.
#include "common.cuh"


// AdamW, PyTorch's formulation: p ← p − lr·wd·p − step_size·m / (√v / √(1−β2ᵗ) + eps), with
// step_size = lr/(1−β1ᵗ) and √(1−β2ᵗ) computed once per call on the host in f64. The decoupled
// decay is applied as p − (lr·wd)·p, which keeps lr·wd's digits (1 − lr·wd rounded to f32
// would lose most of them). The gradient enters times grad_scale, global-norm clipping's
// coefficient, so clipping needs no pass of its own.
extern "C" __global__ void adamw_update(float* param, const float* grad, float* m, float* v, int n, float beta1,
                                        float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                                        float lr_wd, float step_size, float bc2_sqrt, float grad_scale) {
    GRID_STRIDE(i, n) {
        const float g = grad[i] * grad_scale, p = param[i];
        const float mi = beta1 * m[i] + one_minus_beta1 * g;
        const float vi = beta2 * v[i] + one_minus_beta2 * g * g;
        m[i] = mi;
        v[i] = vi;
        param[i] = p - lr_wd * p - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

// SGD with momentum, PyTorch's formulation (dampening 0): g ← grad_scale·grad + wd·p; buf ← momentum·buf + g
// (buf ← g on the first step, whose buffer is never read: it may be uninitialised);
// d = nesterov ? g + momentum·buf : buf; p ← p − lr·d.
extern "C" __global__ void sgd_update(float* param, const float* grad, float* momentum_buf, int n, float lr,
                                      float momentum, float weight_decay, int nesterov, int first,
                                      float grad_scale) {
    GRID_STRIDE(i, n) {
        const float p = param[i];
        const float g = grad[i] * grad_scale + weight_decay * p;
        const float b = first ? g : momentum * momentum_buf[i] + g;
        momentum_buf[i] = b;
        param[i] = p - lr * (nesterov ? g + momentum * b : b);
    }
}

// ---- Σ x and Σ x², in f64 --------------------------------------------------------------------

#define SUM_THREADS 256

template <bool SQUARES, typename T>
static __device__ void block_sums(double* partials, const T* x, int n) {
    __shared__ double sums[SUM_THREADS];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        const double v = ld(x, i);
        acc += SQUARES ? v * v : v;
    }
    // A fixed pairwise tree in shared memory (f64 has no warp_sum in common.cuh).
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (int stride = SUM_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}
extern "C" __global__ void sum_f32(double* partials, const float* x, int n) { block_sums<false>(partials, x, n); }
extern "C" __global__ void sum_bf16(double* partials, const bf16* x, int n) { block_sums<false>(partials, x, n); }
extern "C" __global__ void sum_squares_f32(double* partials, const float* x, int n) { block_sums<true>(partials, x, n); }
extern "C" __global__ void sum_squares_bf16(double* partials, const bf16* x, int n) { block_sums<true>(partials, x, n); }
