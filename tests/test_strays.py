"""The ends a worker keeps (workers/strays.py) and which of them it writes again when a job
comes to it again after Redis lost them: pure, with a recording ``write_end``."""

from __future__ import annotations

import threading
from typing import Any

from scheduler.protocol import Placement, RunnerConfig
from workers.strays import ENDS_KEPT_S, Strays

FINAL = (3, {"done": True, "response": "", "eval_count": 2})


def placement(placement_id: str) -> Placement:
    return Placement(id=placement_id, runner_id="r", device_id="d", config=RunnerConfig(64))


def strays(waiting: list[bool] | None = None) -> tuple[Strays, list[Any], list[float]]:
    written: list[Any] = []
    clock = [100.0]
    kept = Strays(
        None,  # type: ignore[arg-type]  # no look here: its state is never read
        ["d"],
        set,
        lambda: bool(waiting and waiting.pop(0)),
        lambda p, job_id, done, orphan: written.append((p.id, job_id, done, orphan)),
        clock=lambda: clock[0],
    )
    return kept, written, clock


def test_a_final_end_kept_is_written_again_for_any_placement_of_its_job() -> None:
    kept, written, _clock = strays()
    kept.keep(("job", "p1"), FINAL, None)
    assert kept.end_again(placement("p2"), "job")  # placed again: its end, not a run
    assert written == [("p2", "job", FINAL, None)]
    assert not kept.end_again(placement("p1"), "other")


def test_a_fenced_end_or_a_hand_back_is_not_the_end_of_another_placement() -> None:
    kept, written, _clock = strays()
    kept.keep(("fenced", "p1"), FINAL, None, fenced=True)  # the job was taken from it
    assert not kept.end_again(placement("p2"), "fenced")  # its new run runs
    assert kept.end_again(placement("p1"), "fenced")  # the same run's message again
    kept.keep(("handed", "p1"), (0, None), None)  # handed back: placed again, to run
    assert not kept.end_again(placement("p2"), "handed")
    assert [w[:2] for w in written] == [("p1", "fenced")]


def test_an_end_kept_past_its_time_is_not_written_again() -> None:
    kept, written, clock = strays()
    kept.keep(("job", "p1"), FINAL, None)
    clock[0] += ENDS_KEPT_S + 1
    assert not kept.end_again(placement("p1"), "job")
    assert written == []


def test_an_end_on_its_way_lands_before_it_looks_and_other_jobs_never_wait() -> None:
    kept, written, _clock = strays([True])  # the backlog holds writes: not this job's
    queued = kept.on_its_way("job", lambda: kept.keep(("job", "p1"), FINAL, None))
    assert not kept.end_again(placement("p1"), "other")  # no end of its own on its way
    threading.Timer(0.2, queued).start()  # the outage ends: the end lands
    assert kept.end_again(placement("p1"), "job")  # it waited for it
    assert written == [("p1", "job", FINAL, None)]
