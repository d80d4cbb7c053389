"""Files of the Batch API (inputs, outputs, errors) in a directory every gateway process
reaches (GGUFQ_DATA_DIR: on several hosts, a shared mount).

A file is two entries: ``<id>`` (its bytes) and ``<id>.json`` (OpenAI's file object, with
the tenant that owns it and when it expires), each written whole under a temporary name and
renamed into place, so a process killed mid-write leaves no half file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scheduler.errors import InvalidRequest, NotFound
from scheduler.settings import Settings

PURPOSES = frozenset({"batch", "batch_output"})


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


class FileStore:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root) / "files"
        self.max_bytes = max_bytes

    def create(
        self,
        data: bytes | Iterable[bytes],
        filename: str,
        purpose: str,
        tenant: str,
        keep_s: float,
        file_id: str | None = None,
    ) -> dict[str, Any]:
        """Store ``data`` (bytes, or lines written one by one, each ended by a newline)
        and return its file object under a new id, or ``file_id``."""
        if purpose not in PURPOSES:
            raise InvalidRequest(f"purpose {purpose!r} is not served: files here are for 'batch'")
        if isinstance(data, bytes) and len(data) > self.max_bytes:  # an output is what it is
            raise InvalidRequest(
                f"the file has {len(data):,} bytes; a batch file holds at most "
                f"{self.max_bytes:,} (GGUFQ_BATCH_MAX_FILE_BYTES): split it into several batches"
            )
        file_id = file_id or new_file_id()
        self.root.mkdir(parents=True, exist_ok=True)
        size = _write(
            self.root / file_id,
            [data] if isinstance(data, bytes) else data,
            lines=not isinstance(data, bytes),
        )
        now = int(time.time())
        meta = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": now,
            "expires_at": now + int(keep_s),
            "filename": Path(filename or "input.jsonl").name[:255],
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
            "tenant": tenant,
        }
        _write(self.root / f"{file_id}.json", [json.dumps(meta).encode()])
        return meta

    def get(self, file_id: str, tenant: str | None) -> dict[str, Any]:
        """A file's object; ``tenant`` None sees every tenant's (an admin key)."""
        path = self._meta_path(file_id)
        try:
            meta: dict[str, Any] = json.loads(path.read_bytes())
        except (OSError, ValueError):
            raise _not_found(file_id) from None
        if tenant is not None and meta.get("tenant") != tenant:
            raise _not_found(file_id)
        return meta

    def content(self, file_id: str, tenant: str | None) -> bytes:
        self.get(file_id, tenant)
        try:
            return (self.root / file_id).read_bytes()
        except OSError:
            raise _not_found(file_id) from None

    def delete(self, file_id: str, tenant: str | None) -> None:
        self.get(file_id, tenant)
        for path in (self._meta_path(file_id), self.root / file_id):
            path.unlink(missing_ok=True)

    def listing(self, tenant: str | None) -> list[dict[str, Any]]:
        found = []
        for path in self.root.glob("file-*.json") if self.root.is_dir() else ():
            try:
                meta = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            if tenant is None or meta.get("tenant") == tenant:
                found.append(meta)
        return sorted(found, key=lambda m: m.get("created_at", 0), reverse=True)

    def expire(self, now: float, keep: set[str]) -> int:
        """Delete files past their expiry, except ``keep`` (inputs of batches not ended),
        and what a process killed mid-write left (a part file, or bytes without their
        object) an hour on."""
        gone = 0
        for path in self.root.glob(".*.part") if self.root.is_dir() else ():
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < now - 3600:
                    path.unlink()
        for path in self.root.glob("file-*") if self.root.is_dir() else ():
            with contextlib.suppress(OSError):
                orphan = path.suffix != ".json" and not path.with_name(f"{path.name}.json").exists()
                if orphan and path.stat().st_mtime < now - 3600:
                    path.unlink()
        for meta in self.listing(None):
            if meta.get("expires_at", now + 1) <= now and meta["id"] not in keep:
                self.delete(meta["id"], None)
                gone += 1
        return gone

    def _meta_path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].replace("-", "").isalnum():
            raise _not_found(file_id)
        return self.root / f"{file_id}.json"


def public(meta: dict[str, Any]) -> dict[str, Any]:
    """A file object as the API shows it (without its tenant)."""
    return {k: v for k, v in meta.items() if k != "tenant"}


def _write(path: Path, chunks: Iterable[bytes], lines: bool = False) -> int:
    """Write ``chunks`` (each ended by a newline, with ``lines``) whole, or not at all;
    returns the bytes written."""
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
    size = 0
    with open(partial, "wb") as out:
        for chunk in chunks:
            out.write(chunk)
            size += len(chunk)
            if lines:
                out.write(b"\n")
                size += 1
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    return size


def _not_found(file_id: str) -> NotFound:
    return NotFound(
        f"no file {file_id[:80]!r} (it was deleted, it expired, or it is another key's)"
    )


def file_store(settings: Settings) -> FileStore:
    """The files of this host's data directory (GGUFQ_DATA_DIR), as the settings bound them."""
    return FileStore(settings.data_dir, settings.batch_max_file_bytes)
