#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: runs the kernel tests and the training-tracking tests on the
# real device (the same tests CI runs on the emulator), benchmarks a training step on the GPU in
# both precisions, benchmarks every kernel against cuBLAS, trains two small models on the GPU,
# and writes everything to a report.
#
# Usage:
#   scripts/gpu-check.sh [REPORT]                   build here (cargo, network for the CUDA
#                                                   wheels), then check; default REPORT is
#                                                   gpu-check-report.md, under $OUT when set
#                                                   (the device tool's folder that comes back)
#   scripts/gpu-check.sh --bundle DIR               on a machine with cargo and tools/cuda (no GPU
#                                                   needed): write DIR with the stripped binaries,
#                                                   NVRTC and the CUDA headers (xz), the kernels'
#                                                   cubins, and the data the training steps read
#                                                   (~48 MiB)
#   scripts/gpu-check.sh --prebuilt DIR [REPORT]    on a GPU machine without cargo or network
#                                                   (a cluster node): the same checks from DIR
#
# Needs: the NVIDIA driver (libcuda); NVRTC and the headers from scripts/setup.sh's CUDA wheels
# (or the bundle). cuBLAS (the kernel benchmarks' reference) and NCCL are taken from where the
# machine has them (a CUDA toolkit, or the nvidia-* Python wheels beside PyTorch). The exit
# status is non-zero if any step failed; the report says which.
#
# GPU_CHECK_STEP_TIMEOUT (seconds) ends a check that runs longer (setup and build excepted),
# reported as timed out, so that one hang does not take the other checks' time. The default is
# 600, or 120 where $OUT is set (under the device tool, whose command limit is 600 s for all
# the checks together). A step that fails otherwise is reported with its exit status or the
# signal that ended it.
set -uo pipefail

# Paths the caller gives are relative to where it stands, not to the repository.
CALLER="$PWD"
from_caller() { [[ "$1" == /* ]] && echo "$1" || echo "$CALLER/$1"; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Every executable `cargo build --release --all-targets` writes, one `kind<TAB>name<TAB>path`
# per line (a path may hold spaces); the compiler's errors go to stderr. The bin's unit-test
# harness is left out: it shares the bin's kind and name, and picking it instead of the CLI
# gave a bundle whose `pipetransformer` rejects every option. Cargo's own messages (progress,
# a crate it cannot fetch) stay on stderr.
artifacts() {
    cargo build --release --all-targets --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-message" and m["message"].get("level") == "error":
        sys.stderr.write(m["message"].get("rendered") or m["message"]["message"] + "\n")
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        if m["target"]["kind"][0] == "bin" and m["profile"]["test"]:
            continue
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"], sep="\t")'
}

if [[ "${1:-}" == "--bundle" ]]; then
    [[ $# -ge 2 && -n "$2" ]] || { echo "usage: scripts/gpu-check.sh --bundle DIR" >&2; exit 2; }
    DIR="$(from_caller "$2")"
    set -e
    # DIR is replaced whole: only an earlier bundle (it holds the marker) or an empty folder.
    if [[ -e "$DIR" && ! -f "$DIR/.gpu-check-bundle" ]] && [[ -n "$(ls -A "$DIR" 2>/dev/null)" || ! -d "$DIR" ]]; then
        echo "gpu-check: --bundle $DIR: holds files that are not a bundle's; expected a new or empty folder" >&2
        exit 2
    fi
    [[ -f tools/cuda/cuda_nvrtc/lib/libnvrtc.so.12 ]] || bash scripts/setup.sh cuda
    bash scripts/setup.sh hamlet digits
    list="$(artifacts)" || { echo "gpu-check: cargo build failed (its errors above)" >&2; exit 1; }
    rm -rf "$DIR" && mkdir -p "$DIR/bin" "$DIR/data/text" && touch "$DIR/.gpu-check-bundle"
    git rev-parse --short HEAD >"$DIR/COMMIT" 2>/dev/null || echo unknown >"$DIR/COMMIT"
    [[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || sed -i 's/$/ (with uncommitted changes)/' "$DIR/COMMIT"
    pick() { awk -F'\t' -v k="$1" -v n="$2" '$1 == k && $2 == n { print $3 }' <<<"$list" | tail -1; }
    objcopy --strip-debug "$(pick bin pipetransformer)" "$DIR/bin/pipetransformer"
    objcopy --strip-debug "$(pick test kernels)" "$DIR/bin/test-kernels"
    objcopy --strip-debug "$(pick test emu_training)" "$DIR/bin/test-emu-training"
    objcopy --strip-debug "$(pick test terapipe)" "$DIR/bin/test-terapipe"
    objcopy --strip-debug "$(pick bench kernels)" "$DIR/bin/bench-kernels"
    tar -C tools -cf - cuda/cuda_nvrtc/lib/libnvrtc.so.12 cuda/cuda_nvrtc/lib/libnvrtc-builtins.so.12.9 \
        cuda/cuda_runtime/include cuda/cuda_nvcc/include | xz -9 -T0 >"$DIR/cuda.tar.xz"
    cp data/text/hamlet.txt "$DIR/data/text/" && cp -r data/digits "$DIR/data/"
    # The kernels' cubins, compiled here so that a GPU node spends no minutes in NVRTC: for the
    # architectures in BUNDLE_ARCHS (default 90, the H100/H200; each adds ~2 MiB, and a lease
    # carries 64 MiB at most). Another GPU compiles its own with the bundled NVRTC on first use.
    XDG_CACHE_HOME="$DIR/cache" "$(pick test kernel_build)" --exact every_kernel_file_compiles_to_a_cubin_for_each_architecture >/dev/null
    for f in "$DIR"/cache/pipetransformer/kernels/*.cubin; do
        arch="${f##*-sm}" && arch="${arch%%-*}" # FILE-sm90-HASH.cubin
        [[ " ${BUNDLE_ARCHS:-90} " == *" $arch "* ]] || rm "$f"
    done
    ls "$DIR"/cache/pipetransformer/kernels/*.cubin >/dev/null # none: NVRTC or ptxas was missing
    du -sh "$DIR"
    exit 0
fi

PREBUILT=""
if [[ "${1:-}" == "--prebuilt" ]]; then
    # A wrong folder must stop here: falling through to the build would fetch and compile on
    # a node that has neither network nor cargo.
    [[ $# -ge 2 ]] || { echo "usage: scripts/gpu-check.sh --prebuilt DIR [REPORT]" >&2; exit 2; }
    PREBUILT="$(cd "$(from_caller "$2")" 2>/dev/null && pwd)" || { echo "gpu-check: --prebuilt $2: no such folder" >&2; exit 2; }
    [[ -f "$PREBUILT/.gpu-check-bundle" ]] ||
        { echo "gpu-check: --prebuilt $2: not a bundle (make one with --bundle DIR)" >&2; exit 2; }
    shift 2
fi
REPORT="$(from_caller "${1:-${OUT:+$OUT/}gpu-check-report.md}")"
FAILED=0
STEP_TIMEOUT="${GPU_CHECK_STEP_TIMEOUT:-$([[ -n "${OUT:-}" ]] && echo 120 || echo 600)}"
if [[ -z "$PREBUILT" ]] && ! command -v cargo >/dev/null; then
    echo "gpu-check: no cargo here to build with; on a machine without it, use --prebuilt DIR (a bundle from --bundle DIR)" >&2
    exit 2
fi
# The steps' scratch folders, under one removed on exit (a step ended by its timeout cannot
# remove its own).
WORK="$(mktemp -d)"
export WORK
trap 'rm -rf "$WORK"' EXIT
# (A step runs in its own process group under `timeout`: Ctrl-C reaches this script, which
# says so once the step in progress has ended.)
trap 'echo "**STOPPED** from outside during the step above" >>"$REPORT"; exit 143' TERM
trap 'echo "**STOPPED** by Ctrl-C during the step above" >>"$REPORT"; exit 130' INT

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
    # Through bash, so that a step may be one of this script's (exported) functions. A limit of
    # 0 is none (timeout's convention).
    timeout -k 10 "$STEP_TIMEOUT" bash -c '"$@"' step "$@" 2>&1 | tee -a "$REPORT"
    local status="${PIPESTATUS[0]}" took=$((SECONDS - start)) why
    echo '```' >>"$REPORT"
    if ((status != 0)); then
        # timeout's 124 (TERM) and 137 (KILL after -k) are its own only when the limit passed.
        if [[ "$STEP_TIMEOUT" != 0 ]] && ((took >= STEP_TIMEOUT)) && [[ $status == 124 || $status == 137 ]]; then
            why="timed out after $STEP_TIMEOUT s"
        elif ((status > 128)); then
            why="killed by signal $((status - 128))"
        else
            why="exit status $status"
        fi
        echo "**FAILED**: $why" | tee -a "$REPORT"
        FAILED=1
    fi
    echo "($((SECONDS - start)) s)" >>"$REPORT"
    echo >>"$REPORT"
}

# A GPT-2-small-shaped model (12 layers, hidden 768) trained for one epoch of hamlet.txt as a
# K-stage 1F1B pipeline on one GPU: K devices, each on streams of its own (PT_SHARE_GPUS), 8
# micro-batches of 8. Prints the median step, and for K > 1 the measured bubble, over the
# epoch's steps after the first.
bubble_on_one_gpu() {
    set -o pipefail
    local k="$1" dir
    dir="$(mktemp -d -p "$WORK")"
    PT_SHARE_GPUS=1 "$PT" train --config configs/gpt-hamlet.toml --device cuda --precision bf16 --devices "$k" \
        --pipeline-len "$k" --micro-batches 8 --schedule 1f1b --fresh --set train.epochs=1 --set data.batch_size=64 \
        --set model.config.n_embd=768 --set model.config.n_layer=12 --set model.config.n_head=12 \
        --set "output.dir=$dir" | tail -3 &&
        python3 - "$dir/metrics.jsonl" <<'PY'
import json, statistics, sys
steps = [e for e in map(json.loads, open(sys.argv[1])) if e.get("event") == "step"][1:]
if not steps:
    sys.exit("no step after the first to time")
m = statistics.median
line = f"{len(steps)} steps: step {1e3 * m(e['seconds'] for e in steps):.1f} ms"
b = [e["bubble"] for e in steps if e.get("bubble")]
if b:
    line += (f", bubble {100 * m(x['measured'] for x in b):.1f} % (formula {100 * b[0]['formula']:.1f} %),"
             f" after the pipeline {1e3 * m(x['tail_seconds'] for x in b):.1f} ms")
print(line)
PY
    local status=$?
    rm -rf "$dir"
    return $status
}

# One epoch of the GPT on hamlet in three ways that share one GPU between two devices: `replicas`,
# one process of two data-parallel replicas; `processes`, two launched processes of one replica
# each (a TCP ring between them); `stages`, two launched processes as the stages of one pipeline.
# The same global batch of 16 every way: the losses agree up to the order of the sums.
two_on_one_gpu() {
    set -o pipefail
    local dir run
    dir="$(mktemp -d -p "$WORK")"
    run=(train --config configs/gpt-hamlet.toml --device cuda --fresh --set train.epochs=1 --set "output.dir=$dir")
    case "$1" in
    replicas) PT_SHARE_GPUS=1 "$PT" "${run[@]}" --devices 2 --replicas 2 ;;
    processes) PT_SHARE_GPUS=1 "$PT" launch --nproc-per-node 2 -- "${run[@]}" ;;
    stages) PT_SHARE_GPUS=1 "$PT" launch --nproc-per-node 2 -- "${run[@]}" --across-processes --pipeline-len 2 ;;
    esac | grep -E "communicator|done|final eval"
    local status=$?
    rm -rf "$dir"
    return $status
}
export -f bubble_on_one_gpu two_on_one_gpu

{
    echo "# GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not available"
    if [[ -n "$PREBUILT" ]]; then
        echo "commit $(cat "$PREBUILT/COMMIT" 2>/dev/null || echo unknown) (the bundle's: $PREBUILT)"
    else
        echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    fi
    echo '```'
    echo
} >"$REPORT"

if [[ -n "$PREBUILT" ]]; then
    export PT_CUDA_HOME="$PREBUILT/cuda" XDG_CACHE_HOME="$PREBUILT/cache"
    # Unpacked beside, then moved in whole: a cut-short unpack leaves no half folder that the
    # next run would take for a complete one (and the next run clears what it left).
    if [[ ! -d "$PT_CUDA_HOME" ]]; then
        unpack="$PREBUILT/.cuda.partial"
        rm -rf "$unpack" && mkdir "$unpack" && tar -C "$unpack" -xJf "$PREBUILT/cuda.tar.xz" &&
            mv "$unpack/cuda" "$PT_CUDA_HOME" ||
            { echo "gpu-check: could not unpack $PREBUILT/cuda.tar.xz (see above)" | tee -a "$REPORT" >&2; rm -rf "$unpack"; exit 1; }
        rm -rf "$unpack"
    fi
    mkdir -p data && cp -rn "$PREBUILT/data/." data/
    PT="$PREBUILT/bin/pipetransformer"
    TEST_KERNELS=("$PREBUILT/bin/test-kernels")
    TEST_TRAINING=("$PREBUILT/bin/test-emu-training")
    TEST_TERAPIPE=("$PREBUILT/bin/test-terapipe" cuda_emu)
    BENCH_KERNELS=("$PREBUILT/bin/bench-kernels" --bench)
else
    # Without the wheels or the build, every check after would fail for the same reason.
    STEP_TIMEOUT=0 step "setup (CUDA wheels, data)" bash scripts/setup.sh cuda nccl hamlet digits
    ((FAILED == 0)) && STEP_TIMEOUT=0 step "build" cargo build --release --all-targets
    ((FAILED == 0)) || { echo "report: $REPORT (setup or build failed: no check ran)"; exit 1; }
    PT="target/release/pipetransformer"
    TEST_KERNELS=(cargo test --release --test kernels --)
    TEST_TRAINING=(cargo test --release --test emu_training --)
    TEST_TERAPIPE=(cargo test --release --test terapipe -- cuda_emu)
    BENCH_KERNELS=(cargo bench --bench kernels)
fi

export PT

# A library cudarc or the NCCL loader can open, from where this machine has it: cudarc asks for
# `libcublas.so` or `.so.12`. A `.so.12` outside the loader's cache has its folder put on the
# loader's path; failing that, another major version (a CUDA 13 machine has `.so.13`) is linked
# as `libcublas.so` in a folder put first. NCCL is named by PT_NCCL_LIB.
find_lib() { find / -xdev -name "$1" -not -path '/proc/*' 2>/dev/null | head -1; }
cached() { grep -q "$1" <<<"$(/sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null)"; }
if ! cached 'libcublas\.so\.12 '; then
    cublas="$(find_lib 'libcublas.so.12')"
    if [[ -z "$cublas" ]]; then
        cublas="$(find_lib 'libcublas.so.1[0-9]')"
        if [[ -n "$cublas" ]]; then
            links="$(mktemp -d -p "$WORK")"
            ln -s "$cublas" "$links/libcublas.so"
            export LD_LIBRARY_PATH="$links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
    [[ -n "$cublas" ]] && export LD_LIBRARY_PATH="$(dirname "$cublas")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [[ -z "${PT_NCCL_LIB:-}" ]] && ! cached 'libnccl\.so\.2 '; then
    nccl="$(find_lib 'libnccl.so.2')"
    [[ -n "$nccl" ]] && export PT_NCCL_LIB="$nccl"
fi
echo "cuBLAS: ${cublas:-as installed}; NCCL: ${PT_NCCL_LIB:-as installed, if at all}" | tee -a "$REPORT"

step "kernel tests on cuda" env PT_TEST_DEVICE=cuda "${TEST_KERNELS[@]}"
step "training follows cpu on cuda" env PT_TEST_DEVICE=cuda "${TEST_TRAINING[@]}"
step "token-sliced steps equal unsliced ones on cuda (f32; bf16 slices and pipelines)" env PT_TEST_DEVICE=cuda "${TEST_TERAPIPE[@]}"
step "training step, f32" "$PT" bench-step --device cuda --precision f32 --steps 20 --warmup 3
step "training step, bf16" "$PT" bench-step --device cuda --precision bf16 --steps 20 --warmup 3
step "training step, bf16, batch 128 (MFU)" "$PT" bench-step --device cuda --precision bf16 --batch 128 --steps 10 --warmup 3
step "kernel benchmarks" "${BENCH_KERNELS[@]}"
step "GPT-2-small shape on one GPU, one device (no pipeline)" bubble_on_one_gpu 1
step "pipeline bubble on one GPU, K = 2" bubble_on_one_gpu 2
step "pipeline bubble on one GPU, K = 4" bubble_on_one_gpu 4
for way in replicas processes stages; do
    step "two devices on one GPU: $way" two_on_one_gpu "$way"
done
RUNS="$(mktemp -d -p "$WORK")"
step "GPT on hamlet, cuda f32" "$PT" train --config configs/gpt-hamlet.toml --device cuda --fresh --set "output.dir=$RUNS/hamlet"
step "ViT on digits, cuda bf16" "$PT" train --config configs/vit-digits.toml --device cuda --precision bf16 --fresh --set "output.dir=$RUNS/digits"
rm -rf "$RUNS"

echo "report: $REPORT"
exit "$FAILED"
