"""Which parked jobs a batch of events can wake: the placement waker reads every event
that arrived together and retries once, and only the models a freed slot can serve when
that is all that happened. Pure: the events' texts in, a :class:`Wake` out."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Wake:
    """Retry every parked job (``models`` None), or only those of ``models``."""

    models: frozenset[str] | None = None

    @property
    def everything(self) -> bool:
        return self.models is None


EVERYTHING = Wake()


def wake_for(events: list[str]) -> Wake | None:
    """The parked jobs worth retrying after ``events`` (texts from ggufq:events); None when
    there were none. A job's end on a runner that still has jobs frees a slot of that
    runner's model only: no memory frees and no runner turns idle. Anything else (a runner
    idle or unloaded, a device that joined, a job handed back, a text that does not parse)
    may free memory for any model."""
    if not events:
        return None
    models: set[str] = set()
    for text in events:
        try:
            event = json.loads(text)
            busy = event["event"] == "job_finished" and int(event["in_flight"]) > 0
            model = event.get("model") if busy else None
        except (ValueError, KeyError, TypeError, AttributeError):
            return EVERYTHING
        if not isinstance(model, str):
            return EVERYTHING
        models.add(model)
    return Wake(frozenset(models))
