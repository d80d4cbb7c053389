"""How a worker publishes one job's chunks: in order, held while the run is not known to be
the job's, with the tokens each chunk carries (through a :class:`workers.chunks.ChunkWriter`,
or directly)."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis

from scheduler.midstream import TOKENS, Skip, SoFar
from scheduler.store.streams import write_chunk
from workers.chunks import ChunkWriter
from workers.pending import Pending


class ChunkPublisher:
    """Publishes the chunks of one job, in order: directly, or through a ChunkWriter.

    One that :meth:`holds` keeps what it is given until :meth:`release` (the job is this
    run's: publish it all) or :meth:`discard` (it is not: publish nothing, ever).

    ``tokens`` is the answer's token ids, to which the text relay appends each one the
    decode loop samples; each chunk carries those added since the previous chunk
    (scheduler/midstream.py). A resumed run (:meth:`resume`) starts from what the stream
    holds."""

    def __init__(
        self,
        client: redis.Redis,
        job_id: str,
        ttl_s: int,
        writer: ChunkWriter | None = None,
        fence: str = "",
    ) -> None:
        self.r = client
        self.job_id = job_id
        self.ttl_s = ttl_s
        self.writer = writer
        self.fence = fence  # the placement id this run writes as (lua/append.lua)
        self.seq = 0
        self._pending: Pending | None = None  # the last chunk put to the writer
        self._first: Pending | None = None  # the job's first chunk of text
        # when the job got its slot, when its first text was published, and when that was
        # in Redis (scheduler/store/hops.py)
        self.admitted_at = self.first_token_at = self.first_written_at = 0.0
        self._lock = threading.Lock()  # the text relay publishes, the job's thread too
        self._held: list[tuple[dict[str, Any], bool]] | None = None
        self._discarded = False
        self.tokens: list[int] = []
        self._sent = 0  # of ``tokens``, those a chunk carries already
        self._skip: Skip | None = None

    def resume(self, so_far: SoFar) -> None:
        """Go on after what the job's stream holds: its seq, its tokens, and the text the
        run replays of them dropped (:class:`scheduler.midstream.Skip`)."""
        self.seq = so_far.seq
        self.tokens = list(so_far.tokens)
        self._sent = len(self.tokens)
        self._skip = Skip(so_far)

    def hold(self) -> None:
        with self._lock:
            self._held = []

    @property
    def holding(self) -> bool:
        """Whether it holds its chunks back (its run's start is not claimed yet)."""
        return self._held is not None

    def release(self, publish_held: bool = True) -> None:
        with self._lock:
            held, self._held = self._held or [], None
            for chunk, first in held if publish_held else ():
                self._publish(chunk, first)

    def discard(self) -> None:
        with self._lock:
            self._held, self._discarded = None, True

    def publish(self, chunk: dict[str, Any]) -> None:
        with self._lock:
            if self._skip is not None:
                trimmed = self._skip(chunk)
                if trimmed is None:
                    return  # streamed before: a resumed run replays it
                chunk = trimmed
            chunk = {**chunk, TOKENS: self.tokens[self._sent :]}
            self._sent = len(self.tokens)
            first = not self.first_token_at and bool(chunk.get("response") or chunk.get("thinking"))
            if first:
                self.first_token_at = time.time()
            if self._discarded:
                return
            if self._held is not None:
                self._held.append((chunk, first))
                return
            self._publish(chunk, first)

    def _publish(self, chunk: dict[str, Any], first: bool) -> None:
        if self.writer is not None:
            if self.writer.extend(self._pending, chunk):
                return
            self.seq += 1
            if self.seq == 1:  # its time to first token: written at once if Redis is quick
                pending = Pending(self.job_id, 1, dict(chunk), self.ttl_s, self.fence)
                if self.writer.write_now(pending):
                    self._pending = None
                    self._first = pending if first else None
                    return
                # its write may have landed though its answer did not: the copy the thread
                # writes is then refused whole as a duplicate, so it must stay as it was
                # (text joined to it would be lost); the next text makes a chunk of its own
                again = self.writer.put(self.job_id, 1, chunk, self.ttl_s, self.fence)
                self._pending, self._first = None, again if first else None
                return
            self._pending = self.writer.put(self.job_id, self.seq, chunk, self.ttl_s, self.fence)
            if first:
                self._first = self._pending
            return
        self.seq += 1
        write_chunk(self.r, self.job_id, self.seq, chunk, self.ttl_s, self.fence)
        if first:
            self.first_written_at = time.time()

    def flush(self) -> None:
        """Return once every chunk published so far is in Redis (or the writer gave up on
        it: Redis away past its outage bound)."""
        if self.writer is not None:
            self.writer.flush(self.writer.outage_s + 30.0, self.job_id)

    def last_seq(self) -> int:
        """The seq of the job's last chunk, which the job's end writes itself (lua/end.lua,
        with the in-flight record and the runner's count), once every chunk published
        before it is in Redis: nothing is published after it."""
        with self._lock:
            self.seq += 1
            seq = self.seq
        self.flush()
        return seq

    def hops(self) -> dict[str, float]:
        """The job's slot, first token and first written chunk, as far as they happened."""
        written = self._first.written_at if self._first is not None else self.first_written_at
        found = {
            "admitted": self.admitted_at,
            "first_token": self.first_token_at,
            "first_chunk_written": written,
        }
        return {name: at for name, at in found.items() if at}
