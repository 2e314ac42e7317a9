// common.cuh: what every kernel file includes first. The CUDA subset we write in
// (DESIGN.md §3): extern "C" __global__ kernels, no host headers, __syncthreads/__syncwarp,
// __shfl_*_sync, atomics, static and dynamic shared memory, wmma fragments for bf16.
//
// Compiled two ways:
//   - by NVRTC for the GPU (`cuda` backend): <cuda_bf16.h> and <mma.h> come from the CUDA
//     runtime headers installed by scripts/setup.sh;
//   - by the host C++ compiler for the emulator (`cuda-emu` backend): build.rs force-includes
//     emu/cuda_emu.h, which defines PT_EMU and everything below in plain C++.
//
// Types: `act_t`-templated kernels are instantiated twice, with `float` (suffix _f32) and `bf16`
// (suffix _bf16). Parameters, parameter gradients, optimizer state, input images, saved
// statistics (LayerNorm mean/rstd, attention log-sum-exp) and per-row losses are always `float`;
// activations and their gradients are `act_t`. Arithmetic is f32 in both instantiations: load
// with `ld`, store with `st`.
#pragma once

#ifndef PT_EMU
#include <cuda_bf16.h>
#include <mma.h>
#endif

typedef __nv_bfloat16 bf16;

// ---- loads and stores that widen to / round from f32 -----------------------------------------
__device__ __forceinline__ float ld(const float* p, int i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, int i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, int i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16* p, int i, float v) { p[i] = __float2bfloat16(v); }

// ---- dynamic shared memory ---------------------------------------------------------------------
// `extern __shared__` has no host equivalent, so kernels name their dynamic shared memory
// through this macro: DYNAMIC_SHARED(float, smem) declares `float* smem`.
#ifdef PT_EMU
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(pt_emu_dynamic_shared())
#else
#define DYNAMIC_SHARED(T, name)                      \
    extern __shared__ unsigned char pt_dyn_smem_[];  \
    T* name = reinterpret_cast<T*>(pt_dyn_smem_)
#endif

#define FULL_MASK 0xffffffffu

// A grid-stride loop over `n` elements: any grid covers any `n` below 2³¹. The step never forms
// i + stride past n, which for n within a stride of 2³¹ would wrap to a negative index.
#define GRID_STRIDE(i, n)                                                                         \
    for (int i = blockIdx.x * blockDim.x + threadIdx.x, i##_stride = blockDim.x * gridDim.x; i < (n); \
         i = (n) - i > i##_stride ? i + i##_stride : (n))

// A block-stride loop over `n` elements, one block's threads taking every blockDim.x-th: like
// GRID_STRIDE, the step never forms i + blockDim.x past n.
#define BLOCK_STRIDE(i, n) for (int i = threadIdx.x; i < (n); i = (n) - i > (int)blockDim.x ? i + (int)blockDim.x : (n))

// ---- warp and block reductions -----------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
// Sum over a 1-D block whose size is a multiple of 32 (≤ 1024); `scratch` is ≥ 32 floats of
// shared memory. Every thread gets the total. Ends with a barrier, so `scratch` may be reused.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -__int_as_float(0x7f800000);
    v = warp_max(v);
    __syncthreads();
    return v;
}

// ---- counter-based dropout mask: bit-identical to src/rng.rs `hash_u64` and
// src/ops/dropout.rs `dropout_keep` ----------------------------------------------------------------
__device__ __forceinline__ unsigned long long pt_mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned long long pt_hash_u64(unsigned long long seed, unsigned long long counter) {
    return pt_mix64(seed ^ pt_mix64(counter + 0x9E3779B97F4A7C15ull));
}
// `threshold` = (p as f64 · 2⁶⁴) as u64, computed on the host by `keep_threshold` in
// src/ops/dropout.rs, so the device needs no f64.
__device__ __forceinline__ bool dropout_keep(unsigned long long seed, unsigned long long counter,
                                             unsigned long long threshold) {
    return pt_hash_u64(seed, counter) >= threshold;
}
