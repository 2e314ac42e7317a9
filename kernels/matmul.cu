// matmul.cu: the linear layer (src/ops/linear.rs), `out = inp·weightᵀ + bias` with the weight in
// PyTorch layout [out_dim, in_dim], and its backward.
//
// Kernels (act = f32 | bf16: the type of inp, out, dout, dinp; weight, bias, dweight and dbias are
// always f32). Each GEMM kernel computes one 64×64 tile of its output C[M, N] per block:
//
//   linear_forward_<act>(out, inp, weight, bias, rows, in_dim, out_dim)
//       out[rows, out_dim] = inp·weightᵀ (+ bias)        M = rows,    N = out_dim, K = in_dim
//   linear_backward_input_<act>(dinp, dout, weight, rows, in_dim, out_dim)
//       dinp[rows, in_dim] = dout·weight                 M = rows,    N = in_dim,  K = out_dim
//   linear_backward_weight_<act>(dweight, dout, inp, rows, in_dim, out_dim)
//       dweight[out_dim, in_dim] += doutᵀ·inp            M = out_dim, N = in_dim,  K = rows
//     grid (⌈M/64⌉, ⌈N/64⌉); block 256 (f32: SIMT, 4×4 outputs per thread) or 128 (bf16: four
//     warps of wmma 16×16×16 tensor-core fragments, 32×32 outputs per warp); static shared memory.
//     2·M·N·K FLOPs each; global reads (M·⌈N/64⌉ + N·⌈M/64⌉)·K elements of A and B, M·N
//     writes of C (plus M·N reads when accumulating).
//   linear_backward_bias_<act>(dbias, dout, rows, out_dim)
//       dbias[out_dim] += Σ_rows dout                    grid ⌈out_dim/32⌉, block 256
//
// The three products are one kernel body over a generic operand view, A[m, k] = a[m·sam + k·sak]
// and B[k, n] = b[k·sbk + n·sbn]: the backward's transposed operands are strides, not copies.
// C is always row-major [M, N]. Every output element is summed by one thread (or one warp's
// fragment) over k in a fixed order, so results do not depend on scheduling; the bias gradient
// reduces rows in a fixed order too. No float atomics anywhere. File-local helpers carry an mm_
// prefix: the emulator links every kernel file into one library, where same-named helpers clash.

#include "common.cuh"

#define MM_TILE 64  // output tile edge, in both the SIMT and the wmma kernel
#define MM_BK 32    // depth of one shared-memory stage of A and B

// Stages the block [r0, r0+64) × [k0, k0+32) of an operand X[r, k] = x[r·sr + k·sk] (rows r of
// R, depth k of K) into shared memory at dst[r·dr + k·dk], as the element type of `dst`, with
// zeros outside R × K: ragged edges then need no test in the inner loops, and the zeros add
// nothing. Consecutive threads take consecutive elements of whichever index is contiguous in
// global memory, so the loads coalesce for plain and transposed operands alike.
template <typename D, typename T>
__device__ __forceinline__ void mm_stage_tile(D* dst, int dr, int dk, const T* x, int sr, int sk, int r0,
                                              int k0, int R, int K) {
    const bool k_contiguous = sk == 1;
    for (int idx = threadIdx.x; idx < MM_TILE * MM_BK; idx += blockDim.x) {
        const int r = k_contiguous ? idx / MM_BK : idx % MM_TILE;
        const int k = k_contiguous ? idx % MM_BK : idx / MM_TILE;
        const int gr = r0 + r, gk = k0 + k;
        st(dst, r * dr + k * dk, gr < R && gk < K ? ld(x, gr * sr + gk * sk) : 0.0f);
    }
}

// The epilogue shared by both GEMMs: C[m, n] = acc (+ bias[n]) (+ the C[m, n] already there).
template <typename TC>
__device__ __forceinline__ void mm_store_output(TC* c, int m, int n, int N, float acc, const float* bias,
                                                bool accumulate) {
    if (bias) acc += bias[n];
    if (accumulate) acc += ld(c, m * N + n);
    st(c, m * N + n, acc);
}

// ---- f32: SIMT tiles --------------------------------------------------------------------------
// 256 threads as 16×16; thread (tx, ty) owns rows ty + 16i and columns tx + 16j (i, j < 4) of
// the tile: a warp then reads two A values (broadcasts) and 16 consecutive B values per k, and
// its stores to C are runs of 16 consecutive columns. Shared tiles are k-major, padded by one
// column so that staging a k-contiguous operand writes 32 different banks.
template <typename TA, typename TB, typename TC>
__device__ void mm_simt(TC* c, const TA* a, const TB* b, const float* bias, int M, int N, int K, int sam,
                        int sak, int sbk, int sbn, bool accumulate) {
    __shared__ float sa[MM_BK][MM_TILE + 1];
    __shared__ float sb[MM_BK][MM_TILE + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = blockIdx.x * MM_TILE, n0 = blockIdx.y * MM_TILE;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        mm_stage_tile(&sa[0][0], 1, MM_TILE + 1, a, sam, sak, m0, k0, M, K);
        mm_stage_tile(&sb[0][0], 1, MM_TILE + 1, b, sbn, sbk, n0, k0, N, K);
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < MM_BK; k++) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) av[i] = sa[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) bv[j] = sb[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();  // everyone is done with this stage before the next overwrites it
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
            if (m < M && n < N) mm_store_output(c, m, n, N, acc[i][j], bias, accumulate);
        }
}

// ---- bf16: tensor cores through wmma ----------------------------------------------------------
// 128 threads = 4 warps in a 2×2 grid, each owning 32×32 outputs as 2×2 accumulator fragments
// (f32). A and B are converted to bf16 while staging (f32 weights included), A as [m][k]
// (matrix_a, row-major) and B as [k][n] (matrix_b, row-major). Row strides are padded by 8
// elements: still multiples of 8 elements and of 16 bytes as wmma requires, while every
// fragment start (rows multiple of 16, columns multiple of 16) stays 32-byte aligned. The
// accumulators go through shared memory for the epilogue, whose stores then coalesce.
struct alignas(32) MmWmmaTiles {
    bf16 a[MM_TILE][MM_BK + 8];
    bf16 b[MM_BK][MM_TILE + 8];
    float c[MM_TILE][MM_TILE + 4];
};

template <typename TA, typename TB, typename TC>
__device__ void mm_wmma(TC* c, const TA* a, const TB* b, const float* bias, int M, int N, int K, int sam,
                        int sak, int sbk, int sbn, bool accumulate) {
    using namespace nvcuda;
    __shared__ MmWmmaTiles s;
    const int warp = threadIdx.x / 32, wm = (warp / 2) * 32, wn = (warp % 2) * 32;
    const int m0 = blockIdx.x * MM_TILE, n0 = blockIdx.y * MM_TILE;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        mm_stage_tile(&s.a[0][0], MM_BK + 8, 1, a, sam, sak, m0, k0, M, K);
        mm_stage_tile(&s.b[0][0], 1, MM_TILE + 8, b, sbn, sbk, n0, k0, N, K);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < MM_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], &s.a[wm + 16 * i][kk], MM_BK + 8);
#pragma unroll
            for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], &s.b[kk][wn + 16 * j], MM_TILE + 8);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(&s.c[wm + 16 * i][wn + 16 * j], acc[i][j], MM_TILE + 4, wmma::mem_row_major);
    __syncthreads();
    for (int idx = threadIdx.x; idx < MM_TILE * MM_TILE; idx += blockDim.x) {
        const int r = idx / MM_TILE, col = idx % MM_TILE, m = m0 + r, n = n0 + col;
        if (m < M && n < N) mm_store_output(c, m, n, N, s.c[r][col], bias, accumulate);
    }
}

// The GEMM of each activation type: SIMT in f32 mode (exact comparisons with the cpu backend),
// tensor cores in bf16 mode.
template <typename act_t, typename TA, typename TB, typename TC>
__device__ __forceinline__ void mm_gemm(TC* c, const TA* a, const TB* b, const float* bias, int M, int N, int K,
                                        int sam, int sak, int sbk, int sbn, bool accumulate) {
    if constexpr (sizeof(act_t) == sizeof(float))
        mm_simt(c, a, b, bias, M, N, K, sam, sak, sbk, sbn, accumulate);
    else
        mm_wmma(c, a, b, bias, M, N, K, sam, sak, sbk, sbn, accumulate);
}

// ---- the linear layer -------------------------------------------------------------------------
// out[r, o] = Σ_i inp[r, i]·weight[o, i] + bias[o]: A = inp (row-major), B[i, o] = weight[o, i].
template <typename act_t>
__device__ void linear_forward(act_t* out, const act_t* inp, const float* weight, const float* bias, int rows,
                               int in_dim, int out_dim) {
    mm_gemm<act_t>(out, inp, weight, bias, rows, out_dim, in_dim, in_dim, 1, 1, in_dim, false);
}
// dinp[r, i] = Σ_o dout[r, o]·weight[o, i]: A = dout (row-major), B = weight (row-major).
template <typename act_t>
__device__ void linear_backward_input(act_t* dinp, const act_t* dout, const float* weight, int rows, int in_dim,
                                      int out_dim) {
    mm_gemm<act_t>(dinp, dout, weight, nullptr, rows, in_dim, out_dim, out_dim, 1, in_dim, 1, false);
}
// dweight[o, i] += Σ_r dout[r, o]·inp[r, i]: A[o, r] = dout[r, o] (transposed), B = inp.
template <typename act_t>
__device__ void linear_backward_weight(float* dweight, const act_t* dout, const act_t* inp, int rows, int in_dim,
                                       int out_dim) {
    mm_gemm<act_t>(dweight, dout, inp, nullptr, out_dim, in_dim, rows, 1, out_dim, in_dim, 1, true);
}
// dbias[o] += Σ_r dout[r, o]. 256 threads = 8 row groups × 32 columns: lane l of warp g sums
// rows g, g+8, … of column 32·blockIdx.x + l (coalesced across the warp), then warp 0 adds the
// eight partial sums in order.
template <typename act_t>
__device__ void linear_backward_bias(float* dbias, const act_t* dout, int rows, int out_dim) {
    __shared__ float partial[8][32];
    const int lane = threadIdx.x % 32, group = threadIdx.x / 32, col = blockIdx.x * 32 + lane;
    float sum = 0.0f;
    if (col < out_dim)
        for (int r = group; r < rows; r += 8) sum += ld(dout, r * out_dim + col);
    partial[group][lane] = sum;
    __syncthreads();
    if (group == 0 && col < out_dim) {
        float total = 0.0f;
#pragma unroll
        for (int g = 0; g < 8; g++) total += partial[g][lane];
        dbias[col] += total;
    }
}

extern "C" __global__ void linear_forward_f32(float* out, const float* inp, const float* weight, const float* bias,
                                              int rows, int in_dim, int out_dim) {
    linear_forward(out, inp, weight, bias, rows, in_dim, out_dim);
}
extern "C" __global__ void linear_forward_bf16(bf16* out, const bf16* inp, const float* weight, const float* bias,
                                               int rows, int in_dim, int out_dim) {
    linear_forward(out, inp, weight, bias, rows, in_dim, out_dim);
}
extern "C" __global__ void linear_backward_input_f32(float* dinp, const float* dout, const float* weight, int rows,
                                                     int in_dim, int out_dim) {
    linear_backward_input(dinp, dout, weight, rows, in_dim, out_dim);
}
extern "C" __global__ void linear_backward_input_bf16(bf16* dinp, const bf16* dout, const float* weight, int rows,
                                                      int in_dim, int out_dim) {
    linear_backward_input(dinp, dout, weight, rows, in_dim, out_dim);
}
extern "C" __global__ void linear_backward_weight_f32(float* dweight, const float* dout, const float* inp, int rows,
                                                      int in_dim, int out_dim) {
    linear_backward_weight(dweight, dout, inp, rows, in_dim, out_dim);
}
extern "C" __global__ void linear_backward_weight_bf16(float* dweight, const bf16* dout, const bf16* inp, int rows,
                                                       int in_dim, int out_dim) {
    linear_backward_weight(dweight, dout, inp, rows, in_dim, out_dim);
}
extern "C" __global__ void linear_backward_bias_f32(float* dbias, const float* dout, int rows, int out_dim) {
    linear_backward_bias(dbias, dout, rows, out_dim);
}
extern "C" __global__ void linear_backward_bias_bf16(float* dbias, const bf16* dout, int rows, int out_dim) {
    linear_backward_bias(dbias, dout, rows, out_dim);
}
