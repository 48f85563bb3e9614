#!/usr/bin/env bash
# Build libllama and its ggml libraries from the pinned llama.cpp source and
# install them into lib/.
#
# The source is llama.cpp as vendored by the llama-cpp-python sdist on PyPI
# (the only registry we can reach); we use its C/C++ source, never its Python.
# Everything downloaded or built lives in $OFFGRID_CACHE (~/.cache/offgrid),
# keyed by version + hash + patch set + build flavour, so a fresh clone does not
# rebuild.
#
# libllama is built from a copy of that source with scripts/patches/*.patch
# applied (each says why), and so are llama-server and llama-bench: the
# benchmark compares the servers, not where each process's heap happened to
# put a buffer (see the first patch).
#
# lib/ gets a build for this CPU (-march=native).  PORTABLE=1 builds the
# offline bundle's instead: ggml's CPU backend compiled for the x86 feature
# levels in CPU_VARIANTS, the best one for the CPU loaded at start-up
# (scripts/patches/0002); CPU_VARIANTS=all builds ggml's whole list (14, some
# 16 minutes on 2 cores).  Measured here, the portable build evaluates
# prompts 4-9% slower than the native one, so it is not used for lib/
# (docs/install.md, "The portable build").
#
# ggml is built with its RPC backend (ggml-rpc.h), which offgrid's --rpc uses,
# and llama.cpp's ggml-rpc-server with it (docs/rpc.md); RPC=0
# leaves both out.
#
# libmtmd (tools/mtmd: the image and audio encoders of an mmproj, and its
# helper's decoding of image and audio files) is built beside libllama
# always, without video (MTMD_VIDEO=OFF: no ffmpeg); offgrid loads it only
# for --mmproj (offgrid/libmtmd.py).  Its name is in the build key, so a
# cached build from before it does not hide it.
#
# usage: scripts/build_lib.sh [DEST]
#        scripts/build_lib.sh --rpc-server [DEST]
#                                            the same, and ggml-rpc-server beside
#                                            the libraries it loads
#        scripts/build_lib.sh --server       llama-server and llama-bench from the
#                                            same source, for benchmarks and golden
#                                            files; prints the folder holding them
#        scripts/build_lib.sh --stock-server llama-server from the pinned source
#                                            without our patches (what users run),
#                                            for the benchmark's third column;
#                                            prints the folder holding it
#        scripts/build_lib.sh --tools [DEST] the same, and llama-server and
#                                            llama-bench built in this flavour's
#                                            own tree, linked against the same
#                                            libraries, beside them in DEST: a
#                                            GPU machine's like-for-like
#                                            measurement (bench/gpu.py)
#        scripts/build_lib.sh --cuda-archs   prints the CUDA architectures a
#                                            GPU=cuda build compiles (CUDA_ARCHS
#                                            or the default below), builds nothing
set -euo pipefail

case "${1:-}" in
    --server) MODE=server; shift ;;
    --rpc-server) MODE=rpc-server; shift ;;
    --tools) MODE=tools; shift ;;
    --stock-server) MODE=stock; shift ;;
    --cuda-archs) MODE=cuda-archs; shift ;;
    *) MODE=lib ;;
esac

PKG_VERSION=0.3.36
PKG_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SHORT=${PKG_SHA256:0:12}
CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}
PORTABLE=${PORTABLE:-0}
RPC=${RPC:-1}
# GPU=vulkan or GPU=cuda: ggml's backend for that device beside the CPU one,
# cached under its own key and installed into lib/$GPU/ (not lib/), so the
# CPU build that `make test` loads stays as it is; offgrid loads a GPU build
# with --lib lib/vulkan or OFFGRID_LIB (docs/gpu.md).
GPU=${GPU:-}
case "$GPU" in
    ""|cpu) GPU= ;;
    vulkan|cuda) ;;
    *) echo "[make lib] GPU=$GPU: want vulkan or cuda (or nothing for the CPU only)" >&2; exit 2 ;;
esac
DEST=${1:-lib${GPU:+/$GPU}}
# CUDA: the architectures nvcc compiles for (CMAKE_CUDA_ARCHITECTURES), with
# the CUDA 13 toolchain of scripts/cuda_toolchain.sh.  The default is ggml's
# own list for CUDA 13:
# machine code for RTX 30xx (86) and RTX 40xx/L4 (89), PTX that the driver
# compiles at first start for Turing (75), Ampere (80: A100) and Hopper and
# later (90: H100/H200; Blackwell runs it too).  Name only your card's for a
# build a fraction as long: CUDA_ARCHS=90-real (H100), 86-real (RTX 3090).
CUDA_ARCHS=${CUDA_ARCHS:-75-virtual;80-virtual;86-real;89-real;90-virtual}
[ "$MODE" != cuda-archs ] || { echo "$CUDA_ARCHS"; exit 0; }
# Which of ggml's variants (ggml/src/CMakeLists.txt) a portable build compiles:
# the baseline x86-64 and SSE4.2 (any x86-64 machine runs one), AVX without
# AVX2 (2011-2013), AVX2 (from 2013; this machine), AVX-VNNI without AVX-512
# (Intel laptops since 2021), AVX-512 and AVX-512 with VNNI/VBMI (servers, Zen 4).
# Left out, each served by the next one down: ivybridge, piledriver,
# cannonlake, cascadelake, cooperlake, zen4, sapphirerapids.
CPU_VARIANTS=${CPU_VARIANTS:-x64 sse42 sandybridge haswell alderlake skylakex icelake}
# A native build for an x86 CPU with AMX (Sapphire Rapids and later) leaves
# ggml's AMX matrix path out: with it every decode of a Q4_K model segfaults
# in ggml_backend_amx_mul_mat on such a machine (seen here on a 2-core Xeon
# VM: libllama, llama-server and llama-bench alike; llama.cpp issue 20824,
# unfixed upstream).  The AVX-512 path serves those products instead.  An
# explicit -mno-* wins over -march=native whatever their order.  A compiler
# that does not know the flags (GCC before 11) cannot emit AMX either, and
# gets none.  The portable build has no AMX variant (sapphirerapids is left
# out above).
NATIVE_CFLAGS=
NATIVE_KEY=
if [ "$(uname -m)" = x86_64 ] && echo 'int x;' | "${CC:-cc}" -mno-amx-tile -mno-amx-int8 \
        -mno-amx-bf16 -x c -c -o /dev/null - 2>/dev/null; then
    NATIVE_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    NATIVE_KEY=-noamx
fi
if [ "$PORTABLE" != 1 ]; then
    FLAVOUR=native$NATIVE_KEY
elif [ "$CPU_VARIANTS" = all ]; then
    FLAVOUR=portable
else
    FLAVOUR=portable-$(echo "$CPU_VARIANTS" | sha256sum | cut -c1-6)
fi
FLAVOUR=$FLAVOUR$([ "$RPC" = 1 ] && echo -rpc || true)-mtmd
case "$GPU" in
    vulkan) FLAVOUR=$FLAVOUR-vulkan ;;
    cuda) FLAVOUR=$FLAVOUR-cuda-$(echo "$CUDA_ARCHS" | sed 's/-real//g; s/-virtual/v/g; s/[^0-9a-z]/_/g') ;;
esac

SDIST_DIR=$CACHE/llama-cpp-python-$PKG_VERSION-$SHORT
SDIST=$SDIST_DIR/llama_cpp_python-$PKG_VERSION.tar.gz
SRC=$SDIST_DIR/src/llama_cpp_python-$PKG_VERSION/vendor/llama.cpp
shopt -s nullglob
PATCHES=("$(dirname "$0")"/patches/*.patch)          # applied in name order
PATCH_ID=$(cat /dev/null "${PATCHES[@]}" | sha256sum | cut -c1-8)
LIB_SRC=$CACHE/llama.cpp-$PKG_VERSION-$SHORT-p$PATCH_ID       # SRC with PATCHES applied
# A GPU build's own patches (scripts/patches/$GPU/: its backend's source
# only), applied after those to a copy of its own, so that the CPU builds'
# key and source are the same with or without them
GPU_PATCHES=()
[ -z "$GPU" ] || GPU_PATCHES=("$(dirname "$0")"/patches/"$GPU"/*.patch)
if [ ${#GPU_PATCHES[@]} -gt 0 ]; then
    PATCH_ID=$PATCH_ID-$GPU$(cat "${GPU_PATCHES[@]}" | sha256sum | cut -c1-8)
    LIB_SRC=$CACHE/llama.cpp-$PKG_VERSION-$SHORT-p$PATCH_ID
    PATCHES+=("${GPU_PATCHES[@]}")
fi
BUILD=$CACHE/build-$PKG_VERSION-$SHORT-p$PATCH_ID-$FLAVOUR
INSTALLED=$BUILD/installed

log() { echo "[make lib] $*" >&2; }

fetch_source() {
    mkdir -p "$SDIST_DIR"
    if [ ! -f "$SDIST" ]; then
        log "downloading llama-cpp-python==$PKG_VERSION sdist (pinned llama.cpp source)"
        local tmp; tmp=$(mktemp -d "$SDIST_DIR/dl.XXXXXX")
        python3 -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
            "llama-cpp-python==$PKG_VERSION" -d "$tmp" 2>/dev/null \
          || python3 -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$PKG_VERSION" -d "$tmp"
        mv "$tmp/llama_cpp_python-$PKG_VERSION.tar.gz" "$SDIST"
        rm -rf "$tmp"
    fi
    local got; got=$(sha256sum "$SDIST" | cut -d' ' -f1)
    if [ "$got" != "$PKG_SHA256" ]; then
        log "sha256 mismatch for $SDIST: got $got, want $PKG_SHA256"
        rm -f "$SDIST"; exit 1
    fi
    if [ ! -f "$SRC/include/llama.h" ]; then
        log "unpacking"
        rm -rf "$SDIST_DIR/src"; mkdir -p "$SDIST_DIR/src"
        tar xzf "$SDIST" -C "$SDIST_DIR/src"
    fi
}

# A copy of SRC with PATCHES applied, made once per patch set.
patch_source() {
    if [ -f "$LIB_SRC/.patched" ]; then
        return
    fi
    log "applying scripts/patches to a copy of the source in $LIB_SRC"
    local tmp p; tmp=$(mktemp -d "$CACHE/patching.XXXXXX")
    cp -a "$SRC/." "$tmp/"
    for p in "${PATCHES[@]}"; do
        patch --quiet --forward -p1 -d "$tmp" <"$p" \
          || { log "$p does not apply to llama.cpp from llama-cpp-python==$PKG_VERSION"; rm -rf "$tmp"; exit 1; }
    done
    touch "$tmp/.patched"
    # rename is atomic; if another build got there first, its copy stands
    # (removing it could pull the source from under that build)
    mv -T "$tmp" "$LIB_SRC" 2>/dev/null || rm -rf "$tmp"
    [ -f "$LIB_SRC/.patched" ] || { log "$LIB_SRC is not a patched source; remove it"; exit 1; }
}

build() {
    if [ -f "$INSTALLED/.done" ]; then
        log "cached build: $INSTALLED"
        return
    fi
    # one build of a flavour at a time (`make lib` beside the bundle's or an
    # RPC test's): the second waits, then finds it done
    mkdir -p "$CACHE"
    if command -v flock >/dev/null; then
        exec 9>"$BUILD.lock"
        flock 9
        if [ -f "$INSTALLED/.done" ]; then
            log "cached build: $INSTALLED"
            return
        fi
    fi
    local cpu_flags
    if [ "$PORTABLE" = 1 ]; then
        cpu_flags="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON"
        # scripts/patches/0002: only these are compiled
        [ "$CPU_VARIANTS" = all ] || cpu_flags="$cpu_flags -DGGML_CPU_VARIANTS=${CPU_VARIANTS// /;}"
    else
        cpu_flags="-DGGML_NATIVE=ON"
    fi
    local native=()
    [ "$PORTABLE" = 1 ] || [ -z "$NATIVE_CFLAGS" ] \
        || native=("-DCMAKE_C_FLAGS=$NATIVE_CFLAGS" "-DCMAKE_CXX_FLAGS=$NATIVE_CFLAGS")
    # ggml's RPC backend (ggml-rpc.h) and its ggml-rpc-server, which lives
    # under tools/: configuring tools needs common, but only the targets
    # named below are built
    local rpc_flags targets=(llama mtmd)
    if [ "$RPC" = 1 ]; then
        rpc_flags="-DGGML_RPC=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON"
        targets+=(ggml-rpc-server)
    else
        rpc_flags="-DGGML_RPC=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TOOLS=OFF"
    fi
    local gpu_flags=()
    case "$GPU" in
        vulkan) gpu_flags=(-DGGML_VULKAN=ON) ;;
        # the toolchain from NVIDIA's PyPI wheels (cuda_toolchain below)
        cuda) gpu_flags=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHS"
                         "-DCUDAToolkit_ROOT=$CUDA_ROOT" "-DCMAKE_CUDA_COMPILER=$CUDA_ROOT/bin/nvcc"
                         -DGGML_CUDA_NCCL=OFF
                         # an executable linked against libggml-cuda (ggml-rpc-server):
                         # ld resolves what that library needs (libcublas.so.13, the
                         # driver's libcuda.so.1: the stub) in these folders
                         "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$CUDA_ROOT/lib:$CUDA_ROOT/lib/stubs") ;;
    esac
    log "configuring ($FLAVOUR) in $BUILD"
    # shellcheck disable=SC2086
    cmake -S "$LIB_SRC" -B "$BUILD/cmake" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF $rpc_flags \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF \
        -DLLAMA_BUILD_MTMD=ON -DMTMD_VIDEO=OFF \
        -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
        $cpu_flags "${native[@]}" "${gpu_flags[@]}" >"$BUILD.configure.log" 2>&1 \
      || { tail -30 "$BUILD.configure.log"; exit 1; }
    # the llama target pulls in ggml and, in a portable build, its CPU variants
    case "$GPU" in
        vulkan) log "building (about 8 minutes on 2 quiet cores, far longer beside other work: ggml-vulkan's shaders)" ;;
        cuda) log "building (hours on 2 cores: each of CUDA_ARCHS=$CUDA_ARCHS compiles ggml-cuda's kernels)" ;;
        *) log "building (about 4 minutes on 2 cores; 8 with PORTABLE=1, 16 with CPU_VARIANTS=all)" ;;
    esac
    cmake --build "$BUILD/cmake" --target "${targets[@]}" -j "$(nproc)" >"$BUILD.build.log" 2>&1 \
      || { tail -30 "$BUILD.build.log"; exit 1; }
    rm -rf "$INSTALLED"; mkdir -p "$INSTALLED"
    find "$BUILD/cmake/bin" -maxdepth 1 \( -name 'libllama.so*' -o -name 'libggml*.so*' -o -name 'libmtmd.so*' \) \
        -exec cp -a {} "$INSTALLED/" \;
    if [ "$GPU" = cuda ]; then
        # the CUDA runtime and cuBLAS beside libggml-cuda (its run path is
        # $ORIGIN): NVIDIA's licence lets an application carry these two; the
        # driver's libcuda.so.1 is the machine's own
        local l
        for l in cudart cublas cublasLt; do
            # the soname, libcudart.so.13: the shortest of its names
            cp -L "$(ls "$CUDA_ROOT"/lib64/lib$l.so.[0-9]* | sort | head -1)" "$INSTALLED/"
        done
    fi
    if [ "$RPC" = 1 ]; then
        mkdir -p "$INSTALLED/bin"
        cp "$BUILD/cmake/bin/ggml-rpc-server" "$INSTALLED/bin/"
    fi
    touch "$INSTALLED/.done"
}

# llama-server and llama-bench in the flavour's own tree: its options and
# the very libllama and ggml backends offgrid loads (shared, run path
# $ORIGIN), so that on a GPU the three differ in the server alone.  The
# tree's configuration gains the server (nothing the libraries are built
# from changes, so they are not rebuilt).
build_tools() {
    if [ -x "$INSTALLED/tools/llama-server" ] && [ -x "$INSTALLED/tools/llama-bench" ]; then
        return
    fi
    exec 9>"$BUILD.lock"
    command -v flock >/dev/null && flock 9
    log "building llama-server and llama-bench against this build's libraries (minutes)"
    cmake -S "$LIB_SRC" -B "$BUILD/cmake" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON >>"$BUILD.configure.log" 2>&1 \
      || { tail -30 "$BUILD.configure.log" >&2; exit 1; }
    cmake --build "$BUILD/cmake" --target llama-server llama-bench -j "$(nproc)" \
        >"$BUILD.tools.log" 2>&1 || { tail -30 "$BUILD.tools.log" >&2; exit 1; }
    # with the shared libraries they are built on (llama-common and each
    # tool's own -impl library), which are not libllama's and stay out of lib/
    rm -rf "$INSTALLED/tools"; mkdir -p "$INSTALLED/tools"
    find "$BUILD/cmake/bin" -maxdepth 1 \( -name llama-server -o -name llama-bench \
        -o -name 'libllama-common.so*' -o -name 'libllama-server-impl.so*' \
        -o -name 'libllama-bench-impl.so*' \) -exec cp -a {} "$INSTALLED/tools/" \;
}

# llama-server, llama-bench and llama-batched-bench, statically linked
# against their own build of SOURCE (the patched copy, or for --stock-server
# the pinned source as it ships), so they never pick up lib/ by accident.  usage: build_server SOURCE DIR
build_server() {
    local src=$1 dir=$2
    if [ -x "$dir/bin/llama-server" ] && [ -x "$dir/bin/llama-bench" ] \
            && [ -x "$dir/bin/llama-batched-bench" ]; then
        echo "$dir/bin"; return
    fi
    log "configuring llama-server in $dir (about 6 minutes on 2 cores)"
    cmake -S "$src" -B "$dir/cmake" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF -DGGML_NATIVE=ON \
        ${NATIVE_CFLAGS:+"-DCMAKE_C_FLAGS=$NATIVE_CFLAGS" "-DCMAKE_CXX_FLAGS=$NATIVE_CFLAGS"} \
        >"$dir.configure.log" 2>&1 \
      || { tail -30 "$dir.configure.log" >&2; exit 1; }
    cmake --build "$dir/cmake" --target llama-server llama-bench llama-batched-bench -j "$(nproc)" \
        >"$dir.build.log" 2>&1 || { tail -30 "$dir.build.log" >&2; exit 1; }
    mkdir -p "$dir/bin"
    cp "$dir/cmake/bin/llama-server" "$dir/cmake/bin/llama-bench" \
        "$dir/cmake/bin/llama-batched-bench" "$dir/bin/"
    echo "$dir/bin"
}

CUDA_ROOT=
if [ "$GPU" = cuda ] && [ "$MODE" != stock ] && [ "$MODE" != server ]; then
    CUDA_ROOT=$(bash "$(dirname "$0")/cuda_toolchain.sh")
fi
fetch_source
if [ "$MODE" = stock ]; then
    # keyed by the sdist's hash alone (and the native flags): no patches,
    # whatever scripts/patches holds
    build_server "$SRC" "$CACHE/llama-server-stock-$PKG_VERSION-$SHORT$NATIVE_KEY"
    exit 0
fi
patch_source
if [ "$MODE" = server ]; then
    build_server "$LIB_SRC" "$CACHE/llama-server-$PKG_VERSION-$SHORT-p$PATCH_ID$NATIVE_KEY"
    exit 0
fi
build
[ "$MODE" != tools ] || build_tools
mkdir -p "$DEST"
rm -f "$DEST"/libllama*.so* "$DEST"/libggml*.so* "$DEST"/libmtmd.so* "$DEST"/ggml-rpc-server \
    "$DEST"/llama-server "$DEST"/llama-bench
cp -a "$INSTALLED"/lib*.so* "$DEST/"
[ "$MODE" != tools ] || cp -a "$INSTALLED"/tools/. "$DEST/"
if [ "$MODE" = rpc-server ]; then
    [ -x "$INSTALLED/bin/ggml-rpc-server" ] || { log "no ggml-rpc-server in a build with RPC=0"; exit 1; }
    # beside the libraries: its run path is $ORIGIN, and a portable build's
    # ggml looks there for its CPU variants
    cp "$INSTALLED/bin/ggml-rpc-server" "$DEST/"
fi
ln -sfn "$SRC" "$CACHE/llama.cpp"   # stable path to the pinned source (llama.h, models/)
log "installed into $DEST: $(cd "$DEST" && ls lib*.so* | tr '\n' ' ')"
