#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: runs the kernel tests and the training-tracking tests on the
# real device (the same tests CI runs on the emulator), benchmarks a training step on the GPU in
# both precisions, benchmarks every kernel against cuBLAS, trains two small models on the GPU,
# and writes everything to a report.
#
# Usage:
#   scripts/gpu-check.sh [REPORT]                   build here (cargo, network for the CUDA
#                                                   wheels), then check; default REPORT is
#                                                   gpu-check-report.md
#   scripts/gpu-check.sh --bundle DIR               on a machine with cargo and tools/cuda (no GPU
#                                                   needed): write DIR with the stripped binaries,
#                                                   NVRTC and the CUDA headers (xz), and the data
#                                                   the training steps read (~48 MiB)
#   scripts/gpu-check.sh --prebuilt DIR [REPORT]    on a GPU machine without cargo or network
#                                                   (a cluster node): the same checks from DIR
#
# Needs: the NVIDIA driver (libcuda); NVRTC and the headers from scripts/setup.sh's CUDA wheels
# (or the bundle). The exit status is non-zero if any step failed; the report says which.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Every executable `cargo build --release --all-targets` writes, one `kind name path` per line.
# The bin's unit-test harness is left out: it shares the bin's kind and name, and picking it
# instead of the CLI gave a bundle whose `pipetransformer` rejects every option.
artifacts() {
    cargo build --release --all-targets --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        if m["target"]["kind"][0] == "bin" and m["profile"]["test"]:
            continue
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])'
}

if [[ "${1:-}" == "--bundle" ]]; then
    DIR="${2:?usage: scripts/gpu-check.sh --bundle DIR}"
    set -e
    [[ -f tools/cuda/cuda_nvrtc/lib/libnvrtc.so.12 ]] || bash scripts/setup.sh cuda
    bash scripts/setup.sh hamlet digits
    rm -rf "$DIR" && mkdir -p "$DIR/bin" "$DIR/data/text"
    list="$(artifacts)"
    pick() { awk -v k="$1" -v n="$2" '$1 == k && $2 == n { print $3 }' <<<"$list" | tail -1; }
    objcopy --strip-debug "$(pick bin pipetransformer)" "$DIR/bin/pipetransformer"
    objcopy --strip-debug "$(pick test kernels)" "$DIR/bin/test-kernels"
    objcopy --strip-debug "$(pick test emu_training)" "$DIR/bin/test-emu-training"
    objcopy --strip-debug "$(pick test terapipe)" "$DIR/bin/test-terapipe"
    objcopy --strip-debug "$(pick bench kernels)" "$DIR/bin/bench-kernels"
    tar -C tools -cf - cuda/cuda_nvrtc/lib/libnvrtc.so.12 cuda/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9 \
        cuda/cuda_runtime/include cuda/cuda_nvcc/include | xz -9 -T0 >"$DIR/cuda.tar.xz"
    cp data/text/hamlet.txt "$DIR/data/text/" && cp -r data/digits "$DIR/data/"
    du -sh "$DIR"
    exit 0
fi

PREBUILT=""
if [[ "${1:-}" == "--prebuilt" ]]; then
    PREBUILT="$(cd "${2:?usage: scripts/gpu-check.sh --prebuilt DIR [REPORT]}" && pwd)"
    shift 2
fi
REPORT="${1:-$ROOT/gpu-check-report.md}"
FAILED=0

step() { # step TITLE COMMAND...: runs COMMAND, appends its output and its time to the report.
    local title="$1" start=$SECONDS
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
    echo "($((SECONDS - start)) s)" >>"$REPORT"
    echo >>"$REPORT"
}

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not available"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)${PREBUILT:+ (prebuilt: $PREBUILT)}"
    echo '```'
    echo
} >"$REPORT"

if [[ -n "$PREBUILT" ]]; then
    export PT_CUDA_HOME="$PREBUILT/cuda"
    [[ -d "$PT_CUDA_HOME" ]] || tar -C "$PREBUILT" -xJf "$PREBUILT/cuda.tar.xz"
    mkdir -p data && cp -rn "$PREBUILT/data/." data/
    PT="$PREBUILT/bin/pipetransformer"
    TEST_KERNELS=("$PREBUILT/bin/test-kernels")
    TEST_TRAINING=("$PREBUILT/bin/test-emu-training")
    TEST_TERAPIPE=("$PREBUILT/bin/test-terapipe" cuda_emu)
    BENCH_KERNELS=("$PREBUILT/bin/bench-kernels" --bench)
else
    step "setup (CUDA wheels, data)" bash scripts/setup.sh cuda nccl hamlet digits
    step "build" cargo build --release --all-targets
    PT="target/release/pipetransformer"
    TEST_KERNELS=(cargo test --release --test kernels --)
    TEST_TRAINING=(cargo test --release --test emu_training --)
    TEST_TERAPIPE=(cargo test --release --test terapipe -- cuda_emu)
    BENCH_KERNELS=(cargo bench --bench kernels)
fi

step "kernel tests on cuda" env PT_TEST_DEVICE=cuda "${TEST_KERNELS[@]}"
step "training follows cpu on cuda" env PT_TEST_DEVICE=cuda "${TEST_TRAINING[@]}"
step "token-sliced steps equal unsliced ones on cuda (f32; bf16 slices and pipelines)" env PT_TEST_DEVICE=cuda "${TEST_TERAPIPE[@]}"
step "training step, f32" "$PT" bench-step --device cuda --precision f32 --steps 20 --warmup 3
step "training step, bf16" "$PT" bench-step --device cuda --precision bf16 --steps 20 --warmup 3
step "kernel benchmarks" "${BENCH_KERNELS[@]}"
RUNS="$(mktemp -d)"
step "GPT on hamlet, cuda f32" "$PT" train --config configs/gpt-hamlet.toml --device cuda --fresh --set "output.dir=$RUNS/hamlet"
step "ViT on digits, cuda bf16" "$PT" train --config configs/vit-digits.toml --device cuda --precision bf16 --fresh --set "output.dir=$RUNS/digits"
rm -rf "$RUNS"

echo "report: $REPORT"
exit "$FAILED"
