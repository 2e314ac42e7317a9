// cuda_emu.h: the CUDA subset of kernels/*.cu (DESIGN.md §3), in plain C++17 for the host.
//
// build.rs compiles every kernels/*.cu with g++ (-x c++ -std=c++17 -include this header) and links
// the units with emu_runtime.cpp into a shared library; Rust launches kernels by name through its
// C ABI (pt_emu_launch) with the argument array of a CUDA driver launch. This header is what the
// kernels see; emu_runtime.cpp is the scheduler behind it.
//
// How a launch runs:
//   - Blocks run one after another on each of up to the launch's `threads` OS threads, in an
//     order drawn from the launch seed (seed 0: by block index), so a result that depends on
//     which block runs first shows up for some seed. A block's state (shared memory, indices,
//     scheduler) is thread_local, so `__shared__` is simply `static thread_local`, and several
//     Rust threads can launch at once.
//   - Shared memory holds 0xFF bytes (NaN as floats, -1 as integers) wherever no thread of the
//     block has written: dynamic shared memory is refilled for every block, and each static
//     `__shared__` variable is filled by the first thread of the block to reach its declaration
//     (build.rs puts a PT_EMU_POISON_SHARED after each one), so a kernel that reads a slot no
//     thread of its block wrote (counting on zero, or on the previous block's value) reads
//     poison, as it reads garbage on a GPU.
//   - The threads of a block are cooperative fibers on one OS thread. A fiber runs until it
//     reaches __syncthreads, a warp collective (__syncwarp, shuffles, votes, wmma load/store/mma)
//     or its end. A barrier releases when every thread of the block has arrived, a warp collective
//     when every lane its mask names has (lanes past the end of a partial last warp do not exist
//     and are left out of every mask).
//   - The last lane to arrive at a warp collective computes every participant's result into that
//     participant's own fiber, so a fast lane running on to its next collective can never
//     overwrite a value a slower lane has not read yet.
//   - Which runnable fiber resumes next is drawn by a PRNG seeded from the launch seed and the
//     block index (seed 0: first come, first served), so a missing barrier shows up as a wrong
//     answer for some seed.
//   - Threads that can never go on (waiting at __syncthreads while others have exited, lanes
//     waiting for a lane that exited or waits elsewhere, ...) fail the launch with a message
//     naming the kernel, the block and the threads; so do inconsistent collectives and misused
//     wmma tiles. The block's fibers are then abandoned: nothing is thrown across fibers.
//
// Differences from a GPU to keep in mind (what the emulator cannot catch):
//   - A fiber runs until it reaches a barrier or a warp collective, so a plain read-modify-write
//     of shared or global memory by several threads (a `+=` where an atomic is needed) is never
//     interleaved, and loses no update as it would on a GPU. Races between barriers are found
//     only where they change which value is read (the thread order drawn from the seed).
//   - A wmma fragment holds the whole 16×16 tile in every lane (x[row * 16 + col]), and every lane
//     computes the product; code that treats x[] as "this lane's share" works on both.
//   - __activemask() is the warp's lanes that have not exited.
//   - __device__ adds nothing and __forceinline__ means `inline`: all kernel files are linked into
//     one library, so two files defining different inline helpers (or templates) under one name
//     would silently share one definition. Give file-local helpers file-unique names.
//   - __nv_bfloat16 has no implicit conversions or operators: convert with __float2bfloat16 and
//     __bfloat162float (ld/st in common.cuh), as the kernels' f32-arithmetic convention wants.
#pragma once

// Host headers come first: the qualifier macros below must not reach them.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <type_traits>
#include <utility>

#define PT_EMU 1

// ---- qualifiers (`__restrict__` is g++'s own) ---------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
// (Its bound is registered with the kernel, and a launch past it refused as by the GPU.)
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// One OS thread runs a block's fibers, and never two blocks at once.
#define __shared__ static thread_local

// ---- indices -----------------------------------------------------------------------------------
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};
constexpr int warpSize = 32;

// ---- the interface to emu_runtime.cpp ----------------------------------------------------------
// Hidden: internal to the library, so calls are direct rather than through the PLT (the kernels
// call these for every barrier and collective).
#pragma GCC visibility push(hidden)
namespace pt_emu {

// The running fiber's indices and its block's, kept up to date by the scheduler.
struct Current {
    uint3 thread_idx{};
    unsigned lane = 0;
    uint3 block_idx{};
    dim3 block_dim, grid_dim;
    void* dynamic_shared = nullptr;
};
inline thread_local Current current;

// Every warp collective, so that mismatched ones are caught and named in messages.
enum class Collective : unsigned char {
    syncwarp, shfl, shfl_up, shfl_down, shfl_xor, ballot, any, all, wmma_load, wmma_store, wmma_mma
};

// What a warp collective gives each participant: the value posted by its source lane (all ones if
// that lane takes no part), the lanes that posted a nonzero value, and the lanes that took part.
struct WarpResult {
    unsigned long long value;
    unsigned ballot;
    unsigned mask;
};

void sync_block();
// `src_lane` < 0: no value is read.
WarpResult warp_collective(Collective op, unsigned mask, unsigned long long value, int src_lane);
unsigned live_lanes();
// Fails the launch with this message; the calling thread never runs again.
[[noreturn]] void fail(const char* format, ...) __attribute__((format(printf, 1, 2)));
// `max_threads`: the kernel's `__launch_bounds__` (0: none), which a launch may not exceed.
void register_kernel(const char* name, void (*launch)(void** params), unsigned max_threads);
// Fills the static `__shared__` variable at `p` with 0xFF bytes, once per block: the first thread
// to reach its declaration does, before any thread of the block can have written it.
void poison_shared(void* p, std::size_t bytes);

}  // namespace pt_emu
#pragma GCC visibility pop

#define threadIdx (static_cast<const uint3&>(::pt_emu::current.thread_idx))
#define blockIdx (static_cast<const uint3&>(::pt_emu::current.block_idx))
#define blockDim (static_cast<const dim3&>(::pt_emu::current.block_dim))
#define gridDim (static_cast<const dim3&>(::pt_emu::current.grid_dim))

// The current block's dynamic shared memory (see DYNAMIC_SHARED in common.cuh): exactly the
// launch's shared bytes, aligned to 128 bytes, 0xFF-filled at the start of every block.
inline void* pt_emu_dynamic_shared() { return pt_emu::current.dynamic_shared; }
// After every static `__shared__` declaration of a kernel file (build.rs writes it there).
#define PT_EMU_POISON_SHARED(v) ::pt_emu::poison_shared(&(v), sizeof(v))

// ---- barriers, shuffles, votes -----------------------------------------------------------------
inline void __syncthreads() { pt_emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    pt_emu::warp_collective(pt_emu::Collective::syncwarp, mask, 0, -1);
}

namespace pt_emu {
template <class T>
T shuffle(Collective op, unsigned mask, T v, int src_lane) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof v);
    bits = warp_collective(op, mask, bits, src_lane).value;
    std::memcpy(&v, &bits, sizeof v);
    return v;
}
}  // namespace pt_emu

// Source lanes as PTX shfl.sync computes them: `width` splits the warp into segments; a source
// outside the caller's segment (up, down) or past its end (xor) reads the caller's own value.
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = warpSize) {
    const int first = pt_emu::current.lane & -width;
    return pt_emu::shuffle(pt_emu::Collective::shfl, mask, v, first + (src_lane & (width - 1)));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    const int lane = pt_emu::current.lane, src = lane - int(delta & 31);
    return pt_emu::shuffle(pt_emu::Collective::shfl_up, mask, v, src >= (lane & -width) ? src : lane);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = warpSize) {
    const int lane = pt_emu::current.lane, src = lane + int(delta & 31);
    const int last = (lane & -width) + width - 1;
    return pt_emu::shuffle(pt_emu::Collective::shfl_down, mask, v, src <= last ? src : lane);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = warpSize) {
    const int lane = pt_emu::current.lane, src = lane ^ (lane_mask & 31);
    const int last = (lane & -width) + width - 1;
    return pt_emu::shuffle(pt_emu::Collective::shfl_xor, mask, v, src <= last ? src : lane);
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return pt_emu::warp_collective(pt_emu::Collective::ballot, mask, predicate != 0, -1).ballot;
}
inline int __any_sync(unsigned mask, int predicate) {
    return pt_emu::warp_collective(pt_emu::Collective::any, mask, predicate != 0, -1).ballot != 0;
}
inline int __all_sync(unsigned mask, int predicate) {
    const pt_emu::WarpResult r = pt_emu::warp_collective(pt_emu::Collective::all, mask, predicate != 0, -1);
    return r.ballot == r.mask;
}
inline unsigned __activemask() { return pt_emu::live_lanes(); }

// ---- atomics -----------------------------------------------------------------------------------
// Blocks of one launch may run on several OS threads, so these are real atomic instructions.
// Relaxed, like CUDA's atomics; __threadfence orders the rest.
namespace pt_emu {
// Read-modify-write by compare-and-swap, for the operations with no instruction of their own.
template <class T, class F>
T atomic_update(T* p, F f) {
    T old, desired;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    do {
        desired = f(old);
    } while (!__atomic_compare_exchange(p, &old, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
}
}  // namespace pt_emu

inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) {
    return pt_emu::atomic_update(p, [v](float old) { return old + v; });
}
inline double atomicAdd(double* p, double v) {
    return pt_emu::atomic_update(p, [v](double old) { return old + v; });
}
inline int atomicSub(int* p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicSub(unsigned* p, unsigned v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline int atomicMax(int* p, int v) {
    return pt_emu::atomic_update(p, [v](int old) { return old > v ? old : v; });
}
inline unsigned atomicMax(unsigned* p, unsigned v) {
    return pt_emu::atomic_update(p, [v](unsigned old) { return old > v ? old : v; });
}
inline int atomicMin(int* p, int v) {
    return pt_emu::atomic_update(p, [v](int old) { return old < v ? old : v; });
}
inline unsigned atomicMin(unsigned* p, unsigned v) {
    return pt_emu::atomic_update(p, [v](unsigned old) { return old < v ? old : v; });
}
namespace pt_emu {
// Returns the old value whether or not it matched `compare`.
template <class T>
T compare_and_swap(T* p, T compare, T v) {
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return compare;
}
}  // namespace pt_emu
inline int atomicCAS(int* p, int compare, int v) { return pt_emu::compare_and_swap(p, compare, v); }
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned v) { return pt_emu::compare_and_swap(p, compare, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long compare, unsigned long long v) {
    return pt_emu::compare_and_swap(p, compare, v);
}
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
inline float atomicExch(float* p, float v) {
    float old;
    __atomic_exchange(p, &v, &old, __ATOMIC_RELAXED);
    return old;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
// The block's fibers share an OS thread: keeping the compiler from reordering is enough.
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

// ---- math --------------------------------------------------------------------------------------
// expf, logf, tanhf, erff, fmaxf, isnan, INFINITY, ... come from <cmath>/<math.h>; these are
// CUDA's own. The fast intrinsics are computed exactly: kernels must not depend on their error.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }

inline int __float_as_int(float f) { return __builtin_bit_cast(int, f); }
inline float __int_as_float(int i) { return __builtin_bit_cast(float, i); }
inline unsigned __float_as_uint(float f) { return __builtin_bit_cast(unsigned, f); }
inline float __uint_as_float(unsigned u) { return __builtin_bit_cast(float, u); }

// CUDA's min/max: integers of mixed signedness compare as the common type (so unsigned wins),
// floating point ignores a NaN operand like fminf/fmaxf.
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
std::common_type_t<A, B> min(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return std::fmin(T(a), T(b));
    else return T(a) < T(b) ? T(a) : T(b);
}
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
std::common_type_t<A, B> max(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return std::fmax(T(a), T(b));
    else return T(a) < T(b) ? T(b) : T(a);
}

// ---- bf16 --------------------------------------------------------------------------------------
// The upper half of an IEEE f32, as in <cuda_bf16.h>.
struct __nv_bfloat16 {
    unsigned short __x;
};
static_assert(sizeof(__nv_bfloat16) == 2 && std::is_trivially_copyable_v<__nv_bfloat16>);

// Round to nearest even, like cvt.rn.bf16.f32: overflow gives ±inf, every NaN the canonical 0x7fff.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
    return {static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float(static_cast<unsigned>(b.__x) << 16); }
// The raw bits, as <cuda_bf16.h> gives them (for packing two values into one 32-bit word).
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }

// ---- vector types ------------------------------------------------------------------------------
// CUDA's built-in uint2/uint4/float2/float4 with their alignment, so that a load through a cast
// pointer moves 8 or 16 bytes at once and a misaligned one is as wrong as on the GPU (ASan and
// UBSan see it). may_alias: kernels read bf16 and f32 arrays through them, as CUDA code does,
// and g++'s type-based alias analysis must not reorder those accesses around the typed ones.
struct __attribute__((aligned(8), may_alias)) uint2 {
    unsigned x, y;
};
struct __attribute__((aligned(16), may_alias)) uint4 {
    unsigned x, y, z, w;
};
struct __attribute__((aligned(8), may_alias)) float2 {
    float x, y;
};
struct __attribute__((aligned(16), may_alias)) float4 {
    float x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// ---- wmma (bf16 inputs, f32 accumulator, 16×16×16) ---------------------------------------------
namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

// Every lane holds the whole tile, row-major: x[row * 16 + col].
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulator has 16x16x16 fragments only");
    static_assert(std::is_same_v<T, std::conditional_t<std::is_same_v<Use, accumulator>, float, __nv_bfloat16>>,
                  "matrix_a/matrix_b fragments hold __nv_bfloat16, accumulators float");
    enum { num_elements = 256 };
    T x[num_elements];
};

// `v` is not deduced (common_type_t<T> is T), so fill_fragment(acc, 0) converts 0 to float.
template <class Use, class T, class Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, const std::common_type_t<T>& v) {
    for (T& e : f.x) e = v;
}

}  // namespace nvcuda::wmma

namespace pt_emu {
// Loads and stores address memory as the GPU does (a 256-bit aligned tile, rows 16-byte
// multiples apart) and, being `_sync`, are warp collectives: every lane of the warp takes part.
inline void wmma_memory_access(Collective op, const char* name, const void* p, unsigned ldm, std::size_t element) {
    if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) fail("%s: the tile pointer %p is not 32-byte aligned", name, p);
    if (ldm * element % 16 != 0) fail("%s: ldm %u is not a multiple of 16 bytes", name, ldm);
    warp_collective(op, 0xffffffffu, 0, -1);
}
}  // namespace pt_emu

namespace nvcuda::wmma {

template <class Use, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p, unsigned ldm) {
    static_assert(std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>,
                  "matrix_a/matrix_b fragments need a row_major or col_major layout");
    pt_emu::wmma_memory_access(pt_emu::Collective::wmma_load, "wmma::load_matrix_sync", p, ldm, sizeof *p);
    constexpr bool row = std::is_same_v<Layout, row_major>;
    for (unsigned r = 0; r < 16; ++r)
        for (unsigned c = 0; c < 16; ++c) f.x[r * 16 + c] = row ? p[r * ldm + c] : p[c * ldm + r];
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t layout) {
    pt_emu::wmma_memory_access(pt_emu::Collective::wmma_load, "wmma::load_matrix_sync", p, ldm, sizeof *p);
    for (unsigned r = 0; r < 16; ++r)
        for (unsigned c = 0; c < 16; ++c) f.x[r * 16 + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t layout) {
    pt_emu::wmma_memory_access(pt_emu::Collective::wmma_store, "wmma::store_matrix_sync", p, ldm, sizeof *p);
    for (unsigned r = 0; r < 16; ++r)
        for (unsigned c = 0; c < 16; ++c) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * 16 + c];
}

// d = a·b + c with f32 accumulation (a bf16 product is exact in f32); d may be c.
// Every lane of a warp holds the same fragments, so the product is computed once per warp and
// the other lanes copy it: a per-warp memo of the last inputs and result (a pure function, so a
// hit is always right; comparing 2 KiB costs far less than 4096 multiply-adds).
struct MmaMemo {
    bool valid;
    __nv_bfloat16 a[256], b[256];
    float c[256], d[256];
};
inline thread_local MmaMemo mma_memo[32];

template <class LayoutA, class LayoutB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LayoutA>& a,
              const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LayoutB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
    pt_emu::warp_collective(pt_emu::Collective::wmma_mma, 0xffffffffu, 0, -1);
    const uint3& t = pt_emu::current.thread_idx;
    const dim3& bd = pt_emu::current.block_dim;
    MmaMemo& memo = mma_memo[((t.z * bd.y + t.y) * bd.x + t.x) / 32 % 32];
    if (memo.valid && std::memcmp(memo.a, a.x, sizeof memo.a) == 0 && std::memcmp(memo.b, b.x, sizeof memo.b) == 0 &&
        std::memcmp(memo.c, c.x, sizeof memo.c) == 0) {
        std::memcpy(d.x, memo.d, sizeof memo.d);
        return;
    }
    std::memcpy(memo.a, a.x, sizeof memo.a);
    std::memcpy(memo.b, b.x, sizeof memo.b);
    std::memcpy(memo.c, c.x, sizeof memo.c);
    float bf[256], acc[256];
    for (int i = 0; i < 256; ++i) bf[i] = __bfloat162float(b.x[i]);
    std::memcpy(acc, c.x, sizeof acc);
    for (int m = 0; m < 16; ++m)
        for (int k = 0; k < 16; ++k) {
            const float am = __bfloat162float(a.x[m * 16 + k]);
            for (int n = 0; n < 16; ++n) acc[m * 16 + n] += am * bf[k * 16 + n];
        }
    std::memcpy(memo.d, acc, sizeof acc);
    memo.valid = true;
    std::memcpy(d.x, acc, sizeof acc);
}

}  // namespace nvcuda::wmma

// ---- kernel registration -----------------------------------------------------------------------
namespace pt_emu {
// Calls Kernel with the arguments of a driver launch: params[i] points at the i-th argument.
template <auto Kernel, class Signature = decltype(Kernel)>
struct Trampoline;
template <auto Kernel, class... Args>
struct Trampoline<Kernel, void (*)(Args...)> {
    static void launch(void** params) { call(params, std::index_sequence_for<Args...>{}); }
    template <std::size_t... I>
    static void call(void** params, std::index_sequence<I...>) {
        Kernel(*static_cast<Args*>(params[I])...);
    }
};
struct Registrar {
    Registrar(const char* name, void (*launch)(void**), unsigned max_threads) {
        register_kernel(name, launch, max_threads);
    }
};
}  // namespace pt_emu

// After including a .cu, once per extern "C" kernel with its launch bound's first argument, as
// the file writes it, or 0 (build.rs writes these lines).
#define PT_EMU_REGISTER(name, max_threads) \
    static const ::pt_emu::Registrar pt_emu_registrar_##name(#name, &::pt_emu::Trampoline<&name>::launch, max_threads);
