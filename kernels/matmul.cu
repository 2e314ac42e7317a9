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
//   linear_backward_weight_<act>(out, dout, inp, rows, in_dim, out_dim, chunk)
//       dweight[out_dim, in_dim] += doutᵀ·inp            M = out_dim, N = in_dim,  K = rows
//       with the rows split in gridDim.z slices of `chunk` rows: one slice adds into dweight
//       (out = dweight); several write partials out[z][out_dim][in_dim] that
//   linear_backward_weight_reduce(dweight, partials, n, splits)  adds into dweight in z order
//       (grid-stride, 256 threads).
//     grid (⌈M/64⌉, ⌈N/64⌉, slices); block 256: f32, SIMT with 4×4 outputs per thread; bf16,
//     eight warps of wmma 16×16×16 tensor-core fragments (bf16 inputs, f32 accumulation) in two
//     k-groups of 2×2 warps with 32×32 outputs each. Static shared memory (36 KiB in bf16).
//     2·M·N·K FLOPs each; global reads (M·⌈N/64⌉ + N·⌈M/64⌉)·K elements of A and B, M·N
//     writes of C (plus M·N reads when accumulating; 2·slices·M·N more when split).
//   linear_backward_bias_<act>(dbias, dout, rows, out_dim)
//       dbias[out_dim] += Σ_rows dout                    grid ⌈out_dim/32⌉, block 1024
//
// The three products are one kernel body over a generic operand view, A[m, k] = a[m·lda + k]
// or a[k·lda + m] and B[k, n] = b[n·ldb + k] or b[k·ldb + n] (which index is contiguous is a
// template parameter): the backward's transposed operands are strides, not copies. C is always
// row-major [M, N]. Every output element is summed by one thread (or one warp's fragment, then
// the two k-groups' sums added, then the row slices' partials added in order) over k in a fixed
// order that depends on the shape only, so results do not depend on scheduling; the bias
// gradient reduces rows in a fixed order too. No float atomics anywhere. File-local helpers
// carry an mm_ prefix: the emulator links every kernel file into one library, where same-named
// helpers clash.

#include "common.cuh"

#define MM_TILE 64     // output tile edge, in both the SIMT and the wmma kernel
#define MM_BK 32       // depth of one shared-memory stage of the SIMT kernel
#define MM_THREADS 256  // threads of a GEMM block, SIMT and wmma alike (__launch_bounds__)
#define MM_SIMT_SHARE (MM_TILE * MM_BK / MM_THREADS)  // elements of a stage one thread moves

// Loads this thread's share of the block [r0, r0+64) × [k0, k0+32) of an operand X[r, k] =
// x[r·stride + k] (K_CONTIG) or x[k·stride + r] (rows r of R, depth k of K) into registers,
// with zeros outside R × K: ragged edges then need no test in the inner loops, and the zeros
// add nothing.
// Consecutive threads take consecutive elements of whichever index is contiguous in global
// memory, so the loads coalesce for plain and transposed operands alike. mm_store_stage writes
// the share, k-major, into a shared tile.
template <bool K_CONTIG>
__device__ __forceinline__ void mm_stage_index(int j, int& r, int& k) {
    const int idx = threadIdx.x + j * MM_THREADS;
    r = K_CONTIG ? idx / MM_BK : idx % MM_TILE;
    k = K_CONTIG ? idx % MM_BK : idx / MM_TILE;
}
template <bool K_CONTIG, typename T>
__device__ __forceinline__ void mm_load_stage(float (&v)[MM_SIMT_SHARE], const T* x, int stride, int r0, int k0,
                                              int R, int K) {
#pragma unroll
    for (int j = 0; j < MM_SIMT_SHARE; j++) {
        int r, k;
        mm_stage_index<K_CONTIG>(j, r, k);
        const int gr = r0 + r, gk = k0 + k;
        v[j] = gr < R && gk < K ? ld(x, K_CONTIG ? gr * stride + gk : gk * stride + gr) : 0.0f;
    }
}
template <bool K_CONTIG>
__device__ __forceinline__ void mm_store_stage(float (*dst)[MM_TILE + 1], const float (&v)[MM_SIMT_SHARE]) {
#pragma unroll
    for (int j = 0; j < MM_SIMT_SHARE; j++) {
        int r, k;
        mm_stage_index<K_CONTIG>(j, r, k);
        dst[k][r] = v[j];
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
template <bool A_K_CONTIG, bool B_K_CONTIG, typename TA, typename TB, typename TC>
__device__ void mm_simt(TC* c, const TA* a, const TB* b, const float* bias, int M, int N, int K, int lda, int ldb,
                        bool accumulate) {
    __shared__ float sa[MM_BK][MM_TILE + 1];
    __shared__ float sb[MM_BK][MM_TILE + 1];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = blockIdx.x * MM_TILE, n0 = blockIdx.y * MM_TILE;
    float acc[4][4] = {};
    // The next stage's loads are issued before this stage's FMAs, so their latency hides
    // behind the arithmetic; the summation order is the same as without the prefetch. On an
    // H100 at the MiniLM shapes that made the products 1.2–1.9× faster, although the registers
    // holding the prefetch (~110 per thread) leave room for only two blocks per SM.
    float va[MM_SIMT_SHARE], vb[MM_SIMT_SHARE];
    mm_load_stage<A_K_CONTIG>(va, a, lda, m0, 0, M, K);
    mm_load_stage<B_K_CONTIG>(vb, b, ldb, n0, 0, N, K);
    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        mm_store_stage<A_K_CONTIG>(sa, va);
        mm_store_stage<B_K_CONTIG>(sb, vb);
        __syncthreads();
        if (k0 + MM_BK < K) {
            mm_load_stage<A_K_CONTIG>(va, a, lda, m0, k0 + MM_BK, M, K);
            mm_load_stage<B_K_CONTIG>(vb, b, ldb, n0, k0 + MM_BK, N, K);
        }
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
// 256 threads = 8 warps. Warps 0–3 and 4–7 are two k-groups, each a 2×2 grid of warps owning
// 32×32 outputs as 2×2 accumulator fragments (f32): in every 64-deep stage the first group
// multiplies k 0–31 and the second k 32–63, and the epilogue adds the second group's sums to the
// first's. Splitting k inside the block gives eight warps to a 64×64 tile, so the small grids
// (N = 384, and the weight gradient with K = rows) still have enough warps per SM to hide
// latency, at a fixed order of summation: deterministic.
//
// Operands are staged in the layout they have in global memory (no transposition): a tile is 64
// lines of 64 elements contiguous in global memory, padded to MM_WLD, as [row][k] when k is the
// contiguous index and [k][row] when the row is; the wmma fragment layout (row_major /
// col_major) reads either. Each thread moves 16-byte vectors (8 bf16 or 4 f32, the f32 weights
// converted to bf16 on the way into shared memory) when the operand's line stride and base
// allow it, element by element at ragged edges and otherwise. Global loads of stage s + 1 are
// issued into registers before the MMAs of stage s and written to the other of two shared
// buffers after them: one barrier per stage, and the load latency hides behind the MMAs.
//
// Padding by 8 elements keeps line starts 16-byte aligned (vector stores, wmma's ldm) and shifts
// consecutive lines by 4 banks, so the 8 rows a wmma load reads at once hit 32 different banks;
// fragment starts (multiples of 16 lines and of 16 elements) stay 32-byte aligned.
#define MM_WBK 64        // depth of one stage
#define MM_WLD 72        // padded line length of a staged tile, in elements
#define MM_CLD 68        // padded row of the f32 epilogue tile: 16-byte aligned rows

struct alignas(32) MmWmmaStage {
    bf16 a[MM_TILE][MM_WLD];
    bf16 b[MM_TILE][MM_WLD];
};
// The epilogue's tiles (one per k-group) reuse the stage buffers: the last barrier of the main
// loop has every warp done with them.
union alignas(32) MmWmmaShared {
    MmWmmaStage stage[2];
    float c[2][MM_TILE][MM_CLD];
};

template <bool C, typename T, typename F>
struct MmSelect {
    typedef T type;
};
template <typename T, typename F>
struct MmSelect<false, T, F> {
    typedef F type;
};

// The register type of one 16-byte vector of an operand element type, and its length.
template <typename T>
struct MmVec;
template <>
struct MmVec<bf16> {
    typedef uint4 type;
    static constexpr int n = 8;
};
template <>
struct MmVec<float> {
    typedef float4 type;
    static constexpr int n = 4;
};

__device__ __forceinline__ unsigned mm_bits(bf16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ unsigned mm_pack_bf16x2(float lo, float hi) {
    return mm_bits(__float2bfloat16(lo)) | mm_bits(__float2bfloat16(hi)) << 16;
}

// The vector X[line, c … c+n) of X[line, c] = x[line·ld + c], zeros outside L × C. One 16-byte
// load when `aligned` (x 16-byte aligned, ld a multiple of n) and the vector is inside C.
__device__ __forceinline__ void mm_load_vec(uint4& v, const bf16* x, int ld, int line, int c, int L, int C,
                                            bool aligned) {
    if (line < L && aligned && c + 8 <= C) {
        v = *reinterpret_cast<const uint4*>(x + line * ld + c);
        return;
    }
    unsigned h[8];
#pragma unroll
    for (int i = 0; i < 8; i++) h[i] = line < L && c + i < C ? mm_bits(x[line * ld + c + i]) : 0u;
    v = make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16);
}
__device__ __forceinline__ void mm_load_vec(float4& v, const float* x, int ld, int line, int c, int L, int C,
                                            bool aligned) {
    if (line < L && aligned && c + 4 <= C) {
        v = *reinterpret_cast<const float4*>(x + line * ld + c);
        return;
    }
    float f[4];
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = line < L && c + i < C ? x[line * ld + c + i] : 0.0f;
    v = make_float4(f[0], f[1], f[2], f[3]);
}
// Writes a vector into a staged tile as bf16: 16 bytes, or 8 for four converted f32.
__device__ __forceinline__ void mm_store_vec(bf16* dst, const uint4& v) { *reinterpret_cast<uint4*>(dst) = v; }
__device__ __forceinline__ void mm_store_vec(bf16* dst, const float4& v) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(mm_pack_bf16x2(v.x, v.y), mm_pack_bf16x2(v.z, v.w));
}

// One operand's share of a stage, held in registers between its global load and its store into
// shared memory. The operand is X[r, k] = x[r·ld + k] (K_CONTIG) or x[k·ld + r]; the stage is
// rows [r0, r0+64) of R and depth [k0, k0+64) of K. Consecutive threads take consecutive vectors
// of a line: a warp's loads are whole 128-byte lines (bf16) or 512 contiguous bytes (f32).
template <bool K_CONTIG, typename T>
struct MmStageRegs {
    static constexpr int kVec = MmVec<T>::n;
    static constexpr int kPerLine = MM_TILE / kVec;
    static constexpr int kCount = MM_TILE * MM_WBK / kVec / MM_THREADS;
    typename MmVec<T>::type v[kCount];

    __device__ __forceinline__ void load(const T* x, int ld, int r0, int k0, int R, int K, bool aligned) {
#pragma unroll
        for (int j = 0; j < kCount; j++) {
            const int idx = threadIdx.x + j * MM_THREADS, line = idx / kPerLine, c = idx % kPerLine * kVec;
            if (K_CONTIG)
                mm_load_vec(v[j], x, ld, r0 + line, k0 + c, R, K, aligned);
            else
                mm_load_vec(v[j], x, ld, k0 + line, r0 + c, K, R, aligned);
        }
    }
    __device__ __forceinline__ void store(bf16 (*tile)[MM_WLD]) const {
#pragma unroll
        for (int j = 0; j < kCount; j++) {
            const int idx = threadIdx.x + j * MM_THREADS;
            mm_store_vec(&tile[idx / kPerLine][idx % kPerLine * kVec], v[j]);
        }
    }
};

// Element (row, k) of a staged tile, by the operand's layout.
template <bool K_CONTIG>
__device__ __forceinline__ const bf16* mm_tile_at(const bf16 (*tile)[MM_WLD], int row, int k) {
    return K_CONTIG ? &tile[row][k] : &tile[k][row];
}

// Four consecutive outputs C[m, n … n+4): the f32 sums of the two k-groups added, then the
// epilogue of mm_store_output, with 16-byte (f32) or 8-byte (bf16) accesses when `vec`.
__device__ __forceinline__ void mm_store_quad_vec(float* c, int i, const float (&v)[4], bool accumulate) {
    float4 out = make_float4(v[0], v[1], v[2], v[3]);
    if (accumulate) {
        const float4 old = *reinterpret_cast<const float4*>(c + i);
        out = make_float4(out.x + old.x, out.y + old.y, out.z + old.z, out.w + old.w);
    }
    *reinterpret_cast<float4*>(c + i) = out;
}
__device__ __forceinline__ void mm_store_quad_vec(bf16* c, int i, const float (&v)[4], bool accumulate) {
    float w[4] = {v[0], v[1], v[2], v[3]};
    if (accumulate) {
        const uint2 old = *reinterpret_cast<const uint2*>(c + i);
        w[0] += __uint_as_float(old.x << 16), w[1] += __uint_as_float(old.x & 0xffff0000u);
        w[2] += __uint_as_float(old.y << 16), w[3] += __uint_as_float(old.y & 0xffff0000u);
    }
    *reinterpret_cast<uint2*>(c + i) = make_uint2(mm_pack_bf16x2(w[0], w[1]), mm_pack_bf16x2(w[2], w[3]));
}

template <typename T>
__device__ __forceinline__ bool mm_aligned16(const T* p) {
    return reinterpret_cast<unsigned long long>(p) % 16 == 0;
}

// C[M, N] (+)= A·B (+ bias) with A[m, k] = a[m·lda + k] (A_K_CONTIG) or a[k·lda + m], and
// B[k, n] = b[n·ldb + k] (B_K_CONTIG) or b[k·ldb + n].
template <bool A_K_CONTIG, bool B_K_CONTIG, typename TA, typename TB, typename TC>
__device__ void mm_wmma(TC* c, const TA* a, const TB* b, const float* bias, int M, int N, int K, int lda, int ldb,
                        bool accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    // No bf16 tensor cores before sm_80: the host refuses bf16 there, so this never runs; the
    // guard lets the f32 kernels of this file compile for sm_70 and sm_75.
    __trap();
#else
    using namespace nvcuda;
    typedef typename MmSelect<A_K_CONTIG, wmma::row_major, wmma::col_major>::type LayoutA;
    typedef typename MmSelect<B_K_CONTIG, wmma::col_major, wmma::row_major>::type LayoutB;
    __shared__ MmWmmaShared s;
    const int warp = threadIdx.x / 32, wk = warp / 4, wm = (warp / 2 % 2) * 32, wn = (warp % 2) * 32;
    const int m0 = blockIdx.x * MM_TILE, n0 = blockIdx.y * MM_TILE;
    const bool a_vec = lda % MmVec<TA>::n == 0 && mm_aligned16(a);
    const bool b_vec = ldb % MmVec<TB>::n == 0 && mm_aligned16(b);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);

    MmStageRegs<A_K_CONTIG, TA> ra;
    MmStageRegs<B_K_CONTIG, TB> rb;
    ra.load(a, lda, m0, 0, M, K, a_vec);
    rb.load(b, ldb, n0, 0, N, K, b_vec);
    ra.store(s.stage[0].a);
    rb.store(s.stage[0].b);
    __syncthreads();
    const int stages = (K + MM_WBK - 1) / MM_WBK;
    for (int st = 0; st < stages; st++) {
        const int cur = st & 1;
        const bool more = st + 1 < stages;
        if (more) {  // in flight during the MMAs below
            ra.load(a, lda, m0, (st + 1) * MM_WBK, M, K, a_vec);
            rb.load(b, ldb, n0, (st + 1) * MM_WBK, N, K, b_vec);
        }
#pragma unroll
        for (int kk = wk * 32; kk < wk * 32 + 32; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LayoutA> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LayoutB> fb[2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                wmma::load_matrix_sync(fa[i], mm_tile_at<A_K_CONTIG>(s.stage[cur].a, wm + 16 * i, kk), MM_WLD);
#pragma unroll
            for (int j = 0; j < 2; j++)
                wmma::load_matrix_sync(fb[j], mm_tile_at<B_K_CONTIG>(s.stage[cur].b, wn + 16 * j, kk), MM_WLD);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        // The other buffer was last read in stage st − 1, before the barrier that ended it.
        if (more) {
            ra.store(s.stage[cur ^ 1].a);
            rb.store(s.stage[cur ^ 1].b);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(&s.c[wk][wm + 16 * i][wn + 16 * j], acc[i][j], MM_CLD, wmma::mem_row_major);
    __syncthreads();
    const bool vec = N % 4 == 0 && mm_aligned16(c) && (!bias || mm_aligned16(bias));
#pragma unroll
    for (int j = 0; j < MM_TILE * MM_TILE / 4 / MM_THREADS; j++) {
        const int idx = threadIdx.x + j * MM_THREADS, r = idx / (MM_TILE / 4), col = idx % (MM_TILE / 4) * 4;
        const int m = m0 + r, n = n0 + col;
        if (m >= M) continue;
        const float4 c0 = *reinterpret_cast<const float4*>(&s.c[0][r][col]);
        const float4 c1 = *reinterpret_cast<const float4*>(&s.c[1][r][col]);
        float v[4] = {c0.x + c1.x, c0.y + c1.y, c0.z + c1.z, c0.w + c1.w};
        if (vec && n + 4 <= N) {
            if (bias) {
                const float4 bv = *reinterpret_cast<const float4*>(bias + n);
                v[0] += bv.x, v[1] += bv.y, v[2] += bv.z, v[3] += bv.w;
            }
            mm_store_quad_vec(c, m * N + n, v, accumulate);
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (n + e < N) mm_store_output(c, m, n + e, N, v[e], bias, accumulate);
        }
    }
#endif
}

// The GEMM of each activation type: SIMT in f32 mode (exact comparisons with the cpu backend),
// tensor cores in bf16 mode. A[m, k] = a[m·lda + k] (A_K_CONTIG) or a[k·lda + m]; B[k, n] =
// b[n·ldb + k] (B_K_CONTIG) or b[k·ldb + n]: the backward's transposed operands are strides.
template <typename act_t, bool A_K_CONTIG, bool B_K_CONTIG, typename TA, typename TB, typename TC>
__device__ __forceinline__ void mm_gemm(TC* c, const TA* a, const TB* b, const float* bias, int M, int N, int K,
                                        int lda, int ldb, bool accumulate) {
    if constexpr (sizeof(act_t) == sizeof(float))
        mm_simt<A_K_CONTIG, B_K_CONTIG>(c, a, b, bias, M, N, K, lda, ldb, accumulate);
    else
        mm_wmma<A_K_CONTIG, B_K_CONTIG>(c, a, b, bias, M, N, K, lda, ldb, accumulate);
}

// ---- the linear layer -------------------------------------------------------------------------
// out[r, o] = Σ_i inp[r, i]·weight[o, i] + bias[o]: A = inp (row-major), B[i, o] = weight[o, i].
template <typename act_t>
__device__ void linear_forward(act_t* out, const act_t* inp, const float* weight, const float* bias, int rows,
                               int in_dim, int out_dim) {
    mm_gemm<act_t, true, true>(out, inp, weight, bias, rows, out_dim, in_dim, in_dim, in_dim, false);
}
// dinp[r, i] = Σ_o dout[r, o]·weight[o, i]: A = dout (row-major), B = weight (row-major).
template <typename act_t>
__device__ void linear_backward_input(act_t* dinp, const act_t* dout, const float* weight, int rows, int in_dim,
                                      int out_dim) {
    mm_gemm<act_t, true, false>(dinp, dout, weight, nullptr, rows, in_dim, out_dim, out_dim, in_dim, false);
}
// dweight[o, i] += Σ_r dout[r, o]·inp[r, i]: A[o, r] = dout[r, o] (transposed), B = inp.
// K = rows is long and the output small, so the rows may be split over gridDim.z: block z sums
// rows [z·chunk, (z+1)·chunk) into its own slice z of `out` (partials [z][out_dim][in_dim]), and
// linear_backward_weight_reduce adds the slices into dweight in z order. With one slice, `out`
// is dweight and the sum is added into it directly.
template <typename act_t>
__device__ void linear_backward_weight(float* out, const act_t* dout, const act_t* inp, int rows, int in_dim,
                                       int out_dim, int chunk) {
    const int r0 = blockIdx.z * chunk, n = min(chunk, rows - r0);
    float* slice = out + blockIdx.z * out_dim * in_dim;
    mm_gemm<act_t, false, false>(slice, dout + r0 * out_dim, inp + r0 * in_dim, nullptr, out_dim, in_dim, n, out_dim,
                                 in_dim, gridDim.z == 1);
}
// dweight[i] += Σ_z partials[z][i], z in order.
extern "C" __global__ void linear_backward_weight_reduce(float* dweight, const float* partials, int n, int splits) {
    GRID_STRIDE(i, n) {
        float sum = partials[i];
        for (int z = 1; z < splits; z++) sum += partials[z * n + i];
        dweight[i] += sum;
    }
}
// dbias[o] += Σ_r dout[r, o]. 1024 threads = 32 row groups × 32 columns: lane l of warp g sums
// rows g, g+32, … of column 32·blockIdx.x + l (coalesced across the warp), then warp 0 adds the
// 32 partial sums in order. Few columns per block, many rows: the row groups are what keeps
// enough loads in flight.
template <typename act_t>
__device__ void linear_backward_bias(float* dbias, const act_t* dout, int rows, int out_dim) {
    __shared__ float partial[32][33];
    const int lane = threadIdx.x % 32, group = threadIdx.x / 32, col = blockIdx.x * 32 + lane;
    float sum = 0.0f;
    if (col < out_dim)
#pragma unroll 4  // four loads in flight per thread; the adds keep their order
        for (int r = group; r < rows; r += 32) sum += ld(dout, r * out_dim + col);
    partial[group][lane] = sum;
    __syncthreads();
    if (group == 0 && col < out_dim) {
        float total = 0.0f;
#pragma unroll
        for (int g = 0; g < 32; g++) total += partial[g][lane];
        dbias[col] += total;
    }
}

// Each kernel states the block size it is launched with (src/device/gpu/ops/matmul.rs), so that
// ptxas keeps its registers within what a block of that size can have: the GEMMs' prefetch
// registers take them to about 100 per thread.
extern "C" __global__ void __launch_bounds__(MM_THREADS)
    linear_forward_f32(float* out, const float* inp, const float* weight, const float* bias, int rows, int in_dim,
                       int out_dim) {
    linear_forward(out, inp, weight, bias, rows, in_dim, out_dim);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS)
    linear_forward_bf16(bf16* out, const bf16* inp, const float* weight, const float* bias, int rows, int in_dim,
                        int out_dim) {
    linear_forward(out, inp, weight, bias, rows, in_dim, out_dim);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS)
    linear_backward_input_f32(float* dinp, const float* dout, const float* weight, int rows, int in_dim, int out_dim) {
    linear_backward_input(dinp, dout, weight, rows, in_dim, out_dim);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS)
    linear_backward_input_bf16(bf16* dinp, const bf16* dout, const float* weight, int rows, int in_dim, int out_dim) {
    linear_backward_input(dinp, dout, weight, rows, in_dim, out_dim);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS)
    linear_backward_weight_f32(float* out, const float* dout, const float* inp, int rows, int in_dim, int out_dim,
                               int chunk) {
    linear_backward_weight(out, dout, inp, rows, in_dim, out_dim, chunk);
}
extern "C" __global__ void __launch_bounds__(MM_THREADS)
    linear_backward_weight_bf16(float* out, const bf16* dout, const bf16* inp, int rows, int in_dim, int out_dim,
                                int chunk) {
    linear_backward_weight(out, dout, inp, rows, in_dim, out_dim, chunk);
}
extern "C" __global__ void __launch_bounds__(1024)
    linear_backward_bias_f32(float* dbias, const float* dout, int rows, int out_dim) {
    linear_backward_bias(dbias, dout, rows, out_dim);
}
extern "C" __global__ void __launch_bounds__(1024)
    linear_backward_bias_bf16(float* dbias, const bf16* dout, int rows, int out_dim) {
    linear_backward_bias(dbias, dout, rows, out_dim);
}
