#!/usr/bin/env bash
# A CUDA toolchain without the system package, for `make lib GPU=cuda`: NVIDIA's
# PyPI wheels (nvcc, the runtime, cuBLAS and CCCL's headers) installed into a
# virtualenv in $OFFGRID_CACHE, and a folder laid out as a CUDA toolkit
# (bin/nvcc, include/, lib64/) of links into them, which CMake's
# FindCUDAToolkit takes as CUDAToolkit_ROOT.  Prints that folder.
#
# The driver's library (libcuda.so) comes with the NVIDIA driver, not with
# any wheel: ggml-cuda links it for its virtual memory pool unless built with
# GGML_CUDA_NO_VMM, so the build links against a stub of it made here (a
# library with no code, named libcuda.so.1, as the toolkit's lib64/stubs
# has); at run time the real one is found on the machine with the GPU.
set -euo pipefail
CACHE=${OFFGRID_CACHE:-$HOME/.cache/offgrid}
CUDA_VERSION=12.9          # the wheels' minor version: nvcc 12.9 builds Blackwell (120) too
WHEELS="nvidia-cuda-nvcc-cu12==$CUDA_VERSION.* nvidia-cuda-runtime-cu12==$CUDA_VERSION.*
nvidia-cublas-cu12==$CUDA_VERSION.* nvidia-cuda-cccl-cu12==$CUDA_VERSION.*"
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
    nv=$site/nvidia
    rm -rf "$ROOT"; mkdir -p "$ROOT/include" "$ROOT/lib64/stubs"
    ln -s "$nv/cuda_nvcc/bin" "$ROOT/bin"
    ln -s "$nv/cuda_nvcc/nvvm" "$ROOT/nvvm"
    # one include/ and lib64/ of links, as a toolkit has them
    for part in cuda_nvcc cuda_runtime cublas cuda_cccl; do
        for f in "$nv/$part/include/"*; do [ -e "$ROOT/include/${f##*/}" ] || ln -s "$f" "$ROOT/include/"; done
        for f in "$nv/$part/lib/"*; do [ -e "$f" ] && ln -sf "$f" "$ROOT/lib64/"; done
    done
    # the names the linker asks for: libcudart.so, libcublas.so, libcublasLt.so
    (cd "$ROOT/lib64" && for f in lib*.so.[0-9]*; do
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
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib64/stubs/libcuda.so" "$tmp/stub.c"
    rm -rf "$tmp"
    touch "$ROOT/.done"
fi
echo "$ROOT"
