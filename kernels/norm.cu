// norm.cu: row normalisations, reference src/ops/layernorm.rs and src/ops/softmax.rs.
//
//   layernorm_forward_{f32,bf16}(out, mean, rstd, inp, weight, bias, rows, dim, eps)
//       one warp per row; mean and rstd are f32 whatever the activation type
//   layernorm_backward_{f32,bf16}(dinp, partials, dout, inp, weight, mean, rstd, rows, dim, rows_per_block)
//       one block per `rows_per_block` rows: writes dinp, and the block's dweight/dbias sums
//       to partials[block] = [Σ dout·x̂ | Σ dout] (2·dim floats)
//   layernorm_param_grads(dweight, dbias, partials, blocks, dim)
//       dweight += Σ_block partials[block][:dim], dbias += Σ_block partials[block][dim:], blocks in
//       a fixed order: deterministic without float atomics
//   softmax_forward_{f32,bf16}(out, inp, rows, cols), softmax_backward_*(dinp, out, dout, rows, cols)
//       one warp per row
//
// Device helpers are `static`: the emulator links every kernel file into one library, where two
// files' same-named helpers would otherwise silently share one definition.
#include "common.cuh"

// ---- LayerNorm -------------------------------------------------------------------------------

// out = (x − mean)·rstd·weight + bias with rstd = 1/√(var + eps), biased variance, two passes
// over the row (the second pass reads it from L1): no E[x²] − E[x]² cancellation.
template <typename act_t>
static __device__ void layernorm_forward(act_t* out, float* mean, float* rstd, const act_t* inp, const float* weight,
                                         const float* bias, int rows, int dim, float eps) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;  // the whole warp leaves: this kernel has no block barrier
    const act_t* x = inp + row * dim;
    act_t* o = out + row * dim;
    float sum = 0.0f;
    for (int j = lane; j < dim; j += 32) sum += ld(x, j);
    const float m = warp_sum(sum) / dim;
    float sq = 0.0f;
    for (int j = lane; j < dim; j += 32) {
        const float d = ld(x, j) - m;
        sq += d * d;
    }
    const float s = rsqrtf(warp_sum(sq) / dim + eps);
    for (int j = lane; j < dim; j += 32) st(o, j, (ld(x, j) - m) * s * weight[j] + bias[j]);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}
extern "C" __global__ void layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias, int rows, int dim, float eps) { layernorm_forward(out, mean, rstd, inp, weight, bias, rows, dim, eps); }
extern "C" __global__ void layernorm_forward_bf16(bf16* out, float* mean, float* rstd, const bf16* inp, const float* weight, const float* bias, int rows, int dim, float eps) { layernorm_forward(out, mean, rstd, inp, weight, bias, rows, dim, eps); }

// With g = weight·dout and x̂ = (x − mean)·rstd: dinp = rstd·(g − mean(g) − x̂·mean(g·x̂)).
// The block walks its rows one at a time. Each thread owns the columns tid, tid + blockDim, …
// of the shared accumulators `acc` = [Σ dout·x̂ | Σ dout], so every column adds its rows in row
// order, whatever order the threads run in. Dynamic shared memory: 2·dim floats.
template <typename act_t>
static __device__ void layernorm_backward(act_t* dinp, float* partials, const act_t* dout, const act_t* inp,
                                          const float* weight, const float* mean, const float* rstd, int rows, int dim,
                                          int rows_per_block) {
    DYNAMIC_SHARED(float, acc);
    // Per-warp partial sums of the row's two reductions, double-buffered by row parity: a warp
    // can only write row r + 2's sums after every warp has passed row r + 1's barrier, that is,
    // after every warp has read row r's.
    __shared__ float scratch[2][2][32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) acc[j] = acc[dim + j] = 0.0f;

    const int first = blockIdx.x * rows_per_block;
    const int last = min(first + rows_per_block, rows);
    for (int row = first; row < last; row++) {
        const act_t* x = inp + row * dim;
        const act_t* d = dout + row * dim;
        const float m = mean[row], s = rstd[row];
        float sum_g = 0.0f, sum_gxc = 0.0f;  // Σ g, Σ g·(x − mean)
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            const float g = weight[j] * ld(d, j);
            sum_g += g;
            sum_gxc += g * (ld(x, j) - m);
        }
        float(*sc)[32] = scratch[row & 1];
        sum_g = warp_sum(sum_g);
        sum_gxc = warp_sum(sum_gxc);
        if (lane == 0) {
            sc[0][warp] = sum_g;
            sc[1][warp] = sum_gxc;
        }
        __syncthreads();
        sum_g = sum_gxc = 0.0f;
        for (int w = 0; w < warps; w++) {  // the same order in every thread
            sum_g += sc[0][w];
            sum_gxc += sc[1][w];
        }
        const float mean_g = sum_g / dim, mean_gxhat = sum_gxc * s / dim;
        act_t* di = dinp + row * dim;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            const float dj = ld(d, j), xhat = (ld(x, j) - m) * s;
            st(di, j, s * (weight[j] * dj - mean_g - xhat * mean_gxhat));
            acc[j] += dj * xhat;
            acc[dim + j] += dj;
        }
    }
    float* part = partials + blockIdx.x * 2 * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        part[j] = acc[j];
        part[dim + j] = acc[dim + j];
    }
}
extern "C" __global__ void layernorm_backward_f32(float* dinp, float* partials, const float* dout, const float* inp, const float* weight, const float* mean, const float* rstd, int rows, int dim, int rows_per_block) { layernorm_backward(dinp, partials, dout, inp, weight, mean, rstd, rows, dim, rows_per_block); }
extern "C" __global__ void layernorm_backward_bf16(bf16* dinp, float* partials, const bf16* dout, const bf16* inp, const float* weight, const float* mean, const float* rstd, int rows, int dim, int rows_per_block) { layernorm_backward(dinp, partials, dout, inp, weight, mean, rstd, rows, dim, rows_per_block); }

// Column sums of `partials` ([blocks][2·dim]) added into [dweight | dbias]. A block of 8 warps
// takes 32 columns; warp w sums the partial rows w, w + 8, … (lanes on consecutive columns, so
// loads coalesce), then warp 0 adds the 8 warp sums in warp order: a fixed order throughout.
#define PARAM_GRAD_WARPS 8
extern "C" __global__ void layernorm_param_grads(float* dweight, float* dbias, const float* partials, int blocks,
                                                 int dim) {
    __shared__ float sums[PARAM_GRAD_WARPS][32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int col = blockIdx.x * 32 + lane;  // in [0, 2·dim)
    float a = 0.0f;
    if (col < 2 * dim)
        for (int b = warp; b < blocks; b += PARAM_GRAD_WARPS) a += partials[b * 2 * dim + col];
    sums[warp][lane] = a;
    __syncthreads();
    if (warp == 0 && col < 2 * dim) {
        a = 0.0f;
        for (int w = 0; w < PARAM_GRAD_WARPS; w++) a += sums[w][lane];
        if (col < dim)
            dweight[col] += a;
        else
            dbias[col - dim] += a;
    }
}

// ---- softmax ---------------------------------------------------------------------------------

// Max-subtracted, so every exp is in (0, 1]. A row with no finite maximum gets zeros when it is
// all −∞ (everything masked) and NaNs when it holds a NaN (which fmaxf skips), as on the cpu.
template <typename act_t>
static __device__ void softmax_forward(act_t* out, const act_t* inp, int rows, int cols) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;  // the whole warp leaves: this kernel has no block barrier
    const act_t* x = inp + row * cols;
    act_t* o = out + row * cols;
    const float neg_inf = -__int_as_float(0x7f800000);
    float mx = neg_inf;
    for (int j = lane; j < cols; j += 32) mx = fmaxf(mx, ld(x, j));
    mx = warp_max(mx);
    if (mx == neg_inf) {
        int nan = 0;
        for (int j = lane; j < cols; j += 32) nan |= ld(x, j) != ld(x, j);
        const float fill = __any_sync(FULL_MASK, nan) ? __int_as_float(0x7fc00000) : 0.0f;
        for (int j = lane; j < cols; j += 32) st(o, j, fill);
        return;
    }
    float sum = 0.0f;
    for (int j = lane; j < cols; j += 32) sum += expf(ld(x, j) - mx);
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < cols; j += 32) st(o, j, expf(ld(x, j) - mx) * inv);
}
// dinp = out·(dout − Σ out·dout).
template <typename act_t>
static __device__ void softmax_backward(act_t* dinp, const act_t* out, const act_t* dout, int rows, int cols) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;  // the whole warp leaves: this kernel has no block barrier
    const act_t* y = out + row * cols;
    const act_t* g = dout + row * cols;
    act_t* d = dinp + row * cols;
    float dot = 0.0f;
    for (int j = lane; j < cols; j += 32) dot += ld(y, j) * ld(g, j);
    dot = warp_sum(dot);
    for (int j = lane; j < cols; j += 32) st(d, j, ld(y, j) * (ld(g, j) - dot));
}
extern "C" __global__ void softmax_forward_f32(float* out, const float* inp, int rows, int cols) { softmax_forward(out, inp, rows, cols); }
extern "C" __global__ void softmax_forward_bf16(bf16* out, const bf16* inp, int rows, int cols) { softmax_forward(out, inp, rows, cols); }
extern "C" __global__ void softmax_backward_f32(float* dinp, const float* out, const float* dout, int rows, int cols) { softmax_backward(dinp, out, dout, rows, cols); }
extern "C" __global__ void softmax_backward_bf16(bf16* dinp, const bf16* out, const bf16* dout, int rows, int cols) { softmax_backward(dinp, out, dout, rows, cols); }
