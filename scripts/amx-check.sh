#!/usr/bin/env bash
# On a CPU with AMX (an Intel Xeon of Sapphire Rapids or later): checks the AMX bf16 kernel,
# which was written on machines without AMX (src/ops/gemm_bf16/amx.rs), on the real tiles
# against the reference, times it against the vdpbf16ps kernel (op benches and a training
# step, alternating), and writes everything to a report for docs/PERF.md.
#
# Usage:
#   scripts/amx-check.sh [REPORT]              default REPORT: amx-check-report.md
#   scripts/amx-check.sh --any-cpu [REPORT]    run the steps on a CPU without AMX too (both
#                                              timings are then the vdpbf16ps kernel: a check of
#                                              this script, not of the kernel)
#
# Set PT_PYTHON to a Python with torch for PyTorch's steps beside ours. The exit status is
# non-zero if any step failed; the report says which.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ANY_CPU=0
if [[ "${1:-}" == "--any-cpu" ]]; then
    ANY_CPU=1
    shift
fi
REPORT="${1:-amx-check-report.md}"

if ! grep -qw amx_tile /proc/cpuinfo || ! grep -qw amx_bf16 /proc/cpuinfo; then
    if [[ $ANY_CPU == 0 ]]; then
        echo "this CPU has no AMX (no amx_tile and amx_bf16 in /proc/cpuinfo); --any-cpu runs the steps anyway" >&2
        exit 2
    fi
fi

FAILED=()
{
    echo "# AMX check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores;" \
        "flags: $(grep -o -w 'amx_[a-z0-9]*\|avx512_bf16' /proc/cpuinfo | sort -u | xargs)"
    echo
} >"$REPORT"

# Runs "$@" as step NAME, appending its output (or its last 60 lines on failure) to the report.
step() {
    local name="$1"
    shift
    echo "== $name" >&2
    local out status
    out="$("$@" 2>&1)"
    status=$?
    {
        echo "## $name"
        echo
        echo '```'
        echo "\$ $*"
        if [[ $status == 0 ]]; then echo "$out"; else echo "$out" | tail -60; fi
        echo '```'
        echo
        [[ $status == 0 ]] || echo "**FAILED** (exit $status)"
        echo
    } >>"$REPORT"
    [[ $status == 0 ]] || FAILED+=("$name")
}

step "build" cargo build --release
# `kernel_runs_where_the_cpu_has_it` asserts that the AMX kernel was chosen (the OS granted the
# tiles and the start-up check agreed); the reference tests then run on the tiles.
step "kernel tests on this CPU" cargo test --release --lib gemm_bf16
step "bf16 training tests" cargo test --release --test cpu_bf16
step "which kernel a run uses" ./target/release/pipetransformer bench-step --device cpu --steps 1 --warmup 0 \
    --precision bf16 --python none
step "op benches, vdpbf16ps (baseline)" env PT_BF16_KERNEL=avx512 cargo bench --bench gemm_bf16 -- \
    --save-baseline vdp --warm-up-time 1 --measurement-time 3
step "op benches, the chosen kernel against vdpbf16ps" cargo bench --bench gemm_bf16 -- \
    --baseline vdp --warm-up-time 1 --measurement-time 3
for round in 1 2; do
    step "training step, vdpbf16ps (round $round)" env PT_BF16_KERNEL=avx512 \
        ./target/release/pipetransformer bench-step --device cpu --steps 10 --warmup 2
    step "training step, the chosen kernel (round $round)" \
        ./target/release/pipetransformer bench-step --device cpu --steps 10 --warmup 2
done

if [[ ${#FAILED[@]} -gt 0 ]]; then
    printf 'failed: %s\n' "${FAILED[@]}" | tee -a "$REPORT" >&2
    exit 1
fi
echo "all steps passed; report: $REPORT" >&2
