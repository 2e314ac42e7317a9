#!/usr/bin/env python3
"""Time for the main job to reach a test accuracy (docs/RESULTS.md, "Time to 83.0 %").

Runs `pipetransformer train` with an evaluation every 64 steps (pass other flags after the
binary's own), stamps each line it prints with the seconds since the process started, and
reports for the first evaluation at or above the target:

- "to target": the steps' seconds up to it, plus epoch 0's evaluation (where it came first)
  and the transitions (the measure the sessions have used: what a plain run spends to get
  there);
- "wall clock": when the process printed that evaluation, less the extra evaluations before
  it that a plain run does not make (so start-up, the time between steps and the evaluation
  that shows the accuracy are in).

Usage: scripts/time_to_accuracy.py OUT_DIR [--target 83.0] [--binary PATH] [-- extra flags]

OUT_DIR must not exist yet or be empty: a run there starts fresh, and an earlier run's
metrics or checkpoint are not overwritten.
"""

import argparse
import json
import os
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the run's output folder (new, or empty)")
    ap.add_argument("--target", type=float, default=83.0, help="test accuracy in percent")
    ap.add_argument("--binary", default="target/release/pipetransformer")
    ap.add_argument("--config", default="configs/minilm-rt.toml")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.extra = argv[cut + 1 :]  # more flags for `train`

    if os.path.isdir(a.out) and os.listdir(a.out):
        sys.exit(f"{a.out} already holds files; expected a new or empty folder (a fresh run would overwrite them)")
    if not os.access(a.binary, os.X_OK):
        sys.exit(f"{a.binary}: no such program; expected the pipetransformer binary (cargo build --release, or --binary PATH)")

    cmd = [a.binary, "train", "--config", a.config, "--fresh", "--set", "train.eval_every=64",
           "--set", f'output.dir="{a.out}"', *a.extra]
    start = time.monotonic()
    printed = []  # (seconds since start, line)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            printed.append((time.monotonic() - start, line))
            print(f"{printed[-1][0]:7.2f} {line}", end="", flush=True)
    if p.returncode != 0:
        sys.exit(f"train exited with {p.returncode}")

    steps = transitions = first_epoch_eval = extra_evals = 0.0
    hit = None
    with open(f"{a.out}/metrics.jsonl") as f:
        for e in map(json.loads, f):
            if e["event"] == "step" and hit is None:
                steps += e["seconds"]
            elif e["event"] == "transition" and hit is None:
                transitions += e.get("seconds") or 0.0
            elif e["event"] == "epoch" and e["epoch"] == 0 and hit is None:
                first_epoch_eval = e["eval_seconds"]
            elif e["event"] == "eval" and hit is None:
                if 100 * e["eval"]["accuracy"] >= a.target:
                    hit = (e["step"], 100 * e["eval"]["accuracy"], steps)
                else:
                    extra_evals += e["eval_seconds"]
    if hit is None:
        sys.exit(f"no evaluation reached {a.target} %")
    step, accuracy, steps_to = hit
    shown = next((t for t, line in printed if line.startswith(f"step {step} ") and "eval" in line), None)
    if shown is None:
        sys.exit(f"the run printed no evaluation line for step {step}; expected one beginning \"step {step} \"")
    print(f"first at or above {a.target} %: step {step} ({accuracy:.2f} %)")
    print(f"to target: steps {steps_to:.1f} s + epoch 0's evaluation {first_epoch_eval:.2f} s "
          f"+ transitions {transitions:.2f} s = {steps_to + first_epoch_eval + transitions:.1f} s")
    print(f"wall clock: printed at {shown:.1f} s - extra evaluations {extra_evals:.1f} s = "
          f"{shown - extra_evals:.1f} s")


if __name__ == "__main__":
    main()
