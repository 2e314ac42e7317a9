// attention.cu: fused multi-head attention (src/ops/attention.rs), FlashAttention-2 style: the
// forward streams key tiles through an online softmax and saves one log-sum-exp per query row;
// the backward recomputes the probabilities from it. No q_len × kv_len matrix is ever stored.
//
// Layout: q, out, dout, dq [batch, q_len, heads·hd]; k, v, dk, dv [batch, kv_len, heads·hd]
// (heads interleaved in the channels); key_mask u32 [batch, kv_len] (0 hides the key) or null;
// lse f32 [batch, heads, q_len], +∞ for a query that sees no key. Query i sits at absolute
// position prefix + i (prefix = kv_len − q_len); under the causal mask it sees keys j ≤ prefix + i.
// Attention dropout keeps element (b, h, i, j) iff dropout_keep(seed, offset +
// ((b·heads + h)·S + prefix + i)·S + j, threshold), scaling it by keep_scale = 1/(1−p): the
// element's place in the whole sequence's S × S mask (S = mask_seq ≥ kv_len), so a token slice
// draws the unsliced mask.
//
// Every kernel: grid (⌈rows/T⌉, batch, heads), block 4·T threads. A block owns T rows of one
// (sequence, head) and streams tiles of T rows of the other side through shared memory. Four
// consecutive threads (a quad, in one warp) share a row: for a streamed tile, thread t of the
// quad computes the scores of streamed rows t, t+4, …; for the row's own vector it holds the
// channels e ≡ t (mod 4) in registers. T = 32 for head_dim ≤ 64, 16 up to 128, which keeps the
// dynamic shared memory below 48 KiB (f32 tiles, row stride hd+1 so that the 8 rows a warp
// touches fall in different banks):
//
//   attention_forward_<act>(out, lse, q, k, v, MASK_AND_DIMS)          own: queries, streams: keys
//       shared (3·T·(hd+1) + T·(T+1) + T)·4 B
//   attention_backward_dq_<act>(dq, rowdot, dout, out, q, k, v, lse, MASK_AND_DIMS)
//       own: queries, streams: keys; also writes rowdot_i = dout_i·out_i for the next kernel
//       shared (4·T·(hd+1) + T·(T+1) + T)·4 B
//   attention_backward_dkdv_<act>(dk, dv, dout, q, k, v, lse, rowdot, MASK_AND_DIMS)
//       own: keys, streams: queries; launched after the dq kernel
//       shared (4·T·(hd+1) + 2·T·(T+1) + 2·T)·4 B
//
// Work per (sequence, head), with n visible (query, key) pairs: forward 4·n·hd FLOPs (q·k, p·v);
// backward 14·n·hd (the dq kernel q·k, dout·v, ds·k; the dk/dv kernel q·k, dout·v, ds·q, p·dout:
// scores and dout·v are computed twice rather than stored). Global traffic per (sequence, head):
// the owned side once, the streamed side once per owned tile, e.g. the forward reads
// (q_len + 2·⌈q_len/T⌉·kv_len)·hd activations (fewer under the causal mask) and writes
// q_len·hd + q_len·4 bytes. Every output element is accumulated by one thread in a fixed order:
// results are bitwise reproducible, with no atomics. File-local helpers carry an attn_ prefix:
// the emulator links every kernel file into one library, where same-named helpers would clash.

#include "common.cuh"

#define ATTN_MAX_HEAD_DIM 128
#define ATTN_MAX_TILE 32
#define ATTN_CHANNELS (ATTN_MAX_HEAD_DIM / 4)  // channels of a row one thread of its quad holds
#define ATTN_SCORES (ATTN_MAX_TILE / 4)        // scores of a streamed tile one thread computes

// The trailing parameters every attention kernel takes, and the struct they become.
#define MASK_AND_DIMS                                                                                  \
    const unsigned int *key_mask, int q_len, int kv_len, int heads, int head_dim, int causal, float scale, \
        float keep_scale, unsigned long long drop_threshold, unsigned long long drop_seed,                 \
        unsigned long long drop_offset, int mask_seq
#define MASK_AND_DIMS_ARGS                                                                                    \
    AttnParams(key_mask, q_len, kv_len, heads, head_dim, causal, scale, keep_scale, drop_threshold, drop_seed, \
               drop_offset, mask_seq)

struct AttnParams {
    const unsigned int* mask;
    int q_len, kv_len, heads, hd, prefix, b, h, mask_seq;
    bool causal;
    float scale, keep_scale;
    unsigned long long threshold, seed, offset;

    __device__ AttnParams(const unsigned int* key_mask, int q_len_, int kv_len_, int heads_, int head_dim,
                          int causal_, float scale_, float keep_scale_, unsigned long long threshold_,
                          unsigned long long seed_, unsigned long long offset_, int mask_seq_)
        : mask(key_mask), q_len(q_len_), kv_len(kv_len_), heads(heads_), hd(head_dim), prefix(kv_len_ - q_len_),
          b(blockIdx.y), h(blockIdx.z), mask_seq(mask_seq_), causal(causal_ != 0), scale(scale_),
          keep_scale(keep_scale_), threshold(threshold_), seed(seed_), offset(offset_) {}

    // Row `bh·q_len + i` of the per-row statistics (lse, rowdot).
    __device__ int stat(int i) const { return (b * heads + h) * q_len + i; }
    // Whether key j of this sequence exists and is not padding.
    __device__ bool key_ok(int j) const { return j < kv_len && (mask == nullptr || mask[b * kv_len + j] != 0); }
    // Whether query i (< q_len) may see key j, given key_ok(j): the causal mask.
    __device__ bool in_window(int i, int j) const { return !causal || j <= prefix + i; }
    // Keys [0, keys_end(i)) hold every key query i may see.
    __device__ int keys_end(int i) const { return causal ? prefix + i + 1 : kv_len; }
    // The dropout factor of probability (i, j): keep_scale or 0. keep_scale is 1 without dropout.
    __device__ float drop(int i, int j) const {
        if (threshold == 0) return keep_scale;
        const unsigned long long s = (unsigned long long)mask_seq;
        const unsigned long long counter =
            offset + ((unsigned long long)(b * heads + h) * s + (unsigned long long)(prefix + i)) * s + j;
        return dropout_keep(seed, counter, threshold) ? keep_scale : 0.0f;
    }
};

// Copies rows [r0, r0+T) of this head of x [batch, len, heads·hd] into dst [T][hd+1] as f32, with
// zeros past `len`. Consecutive threads read consecutive channels.
template <typename act_t>
__device__ __forceinline__ void attn_load_rows(float* dst, const act_t* x, int len, int r0, const AttnParams& a) {
    const int T = blockDim.x / 4, hd = a.hd, channels = a.heads * hd;
    BLOCK_STRIDE(idx, T * hd) {
        const int r = idx / hd, e = idx % hd, row = r0 + r;
        dst[r * (hd + 1) + e] = row < len ? ld(x, (a.b * len + row) * channels + a.h * hd + e) : 0.0f;
    }
}

// Σ_e x[e]·y[e] over one head's channels (rows of shared tiles).
__device__ __forceinline__ float attn_dot(const float* x, const float* y, int hd) {
    float s = 0.0f;
    for (int e = 0; e < hd; e++) s = fmaf(x[e], y[e], s);
    return s;
}

// Loop order. A thread's output channels (e ≡ t mod 4), and in the forward its scores (one row
// against streamed rows t, t+4, …), are independent sums: each is accumulated in one order by
// one fmaf chain, but the chains are interleaved, the loop over channels or scores innermost,
// so that one shared-memory load serves every chain and the chains' FMAs overlap. Measured on
// an H200 (docs/PERF.md, 2026-11-28): forward 147 → 110 µs, backward 362 → 307 µs at MiniLM's
// shape. The backward's scores stay one dot product at a time: interleaving their two dots
// raised the dq kernel from 72 to 95 registers and made the backward slower (376 µs). Each
// sum's terms are taken in the same order either way.

// Sum over the quad (lanes 4q..4q+3); every lane gets the same bits (fp addition commutes).
__device__ __forceinline__ float attn_quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}
__device__ __forceinline__ float attn_quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF (__int_as_float(0x7f800000))

// ---- forward ----------------------------------------------------------------------------------
// Query row i keeps a running max m, a running sum l of exp(s − m) (undropped: the softmax
// normaliser) and the output accumulator o = Σ exp(s − m)·drop·v, all rescaled by exp(m_old −
// m_new) when a tile raises the max. At the end out_i = o / l and lse_i = m + log l.
template <typename act_t>
__device__ void attention_forward(act_t* out, float* lse, const act_t* q, const act_t* k, const act_t* v,
                                  const AttnParams& a) {
    const int T = blockDim.x / 4, hd = a.hd, rs = hd + 1, ps_rs = T + 1;
    DYNAMIC_SHARED(float, smem);
    float* qs = smem;              // [T][hd+1] this block's queries
    float* ks = qs + T * rs;       // [T][hd+1] the current key tile
    float* vs = ks + T * rs;       // [T][hd+1]
    float* ps = vs + T * rs;       // [T][T+1]  dropped probabilities of the tile, row = query
    float* kok = ps + T * ps_rs;   // [T]       1 where the tile's key exists and is not padding
    const int r = threadIdx.x / 4, t = threadIdx.x % 4, q0 = blockIdx.x * T, i = q0 + r;
    const bool row_ok = i < a.q_len;

    attn_load_rows(qs, q, a.q_len, q0, a);
    const int last = (q0 + T < a.q_len ? q0 + T : a.q_len) - 1;
    const int kv_end = a.keys_end(last);  // no query of the block sees a key past this
    float m = NEG_INF, l = 0.0f, o[ATTN_CHANNELS];
#pragma unroll
    for (int c = 0; c < ATTN_CHANNELS; c++) o[c] = 0.0f;

    for (int k0 = 0; k0 < kv_end; k0 += T) {
        __syncthreads();  // the previous tile is consumed (and, the first time, qs is complete)
        attn_load_rows(ks, k, a.kv_len, k0, a);
        attn_load_rows(vs, v, a.kv_len, k0, a);
        if (threadIdx.x < T) kok[threadIdx.x] = a.key_ok(k0 + threadIdx.x) ? 1.0f : 0.0f;
        __syncthreads();

        // Scores of keys t, t+4, … of the tile (4c < T: T is a multiple of 4); −∞ where hidden.
        float s[ATTN_SCORES], tile_max = NEG_INF;
#pragma unroll
        for (int c = 0; c < ATTN_SCORES; c++) s[c] = 0.0f;
        for (int e = 0; e < hd; e++) {
            const float qe = qs[r * rs + e];
#pragma unroll
            for (int c = 0; c < ATTN_SCORES; c++) {
                if (4 * c >= T) break;
                s[c] = fmaf(qe, ks[(t + 4 * c) * rs + e], s[c]);
            }
        }
#pragma unroll
        for (int c = 0; c < ATTN_SCORES; c++) {
            const int jj = t + 4 * c;
            s[c] = jj < T && row_ok && kok[jj] != 0.0f && a.in_window(i, k0 + jj) ? s[c] * a.scale : NEG_INF;
            tile_max = fmaxf(tile_max, s[c]);
        }
        const float m_new = fmaxf(m, attn_quad_max(tile_max));
        // exp(m − m_new) rescales what is accumulated; while the row has seen no key there is
        // nothing to rescale (and −∞ − −∞ would be NaN).
        const float alpha = m_new == NEG_INF ? 1.0f : expf(m - m_new);
        m = m_new;
        l *= alpha;
#pragma unroll
        for (int c = 0; c < ATTN_SCORES; c++) {
            const int jj = t + 4 * c;
            if (jj < T) {
                const float p = s[c] == NEG_INF ? 0.0f : expf(s[c] - m);
                l += p;
                ps[r * ps_rs + jj] = p == 0.0f ? 0.0f : p * a.drop(i, k0 + jj);
            }
        }
        __syncwarp();  // the quad's probabilities are in ps
#pragma unroll
        for (int c = 0; c < ATTN_CHANNELS; c++) o[c] *= alpha;
        for (int jj = 0; jj < T; jj++) {
            const float p = ps[r * ps_rs + jj];
#pragma unroll
            for (int c = 0; c < ATTN_CHANNELS; c++) {
                if (4 * c >= hd) break;
                if (t + 4 * c < hd) o[c] = fmaf(p, vs[jj * rs + t + 4 * c], o[c]);
            }
        }
    }
    l = attn_quad_sum(l);
    if (row_ok) {
        const int base = (a.b * a.q_len + i) * a.heads * hd + a.h * hd;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;  // l = 0: the query sees no key, out = 0
#pragma unroll
        for (int c = 0; c < ATTN_CHANNELS; c++) {
            const int e = t + 4 * c;
            if (e < hd) st(out, base + e, o[c] * inv);
        }
        if (t == 0) lse[a.stat(i)] = l > 0.0f ? m + logf(l) : POS_INF;
    }
}

// ---- backward ---------------------------------------------------------------------------------
// With P = exp(s − lse) (recomputed), Z the dropout factors and D_i = dout_i·out_i
// (= Σ_j P_ij·Z_ij·(dout_i·v_j), the softmax's row term):
//   dv_j = Σ_i P_ij·Z_ij·dout_i,   dS_ij = P_ij·(Z_ij·(dout_i·v_j) − D_i)·scale,
//   dq_i = Σ_j dS_ij·k_j,          dk_j = Σ_i dS_ij·q_i.
// dq is owned by query tiles, dk and dv by key tiles: two kernels, each output written once.

// dq and rowdot: the block's queries and their output gradients stay in shared memory while
// key tiles stream past.
template <typename act_t>
__device__ void attention_backward_dq(act_t* dq, float* rowdot, const act_t* dout, const act_t* out, const act_t* q,
                                      const act_t* k, const act_t* v, const float* lse, const AttnParams& a) {
    const int T = blockDim.x / 4, hd = a.hd, rs = hd + 1, ds_rs = T + 1;
    DYNAMIC_SHARED(float, smem);
    float* qs = smem;              // [T][hd+1] this block's queries
    float* dos = qs + T * rs;      // [T][hd+1] and their output gradients
    float* ks = dos + T * rs;      // [T][hd+1] the current key tile
    float* vs = ks + T * rs;       // [T][hd+1]
    float* dss = vs + T * rs;      // [T][T+1]  dS of the tile, row = query
    float* kok = dss + T * ds_rs;  // [T]       1 where the tile's key exists and is not padding
    const int r = threadIdx.x / 4, t = threadIdx.x % 4, q0 = blockIdx.x * T, i = q0 + r;
    const bool row_ok = i < a.q_len;
    const int base = (a.b * a.q_len + i) * a.heads * hd + a.h * hd;

    attn_load_rows(qs, q, a.q_len, q0, a);
    attn_load_rows(dos, dout, a.q_len, q0, a);
    // D_i from global memory (the quad reads its row's channels e ≡ t), so no extra barrier.
    float d_part = 0.0f;
    if (row_ok)
        for (int e = t; e < hd; e += 4) d_part = fmaf(ld(dout, base + e), ld(out, base + e), d_part);
    const float d = attn_quad_sum(d_part);
    const float lse_i = row_ok ? lse[a.stat(i)] : POS_INF;
    if (row_ok && t == 0) rowdot[a.stat(i)] = d;

    const int last = (q0 + T < a.q_len ? q0 + T : a.q_len) - 1;
    const int kv_end = a.keys_end(last);
    float acc[ATTN_CHANNELS];
#pragma unroll
    for (int c = 0; c < ATTN_CHANNELS; c++) acc[c] = 0.0f;

    for (int k0 = 0; k0 < kv_end; k0 += T) {
        __syncthreads();
        attn_load_rows(ks, k, a.kv_len, k0, a);
        attn_load_rows(vs, v, a.kv_len, k0, a);
        if (threadIdx.x < T) kok[threadIdx.x] = a.key_ok(k0 + threadIdx.x) ? 1.0f : 0.0f;
        __syncthreads();
#pragma unroll
        for (int c = 0; c < ATTN_SCORES; c++) {
            const int jj = t + 4 * c, j = k0 + jj;
            if (jj < T) {
                float ds = 0.0f;
                if (row_ok && kok[jj] != 0.0f && a.in_window(i, j)) {
                    const float p = expf(attn_dot(qs + r * rs, ks + jj * rs, hd) * a.scale - lse_i);
                    const float dp = attn_dot(dos + r * rs, vs + jj * rs, hd) * a.drop(i, j);
                    ds = p * (dp - d) * a.scale;
                }
                dss[r * ds_rs + jj] = ds;
            }
        }
        __syncwarp();
        for (int jj = 0; jj < T; jj++) {
            const float ds = dss[r * ds_rs + jj];
#pragma unroll
            for (int c = 0; c < ATTN_CHANNELS; c++) {
                if (4 * c >= hd) break;
                if (t + 4 * c < hd) acc[c] = fmaf(ds, ks[jj * rs + t + 4 * c], acc[c]);
            }
        }
    }
    if (row_ok) {
#pragma unroll
        for (int c = 0; c < ATTN_CHANNELS; c++) {
            const int e = t + 4 * c;
            if (e < hd) st(dq, base + e, acc[c]);
        }
    }
}

// dk and dv: the block's keys and values stay in shared memory while the query tiles that can
// see them stream past (under the causal mask, queries i ≥ j − prefix).
template <typename act_t>
__device__ void attention_backward_dkdv(act_t* dk, act_t* dv, const act_t* dout, const act_t* q, const act_t* k,
                                        const act_t* v, const float* lse, const float* rowdot, const AttnParams& a) {
    const int T = blockDim.x / 4, hd = a.hd, rs = hd + 1, ps_rs = T + 1;
    DYNAMIC_SHARED(float, smem);
    float* ks = smem;               // [T][hd+1] this block's keys
    float* vs = ks + T * rs;        // [T][hd+1] and values
    float* qs = vs + T * rs;        // [T][hd+1] the current query tile
    float* dos = qs + T * rs;       // [T][hd+1] and its output gradients
    float* pzs = dos + T * rs;      // [T][T+1]  P·Z of the tile, row = key
    float* dss = pzs + T * ps_rs;   // [T][T+1]  dS of the tile, row = key
    float* lses = dss + T * ps_rs;  // [T]       lse of the tile's queries
    float* rowdots = lses + T;      // [T]       rowdot of the tile's queries
    const int r = threadIdx.x / 4, t = threadIdx.x % 4, k0 = blockIdx.x * T, j = k0 + r;
    const bool key_ok = a.key_ok(j);

    attn_load_rows(ks, k, a.kv_len, k0, a);
    attn_load_rows(vs, v, a.kv_len, k0, a);
    float acc_k[ATTN_CHANNELS], acc_v[ATTN_CHANNELS];
#pragma unroll
    for (int c = 0; c < ATTN_CHANNELS; c++) acc_k[c] = acc_v[c] = 0.0f;

    const int q_begin = a.causal && k0 > a.prefix ? k0 - a.prefix : 0;
    for (int q0 = q_begin; q0 < a.q_len; q0 += T) {
        __syncthreads();
        attn_load_rows(qs, q, a.q_len, q0, a);
        attn_load_rows(dos, dout, a.q_len, q0, a);
        if (threadIdx.x < T) {
            const int i = q0 + threadIdx.x;
            lses[threadIdx.x] = i < a.q_len ? lse[a.stat(i)] : POS_INF;
            rowdots[threadIdx.x] = i < a.q_len ? rowdot[a.stat(i)] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < ATTN_SCORES; c++) {
            const int ii = t + 4 * c, i = q0 + ii;
            if (ii < T) {
                float pz = 0.0f, ds = 0.0f;
                if (key_ok && i < a.q_len && a.in_window(i, j)) {
                    const float p = expf(attn_dot(qs + ii * rs, ks + r * rs, hd) * a.scale - lses[ii]);
                    const float z = a.drop(i, j);
                    pz = p * z;
                    ds = p * (attn_dot(dos + ii * rs, vs + r * rs, hd) * z - rowdots[ii]) * a.scale;
                }
                pzs[r * ps_rs + ii] = pz;
                dss[r * ps_rs + ii] = ds;
            }
        }
        __syncwarp();
        for (int ii = 0; ii < T; ii++) {
            const float ds = dss[r * ps_rs + ii], pz = pzs[r * ps_rs + ii];
#pragma unroll
            for (int c = 0; c < ATTN_CHANNELS; c++) {
                if (4 * c >= hd) break;
                const int e = t + 4 * c;
                if (e < hd) {
                    acc_k[c] = fmaf(ds, qs[ii * rs + e], acc_k[c]);
                    acc_v[c] = fmaf(pz, dos[ii * rs + e], acc_v[c]);
                }
            }
        }
    }
    if (j < a.kv_len) {
        const int base = (a.b * a.kv_len + j) * a.heads * hd + a.h * hd;
#pragma unroll
        for (int c = 0; c < ATTN_CHANNELS; c++) {
            const int e = t + 4 * c;
            if (e < hd) {
                st(dk, base + e, acc_k[c]);
                st(dv, base + e, acc_v[c]);
            }
        }
    }
}

extern "C" __global__ void attention_forward_f32(float* out, float* lse, const float* q, const float* k,
                                                 const float* v, MASK_AND_DIMS) {
    attention_forward(out, lse, q, k, v, MASK_AND_DIMS_ARGS);
}
extern "C" __global__ void attention_forward_bf16(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                                                  MASK_AND_DIMS) {
    attention_forward(out, lse, q, k, v, MASK_AND_DIMS_ARGS);
}
extern "C" __global__ void attention_backward_dq_f32(float* dq, float* rowdot, const float* dout, const float* out,
                                                     const float* q, const float* k, const float* v,
                                                     const float* lse, MASK_AND_DIMS) {
    attention_backward_dq(dq, rowdot, dout, out, q, k, v, lse, MASK_AND_DIMS_ARGS);
}
extern "C" __global__ void attention_backward_dq_bf16(bf16* dq, float* rowdot, const bf16* dout, const bf16* out,
                                                      const bf16* q, const bf16* k, const bf16* v, const float* lse,
                                                      MASK_AND_DIMS) {
    attention_backward_dq(dq, rowdot, dout, out, q, k, v, lse, MASK_AND_DIMS_ARGS);
}
extern "C" __global__ void attention_backward_dkdv_f32(float* dk, float* dv, const float* dout, const float* q,
                                                       const float* k, const float* v, const float* lse,
                                                       const float* rowdot, MASK_AND_DIMS) {
    attention_backward_dkdv(dk, dv, dout, q, k, v, lse, rowdot, MASK_AND_DIMS_ARGS);
}
extern "C" __global__ void attention_backward_dkdv_bf16(bf16* dk, bf16* dv, const bf16* dout, const bf16* q,
                                                        const bf16* k, const bf16* v, const float* lse,
                                                        const float* rowdot, MASK_AND_DIMS) {
    attention_backward_dkdv(dk, dv, dout, q, k, v, lse, rowdot, MASK_AND_DIMS_ARGS);
}
