// embedding.cu: what turns inputs into the first activations and the last activations into one
// vector per sequence; references src/ops/embedding.rs, patch.rs and pooling.rs. Tables, the
// class token and images are f32 (parameters and inputs); activations are act_t.
//
//   embedding_forward_{f32,bf16}(out, ids, table, n, dim, accumulate)    grid-stride over n = ids·dim
//       out[r, :] (=|+=) table[ids[r], :]
//   embedding_backward_{f32,bf16}(dtable, dout, order, seg_ids, seg_start, dim)
//       one block per distinct id v: dtable[v, :] += Σ dout[r, :] over the rows r that read v,
//       in increasing r (the host sorts the rows by id), so no two blocks touch the same row
//   patch_forward_{f32,bf16}(out, img, n, channels, height, width, patch) grid-stride over out
//   patch_backward_{f32,bf16}(dimg, dout, n, channels, height, width, patch) grid-stride over dimg
//   prepend_token_forward_{f32,bf16}(out, token, inp, n, seq, dim)       grid-stride over out
//   prepend_token_backward_token_{f32,bf16}(dtoken, dout, batch, seq, dim)  thread per column
//   prepend_token_backward_inp_{f32,bf16}(dinp, dout, n, seq, dim)       grid-stride over dinp
//   first_token_pool_forward_{f32,bf16}(out, inp, n, seq, dim)           grid-stride over out
//   first_token_pool_backward_{f32,bf16}(dinp, dout, n, seq, dim)        grid-stride over dinp
//   mean_pool_forward_{f32,bf16}(out, inp, mask, seq, dim)               one block per sequence
//   mean_pool_backward_{f32,bf16}(dinp, dout, mask, seq, dim)            one block per sequence
//
// Device helpers are `static`: the emulator links every kernel file into one library, where two
// files' same-named helpers would otherwise silently share one definition.
#include "common.cuh"


// ---- token, position and token-type embeddings ----------------------------------------------

// `accumulate`: word + position + type embeddings sum into one buffer.
template <typename act_t>
static __device__ void embedding_forward(act_t* out, const unsigned int* ids, const float* table, int n, int dim,
                                         int accumulate) {
    GRID_STRIDE(i, n) {
        const int r = i / dim, j = i - r * dim;
        const float v = table[(int)ids[r] * dim + j];
        st(out, i, accumulate ? ld(out, i) + v : v);
    }
}
// Block b owns table row seg_ids[b]; its rows are order[seg_start[b] .. seg_start[b + 1]]. Each
// thread carries its columns through the rows in that order: the same sum, in the same order,
// as the cpu's `*t += d` loop.
template <typename act_t>
static __device__ void embedding_backward(float* dtable, const act_t* dout, const unsigned int* order,
                                          const unsigned int* seg_ids, const unsigned int* seg_start, int dim) {
    const int v = seg_ids[blockIdx.x];
    const int begin = seg_start[blockIdx.x], end = seg_start[blockIdx.x + 1];
    float* row = dtable + v * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float acc = row[j];
        for (int k = begin; k < end; k++) acc += ld(dout, (int)order[k] * dim + j);
        row[j] = acc;
    }
}
extern "C" __global__ void embedding_forward_f32(float* out, const unsigned int* ids, const float* table, int n, int dim, int accumulate) { embedding_forward(out, ids, table, n, dim, accumulate); }
extern "C" __global__ void embedding_forward_bf16(bf16* out, const unsigned int* ids, const float* table, int n, int dim, int accumulate) { embedding_forward(out, ids, table, n, dim, accumulate); }
extern "C" __global__ void embedding_backward_f32(float* dtable, const float* dout, const unsigned int* order, const unsigned int* seg_ids, const unsigned int* seg_start, int dim) { embedding_backward(dtable, dout, order, seg_ids, seg_start, dim); }
extern "C" __global__ void embedding_backward_bf16(float* dtable, const bf16* dout, const unsigned int* order, const unsigned int* seg_ids, const unsigned int* seg_start, int dim) { embedding_backward(dtable, dout, order, seg_ids, seg_start, dim); }

// ---- ViT patches (im2col with stride = kernel = patch) ---------------------------------------

// Index of the image pixel that patch element `i` copies: `i` walks [batch, patch index,
// (channel, row, column)], the image is [batch, channels, height, width]. The forward gathers
// through it and the backward (patches do not overlap) scatters through it.
static __device__ __forceinline__ int patch_pixel(int i, int channels, int height, int width, int patch) {
    const int plen = channels * patch * patch, patches_x = width / patch;
    const int np = (height / patch) * patches_x;
    const int p = i / plen, k = i - p * plen;
    const int b = p / np, pi = p - b * np;
    const int py = pi / patches_x, px = pi - py * patches_x;
    const int c = k / (patch * patch), yx = k - c * patch * patch;
    const int y = yx / patch, x = yx - y * patch;
    return ((b * channels + c) * height + py * patch + y) * width + px * patch + x;
}
template <typename act_t>
static __device__ void patch_forward(act_t* out, const float* img, int n, int channels, int height, int width,
                                     int patch) {
    GRID_STRIDE(i, n) st(out, i, img[patch_pixel(i, channels, height, width, patch)]);
}
// Grid-stride over the patch elements too: every pixel belongs to exactly one patch element, so
// each dimg element is written once, and the reads of dout coalesce.
template <typename act_t>
static __device__ void patch_backward(float* dimg, const act_t* dout, int n, int channels, int height, int width,
                                      int patch) {
    GRID_STRIDE(i, n) dimg[patch_pixel(i, channels, height, width, patch)] = ld(dout, i);
}
extern "C" __global__ void patch_forward_f32(float* out, const float* img, int n, int channels, int height, int width, int patch) { patch_forward(out, img, n, channels, height, width, patch); }
extern "C" __global__ void patch_forward_bf16(bf16* out, const float* img, int n, int channels, int height, int width, int patch) { patch_forward(out, img, n, channels, height, width, patch); }
extern "C" __global__ void patch_backward_f32(float* dimg, const float* dout, int n, int channels, int height, int width, int patch) { patch_backward(dimg, dout, n, channels, height, width, patch); }
extern "C" __global__ void patch_backward_bf16(float* dimg, const bf16* dout, int n, int channels, int height, int width, int patch) { patch_backward(dimg, dout, n, channels, height, width, patch); }

// ---- ViT class token: out[b] = [token; inp[b]] -----------------------------------------------

template <typename act_t>
static __device__ void prepend_token_forward(act_t* out, const float* token, const act_t* inp, int n, int seq,
                                             int dim) {
    GRID_STRIDE(i, n) {
        const int r = i / dim, j = i - r * dim;  // r = b·(seq + 1) + t
        const int b = r / (seq + 1), t = r - b * (seq + 1);
        st(out, i, t == 0 ? token[j] : ld(inp, (b * seq + t - 1) * dim + j));
    }
}
// dtoken[j] += Σ_b dout[b, 0, j], b in order (the cpu's order).
template <typename act_t>
static __device__ void prepend_token_backward_token(float* dtoken, const act_t* dout, int batch, int seq, int dim) {
    GRID_STRIDE(j, dim) {
        float acc = dtoken[j];
        for (int b = 0; b < batch; b++) acc += ld(dout, b * (seq + 1) * dim + j);
        dtoken[j] = acc;
    }
}
// dinp[b, t, :] = dout[b, 1 + t, :].
template <typename act_t>
static __device__ void prepend_token_backward_inp(act_t* dinp, const act_t* dout, int n, int seq, int dim) {
    GRID_STRIDE(i, n) {
        const int b = i / (seq * dim);
        dinp[i] = dout[i + (b + 1) * dim];
    }
}
extern "C" __global__ void prepend_token_forward_f32(float* out, const float* token, const float* inp, int n, int seq, int dim) { prepend_token_forward(out, token, inp, n, seq, dim); }
extern "C" __global__ void prepend_token_forward_bf16(bf16* out, const float* token, const bf16* inp, int n, int seq, int dim) { prepend_token_forward(out, token, inp, n, seq, dim); }
extern "C" __global__ void prepend_token_backward_token_f32(float* dtoken, const float* dout, int batch, int seq, int dim) { prepend_token_backward_token(dtoken, dout, batch, seq, dim); }
extern "C" __global__ void prepend_token_backward_token_bf16(float* dtoken, const bf16* dout, int batch, int seq, int dim) { prepend_token_backward_token(dtoken, dout, batch, seq, dim); }
extern "C" __global__ void prepend_token_backward_inp_f32(float* dinp, const float* dout, int n, int seq, int dim) { prepend_token_backward_inp(dinp, dout, n, seq, dim); }
extern "C" __global__ void prepend_token_backward_inp_bf16(bf16* dinp, const bf16* dout, int n, int seq, int dim) { prepend_token_backward_inp(dinp, dout, n, seq, dim); }

// ---- pooling: first token ([CLS]) ------------------------------------------------------------

// out[b, :] = inp[b, 0, :]; `seq` ≥ 1.
template <typename act_t>
static __device__ void first_token_pool_forward(act_t* out, const act_t* inp, int n, int seq, int dim) {
    GRID_STRIDE(i, n) {
        const int b = i / dim, j = i - b * dim;
        out[i] = inp[b * seq * dim + j];
    }
}
// dinp[b, t, :] = t == 0 ? dout[b, :] : 0.
template <typename act_t>
static __device__ void first_token_pool_backward(act_t* dinp, const act_t* dout, int n, int seq, int dim) {
    GRID_STRIDE(i, n) {
        const int r = i / dim, j = i - r * dim;  // r = b·seq + t
        const int b = r / seq;
        st(dinp, i, r == b * seq ? ld(dout, b * dim + j) : 0.0f);
    }
}
extern "C" __global__ void first_token_pool_forward_f32(float* out, const float* inp, int n, int seq, int dim) { first_token_pool_forward(out, inp, n, seq, dim); }
extern "C" __global__ void first_token_pool_forward_bf16(bf16* out, const bf16* inp, int n, int seq, int dim) { first_token_pool_forward(out, inp, n, seq, dim); }
extern "C" __global__ void first_token_pool_backward_f32(float* dinp, const float* dout, int n, int seq, int dim) { first_token_pool_backward(dinp, dout, n, seq, dim); }
extern "C" __global__ void first_token_pool_backward_bf16(bf16* dinp, const bf16* dout, int n, int seq, int dim) { first_token_pool_backward(dinp, dout, n, seq, dim); }

// ---- pooling: masked mean over tokens --------------------------------------------------------

// 1/max(Σ_t m[t], 1) for block b's sequence, m = mask ≠ 0 (all ones without a mask), the same
// value the forward and the backward use. Every thread of the block calls it (a barrier inside).
static __device__ float mean_scale(const unsigned int* mask, int seq, float* scratch) {
    float count = seq;
    if (mask) {
        count = 0.0f;
        for (int t = threadIdx.x; t < seq; t += blockDim.x) count += mask[blockIdx.x * seq + t] != 0;
        count = block_sum(count, scratch);  // exact: counts are far below 2²⁴
    }
    return 1.0f / fmaxf(count, 1.0f);
}
// out[b, :] = Σ_t m[b,t]·inp[b, t, :] · mean_scale: each column summed over the tokens in order,
// then scaled once, as on the cpu.
template <typename act_t>
static __device__ void mean_pool_forward(act_t* out, const act_t* inp, const unsigned int* mask, int seq, int dim) {
    __shared__ float scratch[32];
    const int b = blockIdx.x;
    const float scale = mean_scale(mask, seq, scratch);
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < seq; t++)
            if (!mask || mask[b * seq + t]) acc += ld(inp, (b * seq + t) * dim + j);
        st(out, b * dim + j, acc * scale);
    }
}
// dinp[b, t, :] = m[b,t]·dout[b, :]·mean_scale.
template <typename act_t>
static __device__ void mean_pool_backward(act_t* dinp, const act_t* dout, const unsigned int* mask, int seq, int dim) {
    __shared__ float scratch[32];
    const int b = blockIdx.x;
    const float scale = mean_scale(mask, seq, scratch);
    BLOCK_STRIDE(i, seq * dim) {
        const int t = i / dim, j = i - t * dim;
        const bool real = !mask || mask[b * seq + t];
        st(dinp, b * seq * dim + i, real ? ld(dout, b * dim + j) * scale : 0.0f);
    }
}
extern "C" __global__ void mean_pool_forward_f32(float* out, const float* inp, const unsigned int* mask, int seq, int dim) { mean_pool_forward(out, inp, mask, seq, dim); }
extern "C" __global__ void mean_pool_forward_bf16(bf16* out, const bf16* inp, const unsigned int* mask, int seq, int dim) { mean_pool_forward(out, inp, mask, seq, dim); }
extern "C" __global__ void mean_pool_backward_f32(float* dinp, const float* dout, const unsigned int* mask, int seq, int dim) { mean_pool_backward(dinp, dout, mask, seq, dim); }
extern "C" __global__ void mean_pool_backward_bf16(bf16* dinp, const bf16* dout, const unsigned int* mask, int seq, int dim) { mean_pool_backward(dinp, dout, mask, seq, dim); }
