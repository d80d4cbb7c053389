"""Fair order of waiting work across tenants. Pure: no I/O, no clock.

Start-time fair queueing (stride scheduling on a virtual time): every tenant has a pass,
the virtual start of its next job; the backlogged tenant with the smallest pass is served
next and its pass advances by 1 / weight. Virtual time is the pass of the job served last.
A tenant that becomes backlogged again starts at max(its pass, virtual time): time spent
idle earns no credit, so a tenant back after an hour cannot monopolise the queue, and a
tenant that floods it cannot starve anyone, since a newcomer's pass is at most one job
ahead of the flood's. A tenant alone is served all the time. Within a tenant, interactive
jobs come before batch jobs, and each class keeps its arrival order.

:class:`FairQueue` keeps that state between pops (a worker's jobs waiting for a slot);
:func:`fair_order` orders a whole backlog at once without history (placement retrying
its parked jobs, which several processes share through Redis).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
Priority = Literal["interactive", "batch"]
_CLASSES: tuple[Priority, ...] = ("interactive", "batch")
_DIGITS = 9  # passes compare rounded, so that 3 × (1/3) ties with 1


@dataclass
class _Tenant(Generic[T]):
    pass_: float
    weight: float
    served: int = -1  # pop number when last served: on a tie, the one served longest ago
    lanes: tuple[deque[tuple[int, T]], ...] = field(default_factory=lambda: (deque(), deque()))

    def head(self) -> tuple[int, T]:
        return self.lanes[0][0] if self.lanes[0] else self.lanes[1][0]

    def __len__(self) -> int:
        return len(self.lanes[0]) + len(self.lanes[1])


class FairQueue(Generic[T]):
    """Items of many tenants, popped in weighted fair order."""

    def __init__(self) -> None:
        self._busy: dict[str, _Tenant[T]] = {}  # tenants with items
        self._idle: dict[str, float] = {}  # pass of tenants without items, while ahead of vt
        self._vt = 0.0
        self._seq = 0
        self._pops = 0
        self._size = 0

    def push(
        self, item: T, tenant: str, priority: Priority = "interactive", weight: float = 1.0
    ) -> None:
        if weight <= 0:
            raise ValueError(f"tenant {tenant!r}: weight must be positive, got {weight}")
        lane = self._busy.get(tenant)
        if lane is None:
            start = max(self._idle.pop(tenant, self._vt), self._vt)
            lane = self._busy[tenant] = _Tenant(start, weight)
        lane.weight = weight
        lane.lanes[_CLASSES.index(priority)].append((self._seq, item))
        self._seq += 1
        self._size += 1

    def pop(self) -> T:
        """The next item in fair order; IndexError when empty."""
        if not self._busy:
            raise IndexError("pop from an empty FairQueue")
        name, lane = min(self._busy.items(), key=lambda kv: _rank(kv[1]))
        _seq, item = (lane.lanes[0] or lane.lanes[1]).popleft()
        self._vt = lane.pass_
        lane.pass_ += 1.0 / lane.weight
        lane.served = self._pops
        self._pops += 1
        self._size -= 1
        if not lane:
            del self._busy[name]
            self._idle[name] = lane.pass_
        if len(self._idle) > 64 + len(self._busy):
            self._idle = {t: p for t, p in self._idle.items() if p > self._vt}
        return item

    def remove_if(self, pred: Callable[[T], bool]) -> list[T]:
        """Take out the items ``pred`` accepts (in arrival order per tenant and class)."""
        gone: list[T] = []
        for name, lane in list(self._busy.items()):
            for q in lane.lanes:
                kept = []
                for seq, item in q:  # pred once per item: it may answer differently twice
                    if pred(item):
                        gone.append(item)
                    else:
                        kept.append((seq, item))
                q.clear()
                q.extend(kept)
            if not lane:
                del self._busy[name]
                self._idle[name] = lane.pass_
        self._size -= len(gone)
        return gone

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[T]:
        """The items in the order pops would return them (without popping)."""
        copy: FairQueue[T] = FairQueue()
        copy._vt, copy._seq, copy._pops, copy._size = self._vt, self._seq, self._pops, self._size
        copy._idle = dict(self._idle)
        for name, lane in self._busy.items():
            lanes = tuple(deque(q) for q in lane.lanes)
            copy._busy[name] = _Tenant(lane.pass_, lane.weight, lane.served, lanes)
        while copy:
            yield copy.pop()


def _rank(lane: _Tenant[T]) -> tuple[float, int, int]:
    return round(lane.pass_, _DIGITS), lane.served, lane.head()[0]


def fair_order(
    items: Sequence[tuple[str, str, float]],
    weights: Mapping[str, float] | None = None,
    passes: Mapping[str, float] | None = None,
) -> list[int]:
    """A backlog of (tenant, priority, arrival) in fair order, as indices into ``items``.

    Tenants are interleaved by weight (default 1): a tenant's k-th item (interactive first,
    then by arrival) starts at virtual time pass + k / weight, where ``passes`` (see
    :class:`FairPasses`) carry what each tenant was served before, relative to now (0 for
    a tenant not served lately). On a tie the tenant with the smaller backlog per weight
    goes first, then the one waiting longest: a tenant with one job ahead of another's
    thousand is first."""
    weights, passes = weights or {}, passes or {}
    by_tenant: dict[str, list[int]] = {}
    for i, (tenant, _priority, _arrival) in enumerate(items):
        by_tenant.setdefault(tenant, []).append(i)
    keyed: list[tuple[float, float, float, str, int, int]] = []
    for tenant, indices in by_tenant.items():
        weight = weights.get(tenant, 1.0)
        if weight <= 0:
            raise ValueError(f"tenant {tenant!r}: weight must be positive, got {weight}")
        indices.sort(key=lambda i: (items[i][1] != "interactive", items[i][2], i))
        backlog, first = len(indices) / weight, min(items[i][2] for i in indices)
        start = passes.get(tenant, 0.0)
        for k, i in enumerate(indices):
            keyed.append((round(start + k / weight, _DIGITS), backlog, first, tenant, k, i))
    keyed.sort()
    return [entry[-1] for entry in keyed]


class FairPasses:
    """What :func:`fair_order` needs to remember between rounds: each tenant's pass (the
    virtual time its next job starts at) against the virtual time of the last job served.
    Without it a tenant that keeps a short backlog would win every tie against a long one
    and starve it; with it tenants take turns by weight across rounds. Bounded: a tenant
    whose pass virtual time has caught up with is forgotten (it starts at now anyway)."""

    def __init__(self) -> None:
        self._pass: dict[str, float] = {}
        self._vt = 0.0

    def served(self, tenant: str, weight: float = 1.0) -> None:
        start = max(self._pass.get(tenant, self._vt), self._vt)
        self._vt = start
        self._pass[tenant] = start + 1.0 / weight
        for name in [t for t, p in self._pass.items() if p <= self._vt]:
            del self._pass[name]

    def ahead(self) -> dict[str, float]:
        """Each tenant's pass relative to the virtual time (≥ 0), as fair_order takes it."""
        return {t: p - self._vt for t, p in self._pass.items()}
