#!/usr/bin/env python3
"""Time for the main job to reach a test accuracy (docs/RESULTS.md, "Time to 83.0 %").

Runs `pipetransformer train` with an evaluation every 64 steps (pass other flags after the
binary's own), stamps each line it prints with the seconds since the process started, and
reports for the first evaluation at or above the target (every 64 steps, or at an epoch's
end):

- "to target": the steps' seconds up to it, plus the evaluations at the end of each epoch
  before it and the transitions (the measure the sessions have used: what a plain run spends
  to get there);
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

    hit, steps, transitions, plain_evals, extra_evals = scan(f"{a.out}/metrics.jsonl", a.target)
    if hit is None:
        sys.exit(f"no evaluation reached {a.target} %")
    step, accuracy, epoch = hit
    # The line the run printed with that evaluation: `step N …eval…` inside an epoch,
    # `epoch E: eval …` at its end.
    said = (lambda line: line.startswith(f"step {step} ") and "eval" in line) if epoch is None else (
        lambda line: line.startswith(f"epoch {epoch}: eval"))
    shown = next((t for t, line in printed if said(line)), None)
    if shown is None:
        sys.exit(f"the run printed no line for the evaluation at step {step}; expected one as the binary prints it")
    where = f"step {step}" if epoch is None else f"the end of epoch {epoch}, step {step}"
    print(f"first at or above {a.target} %: {where} ({accuracy:.2f} %)")
    print(f"to target: steps {steps:.1f} s + epochs' evaluations {plain_evals:.2f} s "
          f"+ transitions {transitions:.2f} s = {steps + plain_evals + transitions:.1f} s")
    print(f"wall clock: printed at {shown:.1f} s - extra evaluations {extra_evals:.1f} s = "
          f"{shown - extra_evals:.1f} s")


def scan(path, target):
    """The first evaluation at or above `target` % in a run's log, as (step, accuracy, epoch or
    None for one inside an epoch), or None; and up to it the steps' seconds, the transitions',
    the evaluations a plain run makes too (at each epoch's end) and the extra ones
    (`train.eval_every`'s). An evaluation at an epoch's end is logged with the epoch, not as an
    `eval` event. A step logged twice (a resumed run) counts once, its last time."""
    if not os.path.exists(path):
        sys.exit(f"{path}: no such file; the run wrote no metrics (did it train?)")
    step_seconds = {}
    transitions = plain_evals = extra_evals = 0.0
    last_step = 0
    with open(path) as f:
        lines = f.read().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # a line cut by a stopped run
                print(f"{path}:{n}: the last line is cut short; read up to it", file=sys.stderr)
                break
            sys.exit(f"{path}:{n}: not a JSON object")
        kind = e.get("event")
        if kind == "step":
            last_step = e["step"]
            step_seconds[last_step] = e["seconds"]
        elif kind == "transition":
            transitions += e.get("seconds") or 0.0
        elif kind in ("eval", "epoch") and e.get("eval") and "accuracy" in e["eval"]:
            accuracy = 100 * e["eval"]["accuracy"]
            if accuracy >= target:
                epoch = e["epoch"] if kind == "epoch" else None
                step = e.get("step", last_step)
                steps = sum(sec for s, sec in step_seconds.items() if s <= step)
                return (step, accuracy, epoch), steps, transitions, plain_evals, extra_evals
            if kind == "epoch":
                plain_evals += e.get("eval_seconds", 0.0)
            else:
                extra_evals += e.get("eval_seconds", 0.0)
    return None, sum(step_seconds.values()), transitions, plain_evals, extra_evals

if __name__ == "__main__":
    main()
