#!/usr/bin/env python3
"""Writes tests/fixtures/minilm_golden.json: PyTorch's reference outputs for all-MiniLM-L6-v2.

For a few fixed sentences it records the Hugging Face tokenizer's ids and attention mask
(padded to the longest sentence) and, from `transformers.BertModel` in eval mode on CPU in
float32, `last_hidden_state` whole (every channel at every position, padding included) and the
mask-weighted mean over real tokens (sentence-transformers' pooling, before its L2
normalisation). `tests/weights.rs` loads the same weights into our BERT
and compares.

This is a developer tool, not part of the build or CI: it needs PyTorch and transformers, e.g.

    python3 -m venv /tmp/golden-venv && /tmp/golden-venv/bin/pip install torch transformers
    /tmp/golden-venv/bin/python scripts/make_golden.py [weights/all-minilm-l6-v2]

The weights directory is the one scripts/setup.sh fills (model.safetensors, config.json,
tokenizer.json, vocab.txt).
"""

import hashlib
import json
import os
import sys

import torch
import transformers
from transformers import AutoTokenizer, BertModel

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Pipeline parallelism splits a model into stages.",
    "Hello, world!",
    "Freezing converged layers lets training shrink the pipeline and grow data parallelism over time.",
]

def f32(x):
    """A float32 value as the shortest decimal that reads back to the same float32."""
    return float(f"{float(x):.9g}")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    weights = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "weights", "all-minilm-l6-v2")
    out = os.path.join(root, "tests", "fixtures", "minilm_golden.json")

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(weights)
    model = BertModel.from_pretrained(weights, attn_implementation="eager", add_pooling_layer=False)
    model.eval()

    enc = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            token_type_ids=enc["token_type_ids"],
        ).last_hidden_state  # [batch, seq, hidden]
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    with open(os.path.join(weights, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()

    batch, seq, dim = hidden.shape
    fixture = {
        "about": "last_hidden_state of transformers.BertModel (eval, float32, CPU) for all-MiniLM-L6-v2; "
        "made by scripts/make_golden.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "weights_sha256": sha,
        "sentences": SENTENCES,
        "batch": batch,
        "seq": seq,
        "hidden": dim,
        "input_ids": enc["input_ids"].tolist(),
        "token_type_ids": enc["token_type_ids"].tolist(),
        "attention_mask": enc["attention_mask"].tolist(),
        "last_hidden_state": [[[f32(x) for x in row] for row in sample] for sample in hidden.tolist()],
        "mean_pooled": [[f32(x) for x in v] for v in mean.tolist()],
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {out}: batch {batch}, seq {seq}, hidden {dim} ({os.path.getsize(out)} bytes)")


if __name__ == "__main__":
    main()
