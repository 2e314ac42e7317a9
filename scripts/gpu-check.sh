#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds, runs the kernel tests and the training-tracking tests
# on the real device (the same tests CI runs on the emulator), benchmarks a training step on the
# GPU in both precisions, and writes everything to a report.
#
# Usage: scripts/gpu-check.sh [REPORT]     (default: gpu-check-report.md)
#
# Needs: the NVIDIA driver (libcuda) and scripts/setup.sh's CUDA wheels (NVRTC, headers). The
# exit status is non-zero if any step failed; the report says which.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPORT="${1:-$ROOT/gpu-check-report.md}"
cd "$ROOT"
FAILED=0

step() { # step TITLE COMMAND...: runs COMMAND, appends its output to the report.
    local title="$1"
    shift
    echo "== $title"
    {
        echo "## $title"
        echo
        echo '```'
        echo "\$ $*"
    } >>"$REPORT"
    if "$@" 2>&1 | tee -a "$REPORT"; then
        echo '```' >>"$REPORT"
    else
        echo '```' >>"$REPORT"
        echo "**FAILED**" >>"$REPORT"
        FAILED=1
    fi
    echo >>"$REPORT"
}

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not available"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo '```'
    echo
} >"$REPORT"

step "setup (CUDA wheels)" bash scripts/setup.sh cuda
step "build" cargo build --release --all-targets
step "kernel tests on cuda" env PT_TEST_DEVICE=cuda cargo test --release --test kernels
step "training follows cpu on cuda" env PT_TEST_DEVICE=cuda cargo test --release --test emu_training
step "training step, f32" cargo run --release -- bench-step --device cuda --precision f32 --steps 20 --warmup 3
step "training step, bf16" cargo run --release -- bench-step --device cuda --precision bf16 --steps 20 --warmup 3
step "kernel benchmarks" cargo bench --bench kernels

echo "report: $REPORT"
exit "$FAILED"
