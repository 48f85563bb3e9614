#!/usr/bin/env bash
# A CUDA toolchain without the system package, for `make lib GPU=cuda`: NVIDIA's
# PyPI wheels (nvcc with NVVM and the C runtime headers, the runtime, cuBLAS
# and CCCL's headers) installed into a virtualenv in $OFFGRID_CACHE.  CUDA
# 13's wheels all install under one prefix, site-packages/nvidia/cu13, laid
# out as a toolkit (bin/nvcc, include/, lib/), which CMake's FindCUDAToolkit
# takes as CUDAToolkit_ROOT once lib64/ points at lib/.  Prints that folder.
#
# Why CUDA 13 and not the -cu12 wheels: nvidia-cuda-nvcc-cu12 (12.6 and 12.9
# looked at) ships ptxas alone, no nvcc; nvidia-cuda-nvcc 13 ships the whole
# compiler.  CUDA 13 needs an NVIDIA driver of the 580 series or later on the
# machine that runs it, and builds for Turing (sm_75) and later.
#
# The driver's library (libcuda.so) comes with the NVIDIA driver, not with
# any wheel: ggml-cuda links it (its virtual memory pool), so the build links
# against a stub of it made here (an empty function for each of cuda.h's, as
# the toolkit's lib64/stubs has); at run time the real one is found on the
# machine with the GPU.
set -euo pipefail
CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}
CUDA_VERSION=13.0
WHEELS="nvidia-cuda-nvcc==$CUDA_VERSION.* nvidia-cuda-runtime==$CUDA_VERSION.*
nvidia-cuda-crt==$CUDA_VERSION.* nvidia-nvvm==$CUDA_VERSION.*
nvidia-cublas==$CUDA_VERSION.* nvidia-cuda-cccl==$CUDA_VERSION.*"
VENV=$CACHE/cuda-toolchain-$CUDA_VERSION
ROOT=$VENV/toolkit
log() { echo "[make lib] $*" >&2; }

if [ ! -f "$ROOT/.done" ]; then
    exec 9>"$VENV.lock"
    command -v flock >/dev/null && flock 9
fi
if [ ! -f "$ROOT/.done" ]; then
    log "installing NVIDIA's CUDA $CUDA_VERSION wheels (nvcc, runtime, cuBLAS, CCCL) into $VENV"
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check $WHEELS
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cu=$site/nvidia/cu13
    [ -x "$cu/bin/nvcc" ] || { log "the CUDA wheels have no bin/nvcc under $cu"; exit 1; }
    rm -rf "$ROOT"; ln -s "$cu" "$ROOT"
    [ -e "$cu/lib64" ] || ln -s lib "$cu/lib64"
    mkdir -p "$cu/lib/stubs"
    # the names the linker asks for: libcudart.so, libcublas.so, libcublasLt.so
    (cd "$cu/lib" && for f in lib*.so.[0-9]*; do
        base=${f%%.so.*}.so; [ -e "$base" ] || ln -s "$f" "$base"; done)
    # the driver's stub: an empty function for each of cuda.h's, by the name the
    # header's macros give it (cuMemAlloc is cuMemAlloc_v2), so that whatever
    # links ggml-cuda (ggml-rpc-server) finds every symbol
    tmp=$(mktemp -d)
    { echo '#include <cuda.h>'
      grep -o 'CUDAAPI cu[A-Za-z0-9_]*' "$ROOT/include/cuda.h" | awk '{print "OFFGRID_STUB " $2}' | sort -u
    } >"$tmp/names.c"
    cc -E -I "$ROOT/include" "$tmp/names.c" | awk '/^OFFGRID_STUB/ {print "void " $2 "(void) {}"}' \
        | sort -u >"$tmp/stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cu/lib/stubs/libcuda.so" "$tmp/stub.c"
    rm -rf "$tmp"
    touch "$ROOT/.done"
fi
# by its soname too: linking an executable against libggml-cuda (ggml-rpc-server)
# looks for the libraries that one needs by those names (build_lib.sh's
# -rpath-link); never on a run path
[ -e "$ROOT/lib/stubs/libcuda.so.1" ] || ln -s libcuda.so "$ROOT/lib/stubs/libcuda.so.1"
echo "$ROOT"
