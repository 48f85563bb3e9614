#!/usr/bin/env bash
# Assemble the air-gapped tarball: dist/offgrid-<version>-linux-<arch>.tar.gz.
#
# For machines with python3 and nothing else: no pip, no compiler, no network.
# The tarball holds one folder, offgrid-<version>-linux-<arch>/, with
#
#   offgrid/        the package, as in this checkout (with webui/, the chat page)
#   lib/            a portable libllama (`make lib PORTABLE=1`): no -march=native;
#                   ggml loads the best libggml-cpu-<variant>.so for the CPU at run time;
#                   with ggml's RPC backend and llama.cpp's ggml-rpc-server, for the
#                   other machines of --rpc (RPC=0: without them)
#   __main__.py     so that `python3 -I <folder>` runs offgrid in isolated mode
#   LICENSES/       the notices of what the libraries are built from
#   README.txt      how to run it, and the oldest glibc and libstdc++ it runs on,
#                   read here from the libraries' symbol versions
#   offgrid-<version>-py3-none-any.whl   for `pip install --no-index` where pip exists
#   SHA256SUMS      `sha256sum -c SHA256SUMS` checks the copy
#   <model>.gguf    only with a MODEL argument
#
# On the target:  tar xf offgrid-*.tar.gz && cd offgrid-* && python3 -m offgrid -m MODEL.gguf
#
# The portable build is cached in ~/.cache/offgrid beside the native one; the
# first one takes about 8 minutes on 2 cores (7 CPU variants, CPU_VARIANTS in
# scripts/build_lib.sh).  The checkout's lib/ (the native build the tests use)
# is not touched.
#
# usage: scripts/bundle.sh [MODEL]       DIST=folder for the output (default dist)
#                                        PYTHON=python that builds the wheel (python3)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-}
DIST=${DIST:-dist}
PYTHON=${PYTHON:-python3}
CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}

VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' offgrid/__init__.py)
ARCH=$(uname -m)
GPU=${GPU:-}
# GPU=vulkan or cuda: that backend's libraries in lib/ too (docs/gpu.md)
NAME=offgrid-$VERSION-linux-$ARCH${GPU:+-$GPU}

log() { echo "[make bundle] $*" >&2; }
die() { log "error: $*"; exit 1; }

[ -n "$VERSION" ] || die "no __version__ in offgrid/__init__.py"
[ -z "$MODEL" ] || [ -f "$MODEL" ] || die "no model at $MODEL"

# Staged under build/ (ignored by git), usually the file system of models/,
# so a large model is hard-linked rather than copied.
mkdir -p build
WORK=$(mktemp -d "$PWD/build/bundle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STAGE=$WORK/$NAME
mkdir -p "$STAGE" "$DIST" "$CACHE"

# --- the portable libraries ---------------------------------------------------
RPC=${RPC:-1}
LIB_MODE=$([ "$RPC" = 1 ] && echo --rpc-server || true)
# shellcheck disable=SC2086
PORTABLE=1 RPC="$RPC" GPU="$GPU" bash scripts/build_lib.sh $LIB_MODE "$STAGE/lib"
SRC=$(readlink -f "$CACHE/llama.cpp")   # build_lib.sh links the pinned source here
RPC_NOTE=""
if [ "$RPC" = 1 ]; then
    RPC_NOTE=",
              and ggml-rpc-server: run it on another machine with this folder to lend
              that machine's memory and cores to a model (--rpc; offgrid's
              docs/rpc.md)"
fi

variants=$(cd "$STAGE/lib" && for f in libggml-cpu-*.so; do [ ! -e "$f" ] || echo "$f"; done \
    | sed 's/^libggml-cpu-//; s/\.so$//' | tr '\n' ' ')
[ -n "$variants" ] || die "the portable build has no libggml-cpu-*.so variants"
[ ! -e "$STAGE/lib/libggml-cpu.so" ] || die "the portable build has a fixed libggml-cpu.so"
[ -e "$STAGE/lib/libmtmd.so" ] || die "the build has no libmtmd.so (images and audio, --mmproj)"
readelf -d "$STAGE/lib/libllama.so" | grep -q 'R.*PATH.*\$ORIGIN' \
    || die "libllama.so has no \$ORIGIN run path; lib/ would not find its own ggml"
# Symbol tables are for debuggers; the dynamic symbols ggml looks up stay.
find "$STAGE/lib" -type f -name '*.so*' -exec strip --strip-unneeded {} +

# --- what the libraries need from the target system -----------------------------
# The highest symbol version each library asks of glibc (and of libstdc++ and
# libgcc_s) is the oldest one that satisfies it; the loader refuses older ones.
highest() {   # highest() PREFIX: the highest PREFIX_x.y version any library needs
    objdump -T "$STAGE"/lib/*.so | grep -oE "\(${1}_[0-9.]+\)" | tr -d '()' \
        | sed "s/^${1}_//" | sort -uV | tail -1 || true
}
GLIBC=$(highest GLIBC)
GLIBCXX=$(highest GLIBCXX)
GCC_S=$(highest GCC)
[ -n "$GLIBC" ] || die "found no GLIBC_ symbol versions in the libraries (objdump -T)"
# Libraries the loader must find on the target: every NEEDED entry not in lib/.
# The GPU backend's own are for the GPU alone: ggml loads libggml-$GPU.so as a
# module and, where it cannot (no Vulkan loader, no NVIDIA driver), offgrid
# serves on the CPU and says why.
needed() {      # needed FILE...: their NEEDED libraries that lib/ does not hold
    for f in "$@"; do readelf -d "$f"; done \
        | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u \
        | while read -r so; do [ -e "$STAGE/lib/$so" ] || echo "$so"; done
}
GPU_MODULE=${GPU:+$STAGE/lib/libggml-$GPU.so}
[ -z "$GPU" ] || [ -e "$GPU_MODULE" ] || die "the $GPU build has no libggml-$GPU.so"
BASE_LIBS=()
for f in "$STAGE"/lib/*.so; do [ "$f" = "$GPU_MODULE" ] || BASE_LIBS+=("$f"); done
SYSTEM_LIBS=$(needed "${BASE_LIBS[@]}" | tr '\n' ' ')
GPU_LIBS=$([ -z "$GPU" ] || needed "$GPU_MODULE" \
    | while read -r so; do [[ " $SYSTEM_LIBS" == *" $so "* ]] || echo "$so"; done | tr '\n' ' ')
# sed reads all of ldd's output: with head, ldd's SIGPIPE failed the pipeline
# and added a "?" to the version it had printed
HOST_GLIBC=$(ldd --version 2>/dev/null | sed -n '1s/.* \([0-9][0-9]*\.[0-9][0-9]*\)$/\1/p')
HOST_GLIBC=${HOST_GLIBC:-?}
log "oldest glibc: $GLIBC (built on $HOST_GLIBC); libstdc++ with GLIBCXX_$GLIBCXX"

# --- the package, a wheel of it, the model ---------------------------------------
find offgrid -name '*.py' -not -path '*/__pycache__/*' -exec cp --parents {} "$STAGE" \;
# the chat page (server/api/webui.py serves it from the package's folder)
cp --parents offgrid/webui/index.html offgrid/webui/app.js offgrid/webui/app.css "$STAGE"

cat >"$STAGE/__main__.py" <<'EOF'
"""Run offgrid from this folder:  python3 -I path/to/this/folder -m MODEL.gguf

`python3 -m offgrid` finds the package only from inside this folder and not
in isolated mode (-I takes the current folder off sys.path).  A folder given
to python3 as the program is put at the front of sys.path, also under -I, so
this works from anywhere and in any mode.
"""
import runpy

runpy.run_module("offgrid", run_name="__main__", alter_sys=True)
EOF

# Built from a clean copy of the sources, so setuptools' build/ can never put a
# stale module into the wheel.  Offline first, with the build backend already
# installed for $PYTHON; else pip fetches setuptools from its index.
mkdir -p "$WORK/src"
cp -r "$STAGE/offgrid" pyproject.toml "$WORK/src/"
for f in README.md LICENSE; do [ ! -f "$f" ] || cp "$f" "$WORK/src/"; done
( cd "$WORK/src" \
  && { "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --no-index -w "$WORK/wheel" . \
         >/dev/null 2>&1 \
       || "$PYTHON" -m pip wheel --quiet --no-deps -w "$WORK/wheel" . >/dev/null; } ) \
    || die "could not build the wheel with $PYTHON -m pip (it needs setuptools, offline or from the index)"
WHEEL=$(cd "$WORK/wheel" && ls offgrid-"$VERSION"-*.whl)
cp "$WORK/wheel/$WHEEL" "$STAGE/"

MODEL_NAME=
if [ -n "$MODEL" ]; then
    MODEL_NAME=$(basename "$MODEL")
    log "adding the model $MODEL_NAME ($(du -h "$MODEL" | cut -f1))"
    ln "$MODEL" "$STAGE/$MODEL_NAME" 2>/dev/null || cp "$MODEL" "$STAGE/$MODEL_NAME"
fi

# --- licenses -------------------------------------------------------------------
mkdir -p "$STAGE/LICENSES"
# llama.cpp's MIT license names "The ggml authors": it covers ggml, which lives
# in the same tree without a license of its own (copied too, should it get one).
cp "$SRC/LICENSE" "$STAGE/LICENSES/llama.cpp-LICENSE.txt"
[ ! -f "$SRC/ggml/LICENSE" ] || cp "$SRC/ggml/LICENSE" "$STAGE/LICENSES/ggml-LICENSE.txt"
[ ! -f LICENSE ] || cp LICENSE "$STAGE/LICENSES/offgrid-LICENSE.txt"
if [ "$GPU" = cuda ]; then
    # lib/ carries NVIDIA's CUDA runtime and cuBLAS, redistributable under
    # NVIDIA's licence, which the wheels they come from ship
    for f in "$CACHE"/cuda-toolchain-*/lib/python3*/site-packages/nvidia_cuda_runtime-*.dist-info/licenses/License.txt; do
        [ -f "$f" ] && { cp "$f" "$STAGE/LICENSES/NVIDIA-CUDA-LICENSE.txt"; break; }
    done
    [ -f "$STAGE/LICENSES/NVIDIA-CUDA-LICENSE.txt" ] || die "no NVIDIA licence found beside the CUDA wheels"
fi
# Code in the CPU backend under its own MIT notice, quoted from the source.
{
    echo "Third-party code compiled into the libggml-cpu-*.so libraries, with the"
    echo "notices it carries in the pinned llama.cpp source (ggml/src/ggml-cpu/)."
    echo
    echo "== llamafile/sgemm.cpp (matrix multiplication kernels from llamafile)"
    echo
    sed -n '/^\/\//!q; s#^// \{0,1\}##p' "$SRC/ggml/src/ggml-cpu/llamafile/sgemm.cpp"
    echo
    echo "== ops.cpp, rope_yarn (YaRN, https://github.com/jquesnelle/yarn)"
    echo
    grep -h -o 'MIT licensed\. Copyright.*' "$SRC/ggml/src/ggml-cpu/ops.cpp" | head -1
} >"$STAGE/LICENSES/ggml-cpu-third-party-notices.txt"
# libmtmd (--mmproj) compiles llama.cpp's vendored image, audio and hash code in.
{
    echo "Third-party code compiled into libmtmd.so, with the notices it carries in"
    echo "the pinned llama.cpp source (vendor/)."
    for f in stb/stb_image.h miniaudio/miniaudio.h; do
        echo; echo "== vendor/$f"; echo
        sed -n '/^This software is available/,$p' "$SRC/vendor/$f" | grep -v '^\*/'
    done
    for f in hash/sha256/LICENSE hash/xxhash/LICENSE hash/rotate-bits/LICENSE.md; do
        echo; echo "== vendor/$f"; echo
        cat "$SRC/vendor/$f"
    done
    echo; echo "== vendor/hash/sha1, vendor/sheredom/subprocess.h: public domain (their headers)"
} >"$STAGE/LICENSES/libmtmd-third-party-notices.txt"

# --- README ------------------------------------------------------------------
if [ -n "$MODEL_NAME" ]; then
    RUN_MODEL=$MODEL_NAME
    MODEL_LINE="The model $MODEL_NAME is included; its license is its publisher's."
else
    RUN_MODEL=path/to/model.gguf
    MODEL_LINE="No model is included: copy a GGUF model next to this folder."
fi
GPU_LINE=""
if [ -n "$GPU" ]; then
    GPU_LINE="
GPU         for layers on the GPU (ggml's $GPU backend, lib/libggml-$GPU.so):
            ${GPU_LIBS% } and the GPU's driver; without them it
            serves on the CPU and says why (--list-devices lists what it finds)"
fi
if [ "$GPU" = cuda ]; then
    # which cards it runs on: a card whose architecture has neither machine
    # code here nor PTX of an older one finds no kernel for its layers
    GPU_LINE="$GPU_LINE
CUDA archs  $(bash scripts/build_lib.sh --cuda-archs)
            (as CMake names them: -real machine code, -virtual PTX, which the
            driver compiles at first start for that architecture and every
            later one; no suffix, both)"
fi
cat >"$STAGE/README.txt" <<EOF
offgrid $VERSION for Linux $ARCH: a local LLM server that needs only python3
========================================================================

Run it; no pip, no compiler, no network, no site-packages:

    cd $NAME
    python3 -m offgrid -m $RUN_MODEL

or in isolated mode (-I: no site-packages, no PYTHON* variables), from here or
from anywhere:

    python3 -I . -m $RUN_MODEL
    python3 -I /path/to/$NAME -m /path/to/model.gguf

It is ready when it prints "listening on http://127.0.0.1:8080"; open that
address in a browser for the chat page (nothing is fetched from elsewhere), or

    curl -s http://127.0.0.1:8080/health
    curl -s http://127.0.0.1:8080/completion -d '{"prompt": "Hello", "n_predict": 16}'

\`python3 -m offgrid --help\` lists the flags.  $MODEL_LINE

What the target machine needs
-----------------------------
Python      3.9 or newer, standard library only
glibc       $GLIBC or newer (the highest GLIBC_ symbol version lib/ uses)
libstdc++   one with GLIBCXX_$GLIBCXX; libgcc_s with GCC_$GCC_S (both come with GCC)
libraries   ${SYSTEM_LIBS% }
CPU         any $ARCH: the best of these builds is chosen at start-up:
            ${variants% }$GPU_LINE

\`ldd --version\` prints the glibc version; \`ldd lib/libllama.so\` names any
library or symbol version the machine lacks.

To install it as the command \`offgrid\` instead, where pip exists (still offline):

    python3 -m pip install --no-index $WHEEL
    OFFGRID_LIB=\$PWD/lib offgrid -m $RUN_MODEL      # or: offgrid --lib \$PWD/lib ...

Contents
--------
offgrid/      the Python package
__main__.py   lets \`python3 -I <this folder>\` run the package
lib/          libllama, libmtmd (--mmproj) and ggml, built portable (no -march=native) with glibc $HOST_GLIBC$RPC_NOTE
              from llama.cpp as vendored in the llama-cpp-python 0.3.36 sdist, with
              offgrid's patches (scripts/patches in its source; one aligns a buffer)
LICENSES/     llama.cpp's MIT license (it covers ggml) and the notices of code in lib/
$WHEEL
              the same package, as a wheel
SHA256SUMS    check the copy: sha256sum -c SHA256SUMS
EOF

(cd "$STAGE" && find . -type f | sed 's#^\./##' | sort | grep -v '^SHA256SUMS$' \
    | xargs sha256sum) >"$STAGE/SHA256SUMS"

# --- the tarball -----------------------------------------------------------------
# Files owned by root in name order: nothing of the build machine's users leaks.
OUT=$DIST/$NAME.tar.gz
tar --sort=name --owner=0 --group=0 --numeric-owner \
    -C "$WORK" -cf - "$NAME" | gzip -n >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
cp "$WORK/wheel/$WHEEL" "$DIST/"
log "wrote $OUT ($(du -h "$OUT" | cut -f1)); runs on glibc >= $GLIBC; CPU variants: $variants"
