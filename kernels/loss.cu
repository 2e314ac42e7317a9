// loss.cu: softmax cross-entropy fused with its gradient (llm.c's fused classifier), reference
// src/ops/cross_entropy.rs. Probabilities are never stored.
//
//   cross_entropy_{f32,bf16}(losses, dlogits, logits, targets, vocab, ignore_index, grad_scale)
//       one block per row; losses are f32 (statistics); dlogits may be null (no gradient):
//       losses[r] = −log softmax(logits[r])[targets[r]]   (0 where targets[r] == ignore_index)
//       dlogits[r] = (softmax(logits[r]) − onehot(targets[r]))·grad_scale   (zeros where ignored)
//   Labels are validated on the host before the launch, so every non-ignored target < vocab.
//
// Device helpers are `static`: the emulator links every kernel file into one library, where two
// files' same-named helpers would otherwise silently share one definition.
#include "common.cuh"

template <typename act_t>
static __device__ void cross_entropy(float* losses, act_t* dlogits, const act_t* logits, const unsigned int* targets,
                                     int vocab, unsigned int ignore_index, float grad_scale) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const unsigned int target = targets[row];
    const act_t* x = logits + row * vocab;
    act_t* d = dlogits ? dlogits + row * vocab : dlogits;
    if (target == ignore_index) {  // the same branch for the whole block
        if (d)
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) st(d, j, 0.0f);
        if (threadIdx.x == 0) losses[row] = 0.0f;
    } else {
        // One pass for the max and Σ exp(x − max) together (online softmax): each thread keeps
        // its running max m and its sum s relative to m, rescaling s when m grows.
        const float neg_inf = -__int_as_float(0x7f800000);
        float m = neg_inf, s = 0.0f;
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            const float v = ld(x, j);
            if (v > m) {
                s = s * expf(m - v) + 1.0f;
                m = v;
            } else {
                s += expf(v - m);
            }
        }
        const float mx = block_max(m, scratch);
        // A thread that saw no logit has s = 0 and m = −∞: it adds 0·0.
        const float sum = block_sum(s * expf(m - mx), scratch);
        if (d) {
            // The target entry is formed as (p − 1)·scale rather than p·scale − scale.
            const float scale = grad_scale / sum;
            for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
                const float e = expf(ld(x, j) - mx);
                st(d, j, j == (int)target ? (e / sum - 1.0f) * grad_scale : e * scale);
            }
        }
        // −log softmax[target] = max + log Σ exp(x − max) − x[target].
        if (threadIdx.x == 0) losses[row] = mx + logf(sum) - ld(x, (int)target);
    }
}
extern "C" __global__ void cross_entropy_f32(float* losses, float* dlogits, const float* logits, const unsigned int* targets, int vocab, unsigned int ignore_index, float grad_scale) { cross_entropy(losses, dlogits, logits, targets, vocab, ignore_index, grad_scale); }
extern "C" __global__ void cross_entropy_bf16(float* losses, bf16* dlogits, const bf16* logits, const unsigned int* targets, int vocab, unsigned int ignore_index, float grad_scale) { cross_entropy(losses, dlogits, logits, targets, vocab, ignore_index, grad_scale); }
