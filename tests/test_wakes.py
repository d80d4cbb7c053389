"""Which parked jobs a batch of events wakes (scheduler/placement/wakes.py, pure)."""

from __future__ import annotations

import json

import pytest

from scheduler.placement.wakes import EVERYTHING, Wake, wake_for


def finished(model: str, in_flight: int) -> str:
    return json.dumps(
        {"event": "job_finished", "runner": "r", "model": model, "in_flight": in_flight}
    )


@pytest.mark.parametrize(
    ("events", "wake"),
    [
        ([], None),
        ([finished("a", 1)], Wake(frozenset({"a"}), {"a": 1}, frozenset({"r"}))),
        (
            [finished("a", 2), finished("b", 1), finished("a", 1)],
            Wake(frozenset({"a", "b"}), {"a": 2, "b": 1}, frozenset({"r"})),
        ),
        # the runner turned idle: an eviction may make room for any model
        ([finished("a", 1), finished("a", 0)], EVERYTHING),
        ([json.dumps({"event": "runner_unloaded", "runner": "r"})], EVERYTHING),
        ([json.dumps({"event": "device_joined", "device": "d"})], EVERYTHING),
        ([json.dumps({"event": "job_finished", "runner": "r", "in_flight": 3})], EVERYTHING),
        (["\ufffd not json"], EVERYTHING),
        (["[1, 2]"], EVERYTHING),
    ],
)
def test_a_freed_slot_wakes_its_model_only(events: list[str], wake: Wake | None) -> None:
    assert wake_for(events) == wake
