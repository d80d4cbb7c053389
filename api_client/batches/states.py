"""A server-side batch's life, as data: its named states (OpenAI's), who moves it from each
state to which, and what happens when the process driving it dies.

Every move is a compare-and-set on the batch's state in Redis (lua/batch_move.lua is given
the states a move may start from, taken from :data:`MOVES`); the driver's moves and line
writes also check its lease, so a driver that stalled past its lease writes nothing.

Pure: no Redis, no clock (``now`` is an argument).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from scheduler.errors import InvalidRequest
from scheduler.units import parse_duration_s

# what a batch's lines may ask for (lines.py checks their bodies)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_WINDOW_S = 86400.0  # its longest completion window (OpenAI's one): job ids' claims
# (GGUFQ_RESULT_TTL_S, a day) outlive it


class BatchState(StrEnum):
    VALIDATING = "validating"  # its input file is being read and checked
    IN_PROGRESS = "in_progress"  # its lines run as batch-priority jobs
    FINALIZING = "finalizing"  # every line ended: its output and error files are written
    COMPLETED = "completed"
    FAILED = "failed"  # its input was refused (the batch's errors say where)
    EXPIRED = "expired"  # its completion window passed: lines not done are in the errors
    CANCELLING = "cancelling"  # asked to cancel: its jobs in flight are being stopped
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in ENDED


ENDED = frozenset(
    {BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLED}
)


class Mover(StrEnum):
    DRIVER = "driver"  # the process holding the batch's lease
    CALLER = "caller"  # whoever asks the API (its key's own batches)


@dataclass(frozen=True)
class Move:
    source: BatchState
    target: BatchState
    by: Mover
    when: str


B = BatchState
MOVES: tuple[Move, ...] = (
    Move(B.VALIDATING, B.IN_PROGRESS, Mover.DRIVER, "every line of the input is valid"),
    Move(B.VALIDATING, B.FAILED, Mover.DRIVER, "the input is refused, with each line's error"),
    Move(B.VALIDATING, B.CANCELLING, Mover.CALLER, "cancel asked"),
    Move(B.IN_PROGRESS, B.FINALIZING, Mover.DRIVER, "every line ended"),
    Move(B.IN_PROGRESS, B.FAILED, Mover.DRIVER, "its input file is gone: what ended is kept"),
    Move(B.IN_PROGRESS, B.EXPIRED, Mover.DRIVER, "the window passed: lines left expire"),
    Move(B.IN_PROGRESS, B.CANCELLING, Mover.CALLER, "cancel asked"),
    Move(B.FINALIZING, B.COMPLETED, Mover.DRIVER, "its output and error files written"),
    Move(B.FINALIZING, B.FAILED, Mover.DRIVER, "its input file is gone: what ended is kept"),
    Move(B.CANCELLING, B.CANCELLED, Mover.DRIVER, "its jobs stopped, what ended written out"),
)


def batch_doc(
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    tenant: str,
    weight: float,
    now: float,
) -> dict[str, Any]:
    """What a new batch is created with (its input file's id added by the caller),
    checked: an endpoint batches serve, a window of at most MAX_WINDOW_S."""
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"endpoint {endpoint!r} is not served for batches: use one of {', '.join(ENDPOINTS)}"
        )
    try:
        window_s = parse_duration_s(completion_window)
    except ValueError as exc:
        raise InvalidRequest(f"completion_window: {exc}") from None
    if not 0 < window_s <= MAX_WINDOW_S:
        raise InvalidRequest("completion_window must be more than 0 and at most 24h, e.g. 24h")
    return {
        "endpoint": endpoint,
        "completion_window": completion_window,
        "expires_at": int(now + window_s),
        "metadata": metadata,
        "tenant": tenant,
        "weight": weight,
    }


def sources(target: BatchState, by: Mover) -> list[BatchState]:
    """The states from which ``by`` may move a batch to ``target``."""
    return [m.source for m in MOVES if m.target is target and m.by is by]


@dataclass(frozen=True)
class Lapse:
    state: BatchState
    then: str


# what happens to a batch in each state when the process driving it dies (its lease, on
# Redis's clock, lapses): another gateway process takes the lease and goes on from the
# batch's record, where every line's end and every job it sent are written
LAPSES: tuple[Lapse, ...] = (
    Lapse(B.VALIDATING, "read and checked again"),
    Lapse(
        B.IN_PROGRESS,
        "lines ended stay ended; lines whose job was sent wait for that job (same id: it "
        "runs once); the others are sent",
    ),
    Lapse(B.FINALIZING, "its files are written again (each driver's under ids of its own)"),
    Lapse(B.CANCELLING, "its jobs still in flight are cancelled again, then as before"),
)


def tables() -> str:
    """README's tables of :data:`MOVES` and :data:`LAPSES`."""
    lines = ["| from | to | by | when |", "|---|---|---|---|"]
    lines += [f"| {m.source} | {m.target} | {m.by} | {m.when} |" for m in MOVES]
    lines += ["", "| state | its driver dies: |", "|---|---|"]
    lines += [f"| {lapse.state} | {lapse.then} |" for lapse in LAPSES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(tables(), end="")
