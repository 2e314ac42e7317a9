#!/usr/bin/env python3
"""PyTorch's side of `pipetransformer bench-step`: the same MiniLM-shaped training step (BERT, 6
layers, hidden 384, 12 heads, MLP 1536, vocabulary 30522, dropout 0.1, a mean-pooling 2-class
head, cross-entropy, gradient clipping at 1.0, AdamW) on the CPU or a CUDA GPU (`--device cuda`),
eager, timed in f32 and under bf16 autocast. On a GPU each step is timed to its end
(`torch.cuda.synchronize`), and f32 products stay f32 (PyTorch's default: no TF32). Prints one JSON line; without torch and transformers it prints why, and the
report goes on without the comparison (PyTorch is an optional comparison, never a dependency).

    python3 scripts/bench_torch.py --batch 16 --seq 128 --steps 10 --warmup 2 --threads 2
    python3 scripts/bench_torch.py --device cuda --steps 20 --warmup 3
"""

import argparse
import json
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser()
    for name, default in [("batch", 16), ("seq", 128), ("steps", 5), ("warmup", 1), ("threads", 0)]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = p.parse_args()
    try:
        import torch
        from transformers import BertConfig, BertModel
    except ImportError as e:
        print(json.dumps({"absent": f"no torch/transformers ({e})"}))
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"absent": "torch sees no CUDA GPU"}))
        return
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        type_vocab_size=2,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    encoder = BertModel(config, add_pooling_layer=False)  # default attention (SDPA), as a user gets it
    head = torch.nn.Linear(384, 2)
    encoder.to(dev)
    head.to(dev)
    params = list(encoder.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    ids = torch.randint(0, 30522, (a.batch, a.seq), device=dev)
    labels = torch.randint(0, 2, (a.batch,), device=dev)
    encoder.train()

    def step(bf16):
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=bf16):
            hidden = encoder(input_ids=ids).last_hidden_state
            logits = head(hidden.mean(dim=1))
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    out = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    for name, bf16 in [("f32", False), ("bf16", True)]:
        for _ in range(a.warmup):
            step(bf16)
        sync()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            step(bf16)
            sync()
            times.append(time.perf_counter() - t)
        out[f"{name}_ms"] = 1e3 * statistics.median(times)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
