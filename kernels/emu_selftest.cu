// emu_selftest.cu: small kernels that exercise what the cuda-emu backend emulates (barriers,
// shuffles, votes, atomics, static and dynamic shared memory, wmma, bf16) and the failures it must
// report. They compile for the GPU like every kernel file; the tests state the expected results.
#include "common.cuh"

// sums[b] and maxes[b] of row b of x (n floats per row); one block per row, any multiple of 32
// threads. Exercises block_sum/block_max: shared memory, barriers and xor shuffles.
extern "C" __global__ void emu_test_block_reduce(const float* x, float* sums, float* maxes, int n) {
    __shared__ float scratch[32];
    const float* row = x + (long long)blockIdx.x * n;
    float s = 0.0f, m = -__int_as_float(0x7f800000);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        s += row[i];
        m = fmaxf(m, row[i]);
    }
    s = block_sum(s, scratch);
    m = block_max(m, scratch);
    if (threadIdx.x == 0) {
        sums[blockIdx.x] = s;
        maxes[blockIdx.x] = m;
    }
}

// out[t] = x[(t + 1) % blockDim.x] through shared memory (one block, at most 1024 threads), with
// or without the barrier between writing and reading. The buffer is first set to -1 behind a
// barrier, so what the unsynchronised read sees depends only on the order threads run in.
__device__ __forceinline__ void emu_test_rotate(const float* x, float* out, bool synced) {
    __shared__ float s[1024];
    const int t = threadIdx.x;
    s[t] = -1.0f;
    __syncthreads();
    s[t] = x[t];
    if (synced) __syncthreads();
    out[t] = s[(t + 1) % blockDim.x];
}
// Deliberately racy: some out[t] are -1, and which ones changes with the emulator's seed.
extern "C" __global__ void emu_test_shared_race(const float* x, float* out) { emu_test_rotate(x, out, false); }
extern "C" __global__ void emu_test_shared_synced(const float* x, float* out) { emu_test_rotate(x, out, true); }

// Every shuffle and vote. Block of full warps; v = in[t], lane = t % 32; out[k * blockDim.x + t]
// for column k (see the test for the expected value of each).
extern "C" __global__ void emu_test_warp_ops(const int* in, int* out) {
    const int t = threadIdx.x, n = blockDim.x, lane = t & 31;
    const int v = in[t];
    out[0 * n + t] = __shfl_sync(FULL_MASK, v, (lane * 7 + 3) & 31);
    out[1 * n + t] = __shfl_up_sync(FULL_MASK, v, 3);
    out[2 * n + t] = __shfl_down_sync(FULL_MASK, v, 5);
    out[3 * n + t] = __shfl_xor_sync(FULL_MASK, v, 9);
    out[4 * n + t] = __shfl_sync(FULL_MASK, v, 0, 8);
    out[5 * n + t] = __shfl_down_sync(FULL_MASK, v, 2, 8);
    out[6 * n + t] = (int)__ballot_sync(FULL_MASK, v & 1);
    out[7 * n + t] = __any_sync(FULL_MASK, v == 7);
    out[8 * n + t] = __all_sync(FULL_MASK, v > 0);
    out[9 * n + t] = (int)__shfl_xor_sync(FULL_MASK, (float)v, 16);
    out[10 * n + t] = (int)(__shfl_up_sync(FULL_MASK, (long long)v << 32, 1) >> 32);
    out[11 * n + t] = (int)__shfl_down_sync(FULL_MASK, (double)v, 1);
    // The two half-warps at once, each a collective of its own.
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    out[12 * n + t] = __shfl_xor_sync(half, v, 1);
    out[13 * n + t] = (int)__ballot_sync(half, v & 1);
    __syncwarp();
    out[14 * n + t] = (int)(__shfl_sync(FULL_MASK, (unsigned long long)v * 3ull, 31 - lane) / 3ull);
}

// Block of 48 threads: the second warp has 16 lanes, and FULL_MASK collectives leave out the
// lanes that do not exist. out[t] = __ballot_sync(FULL_MASK, 1), out[48 + t] = t ^ 8.
extern "C" __global__ void emu_test_partial_warp(unsigned* out) {
    const unsigned t = threadIdx.x;
    out[t] = __ballot_sync(FULL_MASK, 1);
    out[blockDim.x + t] = __shfl_xor_sync(FULL_MASK, t, 8);
}

// Every thread of a 1-D grid (g = global index, G = thread count) updates the same counters,
// which start at zero. See the test for the totals.
extern "C" __global__ void emu_test_atomics(float* f, double* d, int* i, unsigned* u, unsigned long long* ull) {
    __shared__ int block_count;
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(f, 1.0f);
    atomicAdd(d, 0.5);
    atomicAdd(&i[0], g);
    atomicMax(&i[1], g);
    atomicMin(&i[2], -g);
    atomicSub(&i[3], 1);
    if (atomicCAS(&i[4], 0, g + 1) == 0) atomicAdd(&i[5], 1);
    atomicExch(&i[6], 1);
    atomicAdd(u, 2u);
    atomicAdd(ull, 1ull << 32);
    if (threadIdx.x == 0) block_count = 0;
    __syncthreads();
    atomicAdd(&block_count, 1);
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&i[7], block_count == (int)blockDim.x);
}

// x reversed through dynamic shared memory. Launch with (n + 1) * 4 shared bytes, any block:
// out[i] = x[n - 1 - i] for i < n, and out[n] = the shared float no thread wrote (on the emulator
// NaN with all bits set; undefined on a GPU).
extern "C" __global__ void emu_test_dynamic_shared(const float* x, float* out, int n) {
    DYNAMIC_SHARED(float, s);
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = x[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = s[n - 1 - i];
    if (threadIdx.x == 0) out[n] = s[n];
}

// A static shared pair that only even blocks fill in part: out[2b] = s[0], which every block
// writes (b), and out[2b + 1] = s[1], which only even blocks write (7). On the emulator an odd
// block reads NaN with all bits set there, not zero and not the even block's 7 that ran before
// it on the same OS thread; undefined on a GPU. Any block size.
extern "C" __global__ void emu_test_static_shared(float* out) {
    __shared__ float s[2];
    if (threadIdx.x == 0) {
        s[0] = (float)blockIdx.x;
        if (blockIdx.x % 2 == 0) s[1] = 7.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = s[0];
        out[2 * blockIdx.x + 1] = s[1];
    }
}

// One warp, 16×16 tiles: D = A·B + 1 + C with A row-major (a[m * 16 + k]), B column-major
// (b[n * 16 + k]), C row-major and D stored column-major (d[n * 16 + m]). All pointers 32-byte
// aligned.
extern "C" __global__ void emu_test_wmma(const bf16* a, const bf16* b, const float* c, float* d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
    __trap();  // bf16 wmma needs sm_80
#else
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc, fc;
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::fill_fragment(acc, 1.0f);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::load_matrix_sync(fc, c, 16, wmma::mem_row_major);
    // Fragments of one type share their element layout, so elementwise work is portable.
    for (int i = 0; i < acc.num_elements; i++) acc.x[i] += fc.x[i];
    wmma::store_matrix_sync(d, acc, 16, wmma::mem_col_major);
#endif
}

// y[i] = x[i] rounded to bf16 (nearest even; NaN → 0x7fff), back[i] = y[i] widened to f32.
extern "C" __global__ void emu_test_bf16(const float* x, bf16* y, float* back, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        st(y, i, x[i]);
        back[i] = ld(y, i);
    }
}

// Must fail the launch: the upper half of the block returns, the lower half waits at a barrier
// they never reach.
extern "C" __global__ void emu_test_early_exit(float* out) {
    if (threadIdx.x >= blockDim.x / 2) return;
    __syncthreads();
    out[threadIdx.x] = 1.0f;
}

// Must fail the launch (one warp): lane 31 returns, the others shuffle with a mask naming it.
extern "C" __global__ void emu_test_exited_lane(float* out) {
    if (threadIdx.x == 31) return;
    out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, 1.0f, 1);
}

// counts[t]: how many elements thread t of a grid-stride loop over n visits, or 0xffffffff if it
// saw a negative index or passed `cap` (an index that wraps past 2³¹ would run on).
extern "C" __global__ void emu_test_grid_stride(unsigned int* counts, int n, unsigned int cap) {
    unsigned int c = 0;
    GRID_STRIDE(i, n) {
        if (i < 0 || ++c > cap) {
            c = 0xffffffffu;
            break;
        }
    }
    counts[blockIdx.x * blockDim.x + threadIdx.x] = c;
}

// The same for a block-stride loop: counts[t] for thread t of one block.
extern "C" __global__ void emu_test_block_stride(unsigned int* counts, int n, unsigned int cap) {
    unsigned int c = 0;
    BLOCK_STRIDE(i, n) {
        if (i < 0 || ++c > cap) {
            c = 0xffffffffu;
            break;
        }
    }
    counts[threadIdx.x] = c;
}

// The order blocks start in: block b's thread 0 writes b at the next free slot of `order`.
// (On a GPU any order is possible; the emulator draws one from the launch seed.)
extern "C" __global__ void emu_test_block_order(unsigned* order, unsigned* next) {
    if (threadIdx.x == 0) order[atomicAdd(next, 1u)] = blockIdx.x;
}

// A kernel declared for at most 64 threads a block: a launch of more is refused.
extern "C" __global__ void __launch_bounds__(64) emu_test_bounded(float* out) { out[threadIdx.x] = 1.0f; }
