"""Which parked jobs a batch of events can wake: the placement waker reads every event
that arrived together and retries once, and only the models a freed slot can serve when
that is all that happened. Pure: the events' texts in, a :class:`Wake` out."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Wake:
    """Retry every parked job (``models`` None), or only those of ``models``, sending at
    most ``slots[model]`` of each onto the ``runners`` that freed them (one slot per job
    that ended; a job sent elsewhere takes none of them)."""

    models: frozenset[str] | None = None
    slots: Mapping[str, int] = field(default_factory=dict)
    runners: frozenset[str] = frozenset()

    @property
    def everything(self) -> bool:
        return self.models is None


EVERYTHING = Wake()


def wake_for(events: list[str]) -> Wake | None:
    """The parked jobs worth retrying after ``events`` (texts from ggufq:events); None when
    there were none. A job's end on a runner that still has jobs frees a slot of that
    runner's model only, one: no memory frees and no runner turns idle, so one parked job
    of that model can run per such end. Anything else (a runner
    idle or unloaded, a device that joined, a job handed back, a text that does not parse)
    may free memory for any model."""
    if not events:
        return None
    slots: Counter[str] = Counter()
    runners: set[str] = set()
    for text in events:
        try:
            event = json.loads(text)
            busy = event["event"] == "job_finished" and int(event["in_flight"]) > 0
            model = event.get("model") if busy else None
        except (ValueError, KeyError, TypeError, AttributeError):
            return EVERYTHING
        if not isinstance(model, str):
            return EVERYTHING
        slots[model] += 1
        runners.add(str(event.get("runner", "")))
    return Wake(frozenset(slots), dict(slots), frozenset(runners))
