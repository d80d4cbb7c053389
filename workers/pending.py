"""A chunk on its way to Redis through a worker's chunk writer (workers/chunks.py)."""

from __future__ import annotations

from typing import Any


class Pending:
    """A chunk queued in a :class:`ChunkWriter`; text may join it until the writer takes it."""

    __slots__ = ("job_id", "seq", "chunk", "ttl_s", "fence", "taken", "written_at")

    def __init__(
        self, job_id: str, seq: int, chunk: dict[str, Any], ttl_s: int, fence: str = ""
    ) -> None:
        self.job_id, self.seq, self.chunk, self.ttl_s = job_id, seq, chunk, ttl_s
        self.fence = fence  # written only while the job's holder is this placement id
        self.taken = False
        self.written_at = 0.0  # wall-clock time it was in Redis (or sent there: first_chunk.py)
