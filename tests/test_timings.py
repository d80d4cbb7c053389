"""The job timings' histograms (scheduler/store/stats.py): what a finished job adds, and
how the fields in Redis read back as Prometheus's cumulative buckets."""

from __future__ import annotations

import pytest

from scheduler.store import keys
from scheduler.store.stats import TIMINGS, histograms, job_timings, observe


class RecordingPipe:
    """The two hash writes observe() queues, applied to a dict as Redis would."""

    def __init__(self) -> None:
        self.hash: dict[bytes, bytes] = {}

    def hincrby(self, key: str, field: str, amount: int) -> None:
        assert key == keys.TIMINGS
        old = int(self.hash.get(field.encode(), b"0"))  # Redis refuses a float here
        self.hash[field.encode()] = str(old + amount).encode()

    def hincrbyfloat(self, key: str, field: str, amount: float) -> None:
        assert key == keys.TIMINGS
        old = float(self.hash.get(field.encode(), b"0"))
        self.hash[field.encode()] = repr(old + amount).encode()


def test_a_finished_job_gives_its_wait_first_token_and_speed() -> None:
    hops = {"submitted": 100.0, "admitted": 100.5, "first_token": 100.75}
    final = {"eval_count": 41, "eval_duration": 2_000_000_000}
    assert job_timings(100.0, hops, final) == {
        "queue_wait": 0.5,
        "ttft": 0.75,
        "tokens_per_s": 20.5,
    }
    # a host whose clock is behind the client's: no negative wait; an embedding: no speed
    assert job_timings(101.0, {"admitted": 100.5}, {"eval_count": 0}) == {"queue_wait": 0.0}


def test_observations_read_back_as_cumulative_buckets_per_label_set() -> None:
    pipe = RecordingPipe()
    a = {"model": "m|odd", "tenant": "alice"}  # a model name may hold the separator
    b = {"model": "m|odd", "tenant": "bob"}
    observe(pipe, a, queue_wait=0.01, ttft=3.0)
    observe(pipe, a, queue_wait=0.2)
    observe(pipe, a, queue_wait=1000.0)  # past the last bound: +Inf only
    observe(pipe, b, queue_wait=0.02)
    skipped = {  # what another version, or a hand, may have left: never fails a scrape
        b"queue_wait|+Inf|unknown": b"1",  # too few labels
        b"gone_timing|1.0|x": b"1",  # a timing this version does not know
        b"queue_wait|0.3|carol|m": b"1",  # a bound this version does not have
        b"queue_wait|1.0|dave|m": b"1.5",  # a count that is no whole number
        b"queue_wait|sum|erin|m": b"abc",
        b"queue_wait|\xb2|frank|m": b"1",  # "²": a digit to str.isdigit, not to int()
        b"\xff\xfe|1.0|x": b"1",  # not UTF-8
    }
    pipe.hash.update(skipped)
    found = {(h.name, h.labels): h for h in histograms(pipe.hash)}
    assert set(found) == {
        ("queue_wait", ("alice", "m|odd")),
        ("queue_wait", ("bob", "m|odd")),
        ("ttft", ("m|odd",)),
    }
    alice = dict(found[("queue_wait", ("alice", "m|odd"))].buckets())
    bounds = TIMINGS["queue_wait"].buckets
    assert list(alice) == [repr(float(b)) for b in bounds] + ["+Inf"]
    assert alice["0.01"] == 1  # le 0.01 holds 0.01 itself
    assert alice["0.25"] == 2
    assert alice["300.0"] == 2 and alice["+Inf"] == 3
    assert found[("queue_wait", ("alice", "m|odd"))].total == pytest.approx(1000.21)
    assert dict(found[("ttft", ("m|odd",))].buckets())["2.5"] == 0
    assert dict(found[("ttft", ("m|odd",))].buckets())["5.0"] == 1


def test_values_redis_would_refuse_are_left_out() -> None:
    pipe = RecordingPipe()
    observe(pipe, {"model": "m"}, ttft=float("nan"), tokens_per_s=float("inf"))
    observe(pipe, {"model": "m"}, ttft=-1.0)
    assert pipe.hash == {}
