// elementwise.cu: maps over `n` elements, each a grid-stride loop (any grid covers any n) that
// loads through ld(), computes in f32 and stores through st(). Activation-typed kernels come
// as _f32 and _bf16 (see common.cuh); the reference is the `cpu` backend (src/ops/*.rs).
//
//   fill_{f32,bf16}(x, n, v)                         x = v             (Device::fill, poisoning)
//   cast_f32_to_bf16(dst, src, n), cast_bf16_to_f32  dst = src         (Device::copy across types)
//   scale_{f32,bf16}(x, n, s)                        x *= s            (gradient clipping)
//   gelu_{erf,tanh}_forward_*(out, inp, n)           out = gelu(inp)   (src/ops/gelu.rs)
//   gelu_{erf,tanh}_backward_*(dinp, inp, dout, n)   dinp = gelu'(inp)·dout
//   tanh_forward_*(out, inp, n)                      out = tanh(inp)   (src/ops/tanh.rs)
//   tanh_backward_*(dinp, out, dout, n)              dinp = (1 − out²)·dout
//   residual_forward_*(out, a, b, n)                 out = a + b       (src/ops/residual.rs)
//   residual_backward_*(dacc, dout, n)               dacc += dout
//   dropout_*(dst, src, n, seed, offset, row, stride, threshold, scale) (src/ops/dropout.rs)
//                                                    dst = keep ? src·scale : 0, forward and backward
//   copy_rows_*(dst, src, n, len, dst_offset, dst_stride, src_offset, src_stride, accumulate)
//                                                    runs of len elements, = or += (src/ops/rows.rs)
//
// Device helpers are `static`: the emulator links every kernel file into one library, where two
// files' same-named helpers would otherwise silently share one definition.
#include "common.cuh"


// ---- fill, cast, scale -----------------------------------------------------------------------

template <typename T>
static __device__ void fill(T* x, int n, float v) {
    GRID_STRIDE(i, n) st(x, i, v);
}
extern "C" __global__ void fill_f32(float* x, int n, float v) { fill(x, n, v); }
extern "C" __global__ void fill_bf16(bf16* x, int n, float v) { fill(x, n, v); }

template <typename src_t, typename dst_t>
static __device__ void cast(dst_t* dst, const src_t* src, int n) {
    GRID_STRIDE(i, n) st(dst, i, ld(src, i));
}
extern "C" __global__ void cast_f32_to_bf16(bf16* dst, const float* src, int n) { cast(dst, src, n); }
extern "C" __global__ void cast_bf16_to_f32(float* dst, const bf16* src, int n) { cast(dst, src, n); }

template <typename T>
static __device__ void scale(T* x, int n, float s) {
    GRID_STRIDE(i, n) st(x, i, ld(x, i) * s);
}
extern "C" __global__ void scale_f32(float* x, int n, float s) { scale(x, n, s); }
extern "C" __global__ void scale_bf16(bf16* x, int n, float s) { scale(x, n, s); }

// ---- GELU ------------------------------------------------------------------------------------
// The same formulas, in the same evaluation order, as src/ops/gelu.rs.

#define FRAC_1_SQRT_2 0.70710678118654752f    // 1/√2
#define FRAC_1_SQRT_2PI 0.39894228040143268f  // 1/√(2π) = φ(0)
#define SQRT_2_OVER_PI 0.79788456080286536f   // √(2/π)
#define TANH_CUBIC 0.044715f

// Exact form: x·Φ(x) = x/2·(1 + erf(x/√2)).
static __device__ __forceinline__ float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * FRAC_1_SQRT_2)); }
// Φ(x) + x·φ(x).
static __device__ __forceinline__ float gelu_erf_grad(float x) {
    const float cdf = 0.5f * (1.0f + erff(x * FRAC_1_SQRT_2));
    const float pdf = FRAC_1_SQRT_2PI * expf(-0.5f * x * x);
    return cdf + x * pdf;
}
// Tanh form through (1 + tanh u)/2 = σ(2u) = 1/(1 + e), e = exp(−2u): one expf, and 1 − σ = e·σ
// needs no cancelling subtraction. 2u is floored at −80 so e stays finite.
static __device__ __forceinline__ float tanh_form_e(float x) {
    const float two_u = (2.0f * SQRT_2_OVER_PI) * (x + TANH_CUBIC * (x * x) * x);
    return expf(-fmaxf(two_u, -80.0f));
}
static __device__ __forceinline__ float gelu_tanh(float x) { return x / (1.0f + tanh_form_e(x)); }
// The exact derivative of gelu_tanh: σ + 2x·u'·(e·σ)·σ, with e·σ = 1 − σ ≤ 1 formed first
// (2x·u'·e alone overflows from about x = −31).
static __device__ __forceinline__ float gelu_tanh_grad(float x) {
    const float e = tanh_form_e(x);
    const float du = SQRT_2_OVER_PI * (1.0f + (3.0f * TANH_CUBIC) * (x * x));
    const float s = 1.0f / (1.0f + e);
    const float es = e * s;
    return s + 2.0f * x * du * es * s;
}

// TANH_FORM selects the formula at compile time, so each kernel's loop is branch-free.
template <bool TANH_FORM, typename act_t>
static __device__ void gelu_forward(act_t* out, const act_t* inp, int n) {
    GRID_STRIDE(i, n) {
        const float x = ld(inp, i);
        st(out, i, TANH_FORM ? gelu_tanh(x) : gelu_erf(x));
    }
}
template <bool TANH_FORM, typename act_t>
static __device__ void gelu_backward(act_t* dinp, const act_t* inp, const act_t* dout, int n) {
    GRID_STRIDE(i, n) {
        const float x = ld(inp, i);
        st(dinp, i, (TANH_FORM ? gelu_tanh_grad(x) : gelu_erf_grad(x)) * ld(dout, i));
    }
}
extern "C" __global__ void gelu_erf_forward_f32(float* out, const float* inp, int n) { gelu_forward<false>(out, inp, n); }
extern "C" __global__ void gelu_erf_forward_bf16(bf16* out, const bf16* inp, int n) { gelu_forward<false>(out, inp, n); }
extern "C" __global__ void gelu_tanh_forward_f32(float* out, const float* inp, int n) { gelu_forward<true>(out, inp, n); }
extern "C" __global__ void gelu_tanh_forward_bf16(bf16* out, const bf16* inp, int n) { gelu_forward<true>(out, inp, n); }
extern "C" __global__ void gelu_erf_backward_f32(float* dinp, const float* inp, const float* dout, int n) { gelu_backward<false>(dinp, inp, dout, n); }
extern "C" __global__ void gelu_erf_backward_bf16(bf16* dinp, const bf16* inp, const bf16* dout, int n) { gelu_backward<false>(dinp, inp, dout, n); }
extern "C" __global__ void gelu_tanh_backward_f32(float* dinp, const float* inp, const float* dout, int n) { gelu_backward<true>(dinp, inp, dout, n); }
extern "C" __global__ void gelu_tanh_backward_bf16(bf16* dinp, const bf16* inp, const bf16* dout, int n) { gelu_backward<true>(dinp, inp, dout, n); }

// ---- tanh (the BERT pooler); the backward uses the saved output ------------------------------

template <typename act_t>
static __device__ void tanh_forward(act_t* out, const act_t* inp, int n) {
    GRID_STRIDE(i, n) st(out, i, tanhf(ld(inp, i)));
}
template <typename act_t>
static __device__ void tanh_backward(act_t* dinp, const act_t* out, const act_t* dout, int n) {
    GRID_STRIDE(i, n) {
        const float y = ld(out, i);
        st(dinp, i, (1.0f - y * y) * ld(dout, i));
    }
}
extern "C" __global__ void tanh_forward_f32(float* out, const float* inp, int n) { tanh_forward(out, inp, n); }
extern "C" __global__ void tanh_forward_bf16(bf16* out, const bf16* inp, int n) { tanh_forward(out, inp, n); }
extern "C" __global__ void tanh_backward_f32(float* dinp, const float* out, const float* dout, int n) { tanh_backward(dinp, out, dout, n); }
extern "C" __global__ void tanh_backward_bf16(bf16* dinp, const bf16* out, const bf16* dout, int n) { tanh_backward(dinp, out, dout, n); }

// ---- residual: the backward adds one branch's gradient onto the other's ----------------------

template <typename act_t>
static __device__ void residual_forward(act_t* out, const act_t* a, const act_t* b, int n) {
    GRID_STRIDE(i, n) st(out, i, ld(a, i) + ld(b, i));
}
template <typename act_t>
static __device__ void residual_backward(act_t* dacc, const act_t* dout, int n) {
    GRID_STRIDE(i, n) st(dacc, i, ld(dacc, i) + ld(dout, i));
}
extern "C" __global__ void residual_forward_f32(float* out, const float* a, const float* b, int n) { residual_forward(out, a, b, n); }
extern "C" __global__ void residual_forward_bf16(bf16* out, const bf16* a, const bf16* b, int n) { residual_forward(out, a, b, n); }
extern "C" __global__ void residual_backward_f32(float* dacc, const float* dout, int n) { residual_backward(dacc, dout, n); }
extern "C" __global__ void residual_backward_bf16(bf16* dacc, const bf16* dout, int n) { residual_backward(dacc, dout, n); }

// ---- dropout ---------------------------------------------------------------------------------
// The mask is recomputed from the element's counter, never stored, so the forward and the
// backward are this one kernel. Element i draws offset + ⌊i/row⌋·stride + i mod row (rows of a
// token slice skip the positions outside it: src/ops/dropout.rs `DropoutCoords`). `threshold`
// (p·2⁶⁴) and `scale` (1/(1−p) rounded to f32) come from the host, where the cpu backend computes
// them too.

template <typename act_t>
static __device__ void dropout(act_t* dst, const act_t* src, int n, unsigned long long seed, unsigned long long offset,
                               unsigned int row, unsigned long long stride, unsigned long long threshold, float scale) {
    GRID_STRIDE(i, n) {
        const unsigned int u = (unsigned int)i;
        const unsigned long long counter = offset + (unsigned long long)(u / row) * stride + (u % row);
        const bool keep = dropout_keep(seed, counter, threshold);
        st(dst, i, keep ? ld(src, i) * scale : 0.0f);
    }
}
extern "C" __global__ void dropout_f32(float* dst, const float* src, int n, unsigned long long seed, unsigned long long offset, unsigned int row, unsigned long long stride, unsigned long long threshold, float scale) { dropout(dst, src, n, seed, offset, row, stride, threshold, scale); }
extern "C" __global__ void dropout_bf16(bf16* dst, const bf16* src, int n, unsigned long long seed, unsigned long long offset, unsigned int row, unsigned long long stride, unsigned long long threshold, float scale) { dropout(dst, src, n, seed, offset, row, stride, threshold, scale); }

// ---- strided row copies ----------------------------------------------------------------------
// n = runs·len threads' worth of elements; element e of run r moves src[src_offset + r·src_stride
// + e] to dst[dst_offset + r·dst_stride + e] (added when `accumulate`). Runs never overlap in dst,
// so each destination element has one writer. The mixed kernels keep a sum of bf16 pieces in f32
// (TeraPipe's key/value gradient, added to by every later token slice) and read it back as bf16.

template <typename dst_t, typename src_t>
static __device__ void copy_rows(dst_t* dst, const src_t* src, int n, int len, int dst_offset, int dst_stride,
                                 int src_offset, int src_stride, int accumulate) {
    GRID_STRIDE(i, n) {
        const int r = i / len, e = i % len;
        const int d = dst_offset + r * dst_stride + e;
        const float v = ld(src, src_offset + r * src_stride + e);
        st(dst, d, accumulate ? ld(dst, d) + v : v);
    }
}
extern "C" __global__ void copy_rows_f32(float* dst, const float* src, int n, int len, int dst_offset, int dst_stride, int src_offset, int src_stride, int accumulate) { copy_rows(dst, src, n, len, dst_offset, dst_stride, src_offset, src_stride, accumulate); }
extern "C" __global__ void copy_rows_bf16(bf16* dst, const bf16* src, int n, int len, int dst_offset, int dst_stride, int src_offset, int src_stride, int accumulate) { copy_rows(dst, src, n, len, dst_offset, dst_stride, src_offset, src_stride, accumulate); }
extern "C" __global__ void copy_rows_bf16_to_f32(float* dst, const bf16* src, int n, int len, int dst_offset, int dst_stride, int src_offset, int src_stride, int accumulate) { copy_rows(dst, src, n, len, dst_offset, dst_stride, src_offset, src_stride, accumulate); }
extern "C" __global__ void copy_rows_f32_to_bf16(bf16* dst, const float* src, int n, int len, int dst_offset, int dst_stride, int src_offset, int src_stride, int accumulate) { copy_rows(dst, src, n, len, dst_offset, dst_stride, src_offset, src_stride, accumulate); }
