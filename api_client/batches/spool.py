"""Where a batch's driver keeps its lines' answers until the batch's files are written: an
append-only file of its own in GGUFQ_DATA_DIR/spool. Redis keeps only each answer's place
(``status|file:offset:length``), so a batch of 50,000 embeddings costs Redis kilobytes,
not gigabytes. An answer is on disk (flushed and synced) before its place is written, and
a driver that lost its lease writes into its own file, which nothing names."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import BinaryIO


class Spool:
    def __init__(self, root: Path, batch_id: str, tag: str) -> None:
        self.dir = Path(root) / "spool"
        self.name = f"{batch_id}.{tag}"
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._closed = False

    def append(self, data: bytes) -> str:
        """Write ``data`` durably; returns its place (for :func:`read`). Blocking."""
        with self._lock:
            if self._closed:  # its driver stopped: nothing may name what it writes now
                raise OSError(f"the spool {self.name} is closed")
            if self._file is None:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._file = open(self.dir / self.name, "ab")  # noqa: SIM115 - closed in close()
            offset = self._file.seek(0, os.SEEK_END)
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
            return f"{self.name}:{offset}:{len(data)}"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None


def read(root: Path, place: str) -> bytes | None:
    """The bytes at ``place`` (:meth:`Spool.append`'s answer); None when they are gone (no
    such file here, or cut short). Any other error of the disk is raised: a later try may
    read them."""
    try:
        name, offset, length = place.rsplit(":", 2)
        start, size = int(offset), int(length)
    except ValueError:
        return None
    if "/" in name or name.startswith("."):
        return None
    try:
        with open(Path(root) / "spool" / name, "rb") as spooled:
            spooled.seek(start)
            data = spooled.read(size)
    except FileNotFoundError:
        return None
    return data if len(data) == size else None


def remove(
    root: Path, batch_id: str, older_than: float | None = None, keep: frozenset[str] = frozenset()
) -> int:
    """Delete the batch's spool files (``batch_id`` "*": every batch's but those of
    ``keep``, with ``older_than`` seconds since their last write: what crashed drivers
    left)."""
    folder = Path(root) / "spool"
    gone = 0
    for path in folder.glob(f"{batch_id}.*") if folder.is_dir() else ():
        if path.name.split(".", 1)[0] in keep:
            continue
        try:
            if older_than is None or path.stat().st_mtime < time.time() - older_than:
                path.unlink()
                gone += 1
        except OSError:
            continue
    return gone
