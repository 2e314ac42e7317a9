#!/usr/bin/env python3
"""Padded tokens per Rotten Tomatoes batch of 32, random against length-grouped (windows of 50
batches sorted by length), with MiniLM's tokenizer over every unique snippet, three seeded
shuffles. A developer tool for docs/RESULTS.md; needs `transformers` (any Python with it):

    python3 scripts/padding_stats.py [weights/all-minilm-l6-v2]
"""

import bz2
import csv
import io
import random
import statistics
import sys

from transformers import AutoTokenizer


def main():
    tok = AutoTokenizer.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else "weights/all-minilm-l6-v2")
    f = io.TextIOWrapper(bz2.open("data/text/rotten_tomatoes_corpus_full.csv.bz2"), encoding="utf-8")
    rows = csv.reader(f)
    next(rows)
    seen, texts = set(), []
    for row in rows:
        if row[0] == "plot" or row[1] in seen:
            continue
        seen.add(row[1])
        texts.append(row[1])
    lengths = [min(64, len(ids)) for ids in tok(texts)["input_ids"]]
    random.seed(0)
    rnd, grp = [], []
    for _ in range(3):
        p = list(range(len(lengths)))
        random.shuffle(p)
        rnd += [max(lengths[i] for i in p[k : k + 32]) for k in range(0, len(p) - 31, 32)]
        q = []
        for w in range(0, len(p), 1600):
            q += sorted(p[w : w + 1600], key=lambda i: lengths[i])
        grp += [max(lengths[i] for i in q[k : k + 32]) for k in range(0, len(q) - 31, 32)]
    print(f"snippets {len(lengths)}, mean real tokens {statistics.mean(lengths):.1f}")
    print(f"random batches: mean padded length {statistics.mean(rnd):.1f}")
    print(f"grouped batches: mean padded length {statistics.mean(grp):.1f}")


if __name__ == "__main__":
    main()
