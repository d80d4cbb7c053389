"""A worker's start of a job on a resident runner, claimed while the job's first step
runs: a delivery that is not the job's one run publishes nothing and ends nothing, a job
cancelled in the queue shows no text. A real worker runtime on the tiny model and a real
Redis (database 1); no Celery: deliveries are calls of ``run_job``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from scheduler.errors import InvalidRequest, JobCancelled, JobFailed
from scheduler.gguf.registry import Registry
from scheduler.protocol import JobRequest, Options, Placement, RunnerConfig, SentJob
from scheduler.settings import Settings
from scheduler.store import keys
from scheduler.store.cancel import request_cancel
from scheduler.store.placement_state import PlacementState
from tests.conftest import beat_forever, send
from tests.test_state import GIB, vgpu
from workers import runtime as runtime_module
from workers.engine.relay import LAG
from workers.handback import HandBack, NotOwned
from workers.publisher import ChunkPublisher
from workers.runtime import WorkerRuntime
from workers.start_claim import StartClaim

DEVICE = vgpu(0)
CONFIG = RunnerConfig.for_generation(256, 2, False)
OPTIONS = {"temperature": 0, "num_predict": 4, "seed": 1}


@pytest.fixture()
def runtime(db: redis.Redis, models_dir: Path) -> Iterator[WorkerRuntime]:
    rt = WorkerRuntime(Settings(cpu_threads=1), db, [DEVICE], Registry(models_dir))
    rt.state.register_device(DEVICE)
    beat_forever(db, DEVICE.id)
    fields = {"model": "tiny"}
    assert PlacementState(db).reserve("r", "p1", {DEVICE.id: GIB}, fields, 1e12, 10)
    try:
        yield rt
    finally:
        for runner_id in list(rt.runners):
            rt.runners.pop(runner_id).close()
        rt.chunks.close()


def deliver(
    db: redis.Redis, rt: WorkerRuntime, job: JobRequest, placement_id: str = "p1"
) -> dict[str, Any]:
    """Deliver a job placed on runner r as ``placement_id`` (recorded as sent as p1)."""
    placement = Placement(id="p1", runner_id="r", device_id=DEVICE.id, config=CONFIG)
    if not db.hexists(keys.inflight(DEVICE.id), job.id):
        send(PlacementState(db), SentJob(job=job, placement=placement, worker="w"))
    sent = placement.model_copy(update={"id": placement_id}).model_dump(mode="json")
    return rt.run_job(job.model_dump(mode="json"), sent)


def stream(db: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    return [json.loads(f[b"c"]) for _id, f in db.xrange(keys.job_chunks(job_id))]


def job(prompt: str) -> JobRequest:
    return JobRequest(model="tiny", prompt=prompt, options=OPTIONS, submitted_at=1.0)


def test_a_second_delivery_on_a_resident_runner_publishes_nothing(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    first = job("once")
    assert deliver(db, runtime, first)["eval_count"] == 4  # loads the runner: claimed first
    assert "r" in runtime.runners
    second = job("twice")
    final = deliver(db, runtime, second)  # resident: claimed while its first step ran
    assert final["eval_count"] == 4
    chunks = stream(db, second.id)
    assert [c["seq"] for c in chunks] == list(range(1, len(chunks) + 1))
    assert chunks[-1]["done"] and chunks[0].get("response")
    with pytest.raises(NotOwned):
        deliver(db, runtime, second)  # the same placement delivered again: its run is taken
    assert stream(db, second.id) == chunks  # not a chunk more
    assert not runtime._running and second.id not in runtime.cancels._watched
    assert deliver(db, runtime, job("after"))["eval_count"] == 4  # the runner serves on


def test_a_job_placed_elsewhere_meanwhile_publishes_nothing_here(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    deliver(db, runtime, job("load it"))
    moved = job("moved")
    with pytest.raises(NotOwned):
        deliver(db, runtime, moved, placement_id="p-old")  # its record names another run
    assert stream(db, moved.id) == []
    assert db.hexists(keys.inflight(DEVICE.id), moved.id)  # its run, not this one, ends it


def test_a_job_cancelled_in_the_queue_shows_no_text_on_a_resident_runner(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    deliver(db, runtime, job("load it"))
    gone = job("cancelled before it started")
    request_cancel(db, gone.id, 60)
    with pytest.raises(JobCancelled, match="before"):
        deliver(db, runtime, gone)
    chunks = stream(db, gone.id)
    assert len(chunks) == 1 and chunks[0]["done"] and "error" in chunks[0]
    assert not db.hexists(keys.inflight(DEVICE.id), gone.id)  # its end was written


def test_a_job_on_a_resident_runner_starts_while_another_runner_loads(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    """Another runner's load holds the worker's load lock for seconds: a job for a resident
    runner neither waits for it nor stays unclaimed meanwhile (placement would send it
    again, taking it for lost)."""
    deliver(db, runtime, job("load it"))
    quick = job("while another loads")
    ended: list[dict[str, Any]] = []
    with runtime._load_lock:  # another runner loading
        thread = threading.Thread(target=lambda: ended.append(deliver(db, runtime, quick)))
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive() and ended[0]["eval_count"] == 4
    assert db.hget(keys.job_custody(quick.id), "run") == b"p1"


def test_a_job_failing_before_its_first_step_still_sets_its_runners_keep_alive(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    deliver(db, runtime, job("load it"))
    too_long = job("word " * 400).model_copy(update={"keep_alive_s": 0.0})
    with pytest.raises(InvalidRequest, match="num_ctx"):
        deliver(db, runtime, too_long)
    assert stream(db, too_long.id)[-1]["done"]  # its error is its last chunk
    assert "r" not in runtime.runners  # keep_alive 0: unloaded as the job ended


def test_a_run_fenced_off_mid_stream_stores_no_outcome(
    db: redis.Redis, runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placement took the job back while this worker ran it (the worker had stalled or
    been cut off past the TTL): its later chunks are refused by the custody fence, and its
    result, which would overwrite the outcome placement gave the job, is never stored."""
    deliver(db, runtime, job("load it"))
    long = {**OPTIONS, "num_predict": 64}
    taken = JobRequest(model="tiny", prompt="taken back", options=long, submitted_at=1.0)
    publish = ChunkPublisher.publish
    written: list[int] = []

    def then_taken_back(self: ChunkPublisher, chunk: dict[str, Any]) -> None:
        publish(self, chunk)
        # placement takes the job back once its chunks flow (on a resident runner they are
        # held until its start is claimed, beside its first step) and are in Redis: the
        # events the test waits on, not the machine's speed
        if self.job_id != taken.id or written or self._held is not None:
            return
        self.flush()
        if n := db.xlen(keys.job_chunks(taken.id)):
            written.append(n)
            db.hset(keys.job_custody(taken.id), "holder", "")  # as the reap of its device does

    monkeypatch.setattr(ChunkPublisher, "publish", then_taken_back)
    with pytest.raises(NotOwned):
        deliver(db, runtime, taken)
    chunks = stream(db, taken.id)
    assert written and len(chunks) == written[0]  # only what came before
    assert not any(c.get("done") for c in chunks)
    assert deliver(db, runtime, job("after"))["eval_count"] == 4  # the runner serves on


def test_a_run_whose_chunks_are_refused_stops_at_its_next_step(
    db: redis.Redis, runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its job was sent again as a new placement (its message seemed lost: a Redis crash
    had lost this run's start claim): the custody fence refuses this run's chunks, and the run
    stops at its next step instead of decoding on for nobody."""
    deliver(db, runtime, job("load it"))
    taken = JobRequest(
        model="tiny", prompt="sent again", options={**OPTIONS, "num_predict": 200}, submitted_at=1.0
    )
    publish = ChunkPublisher.publish
    after: list[dict[str, Any]] = []
    disowned = threading.Event()

    def then_sent_again(self: ChunkPublisher, chunk: dict[str, Any]) -> None:
        publish(self, chunk)
        if self.job_id != taken.id:
            return
        if not db.hget(keys.job_custody(taken.id), "holder") == b"p2":
            db.hset(keys.job_custody(taken.id), "holder", "p2")  # as lua/resend.lua does
            return
        after.append(chunk)
        for _ in range(1000 if len(after) == 1 else 0):  # until the writer hears its chunk
            if any(job == taken.id for job, _placement in runtime._disowned):
                disowned.set()
                break
            threading.Event().wait(0.01)  # refused (10 s at most)

    monkeypatch.setattr(ChunkPublisher, "publish", then_sent_again)
    with pytest.raises(NotOwned):
        deliver(db, runtime, taken)
    assert disowned.is_set()
    # the step that heard it, and at most the one under way; and the text of the steps the
    # loop decoded while this hook held the relay (it runs at most LAG steps ahead)
    assert len(after) <= 2 + LAG
    assert not any(c.get("done") for c in stream(db, taken.id))
    monkeypatch.undo()
    assert deliver(db, runtime, job("after"))["eval_count"] == 4  # the runner serves on


def test_a_job_sent_again_to_this_worker_runs_beside_its_fenced_first_run(
    db: redis.Redis, runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its first run's start claim was lost (a Redis crash) and its message seemed lost, so
    placement sent it again as a new placement, to this same worker: the first run stops
    without writing, and the second, beside it, runs to its end with the whole stream; the
    first's end takes neither the second's cancel watch nor its place among the runs."""
    deliver(db, runtime, job("load it"))
    twice = job("twice")
    publish = ChunkPublisher.publish
    second: dict[str, Any] = {}

    def sent_again_first(self: ChunkPublisher, chunk: dict[str, Any]) -> None:
        if self.job_id == twice.id and self.fence == "p1" and not second:
            raw = db.hget(keys.inflight(DEVICE.id), twice.id) or b""
            first = SentJob.model_validate_json(raw)
            placement = first.placement.model_copy(update={"id": "p2"})
            moved = first.model_copy(update={"placement": placement})
            db.hset(keys.inflight(DEVICE.id), twice.id, moved.model_dump_json())
            db.hset(keys.job_custody(twice.id), "holder", "p2")  # as lua/resend.lua does

            def run_again() -> None:
                second["final"] = deliver(db, runtime, twice, "p2")

            second["thread"] = threading.Thread(target=run_again)
            second["thread"].start()
        publish(self, chunk)

    monkeypatch.setattr(ChunkPublisher, "publish", sent_again_first)
    with pytest.raises(NotOwned):
        deliver(db, runtime, twice)
    second["thread"].join(timeout=60)
    assert second["final"]["eval_count"] == 4
    chunks = stream(db, twice.id)
    assert [c["seq"] for c in chunks] == list(range(1, len(chunks) + 1))
    assert chunks[-1]["done"] and "error" not in chunks[-1]
    assert not runtime._running and not runtime._disowned


def test_a_job_whose_end_redis_lost_is_ended_again_not_left_running(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    """Redis came back from an older state: a job this worker ended is in flight again,
    marked running, counted on its runner, its final chunk gone, and no run here holds it.
    At the second look (its minimum age past) the worker writes its end again, final chunk
    and all; a stray it never ended is handed back to placement; a job that runs here, or
    whose end is being written, is left alone."""
    ended = job("ended before the crash")
    assert deliver(db, runtime, ended)["done"]
    assert not runtime._ending  # its end was written
    entries = db.xrange(keys.job_chunks(ended.id))
    final = stream(db, ended.id)[-1]
    db.delete(keys.job_chunks(ended.id))  # the stream as it was before its last chunk
    for entry_id, fields in entries[:-1]:
        db.xadd(keys.job_chunks(ended.id), fields, id=entry_id)
    placement = Placement(id="p1", runner_id="r", device_id=DEVICE.id, config=CONFIG)

    def record(job_id: str, placement_id: str) -> SentJob:
        req = job(job_id).model_copy(update={"id": job_id})
        return SentJob(
            job=req, placement=placement.model_copy(update={"id": placement_id}), worker="w"
        )

    lost = SentJob(job=ended, placement=placement, worker="w")
    others = [record("runs-here", "p7"), record("never-here", "p8"), record("ending-now", "p9")]
    for sent in (lost, *others):  # as Redis had them before the first one's end
        db.hset(keys.inflight(DEVICE.id), sent.job.id, sent.model_dump_json())
        db.hset(keys.RUNNING, sent.job.id, 1.0)
        db.hset(keys.runner_jobs("r"), sent.placement.id, 1.0)
        db.hset(keys.job_custody(sent.job.id), "holder", sent.placement.id)
    db.hset(keys.runner("r"), "in_flight", 4)
    runtime._running[("runs-here", "p7")] = others[0].placement
    runtime._ending.add(("ending-now", "p9"))
    clock = [0.0]
    runtime.strays.clock = lambda: clock[0]
    assert runtime.strays.look() == 0  # first look: not yet
    clock[0] = 60.0
    assert runtime.strays.look() == 2
    assert stream(db, ended.id)[-1] == final  # its end, written again
    assert not db.hexists(keys.inflight(DEVICE.id), ended.id)
    assert not db.hexists(keys.RUNNING, ended.id) and not db.hexists(keys.ORPHANS, ended.id)
    handed = SentJob.model_validate_json(db.hget(keys.ORPHANS, "never-here") or b"")
    assert "whose worker has no run of it" in handed.lost  # for placement to say why
    assert sorted(db.hkeys(keys.runner_jobs("r"))) == [b"p7", b"p9"]
    clock[0] = 120.0
    assert runtime.strays.look() == 0
    runtime._running.pop(("runs-here", "p7"))
    runtime._ending.discard(("ending-now", "p9"))


def test_a_job_whose_runner_is_gone_before_it_arrives_is_handed_back(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    """A job sent (or sent again, lua/resend.lua) to a runner Redis no longer has, nothing
    of it run: handed back to placement, which places it again once, on any device (it
    failed, 'submit the job again')."""
    job = JobRequest(model="tiny", prompt="a", submitted_at=1.0, options=OPTIONS)
    db.delete(keys.runner("r"), keys.runner_jobs("r"))  # unloaded, or its load failed
    with pytest.raises(HandBack):
        deliver(db, runtime, job)
    assert not db.exists(keys.job_chunks(job.id))  # nothing streamed, no error
    record = SentJob.model_validate_json(db.hget(keys.ORPHANS, job.id) or b"")
    assert record.job.attempt == 0 and record.avoid == []  # placed again once, anywhere
    assert not db.hexists(keys.inflight(DEVICE.id), job.id)
    assert not db.hexists(keys.RUNNING, job.id)


def break_admission(runtime: WorkerRuntime, at_step: int = 1) -> Any:
    """Runner r's engine, whose decode loop stops at the ``at_step``-th admission from now,
    one a step (a bug there)."""
    engine = runtime.runners["r"].engine  # type: ignore[union-attr]
    admit, steps = engine._admission.admit, [0]

    def broken(*a: Any) -> Any:
        steps[0] += 1
        if steps[0] == at_step:
            raise RuntimeError("admission lost its slots")
        return admit(*a)

    engine._admission.admit = broken
    return engine


def broken_loop(runtime: WorkerRuntime) -> None:
    """Runner r's decode loop stopped by a bug, met by a job given to its engine directly
    (no delivery counts it on the runner)."""
    engine = break_admission(runtime)
    with pytest.raises(JobFailed, match="decode loop of 'tiny' stopped"):
        engine.generate("x", Options(**OPTIONS), lambda _t: None)
    assert runtime.runners["r"].stopped


def assert_broke_down_once(db: redis.Redis, runtime: WorkerRuntime) -> None:
    """Runner r unloaded here and gone from Redis, counted as one breakdown."""
    assert "r" not in runtime.runners and not db.exists(keys.runner("r"))
    assert float(db.hget(keys.STATS, "breakdowns|tiny") or 0) == 1


class Stopped(BaseException):
    """What stops a run as a KeyboardInterrupt or a SystemExit would: not an Exception."""


def test_a_run_stopped_by_other_than_an_exception_is_handed_back(
    db: redis.Redis, runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its end takes its in-flight record, so placement must have it back: else nothing
    would place it again (its custody record would say running, on no device's records)."""

    def stop(*_args: Any, **_kwargs: Any) -> None:
        raise Stopped("stop")

    monkeypatch.setattr(runtime_module, "produce", stop)
    stopped = job("stop")
    with pytest.raises(Stopped):
        deliver(db, runtime, stopped)  # its start claimed before its runner loaded
    record = SentJob.model_validate_json(db.hget(keys.ORPHANS, stopped.id) or b"")
    assert record.lost == f"its run on {DEVICE.id} was stopped before its end (Stopped('stop'))"
    assert record.avoid == [] and not db.hexists(keys.inflight(DEVICE.id), stopped.id)
    assert db.hget(keys.job_custody(stopped.id), "state") == b"orphaned"
    assert not db.exists(keys.job_chunks(stopped.id))


def test_a_run_whose_stream_claim_fails_leaves_its_job_to_the_strays_look(
    db: redis.Redis, runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its start claimed, then its stream's claim refused (a stream instance turned
    read-only by a failover, say): the run is not running here, so the strays look hands
    the job back rather than Redis keeping it running and in flight for good."""

    def refused(_job_id: str, _placement_id: str) -> int:
        raise redis.ResponseError("READONLY You can't write against a read only replica.")

    monkeypatch.setattr(runtime.state, "claim_stream", refused)
    lost = job("claim refused")
    with pytest.raises(redis.ResponseError, match="READONLY"):
        deliver(db, runtime, lost)
    assert db.hexists(keys.RUNNING, lost.id) and (lost.id, "p1") not in runtime._runs()
    runtime.strays.min_age_s = 0.0
    runtime.strays.look()  # seen once
    runtime.strays.look()  # and again: a stray, handed back
    record = SentJob.model_validate_json(db.hget(keys.ORPHANS, lost.id) or b"")
    assert record.placement.id == "p1" and not db.hexists(keys.inflight(DEVICE.id), lost.id)


def test_a_job_that_reaches_a_runner_whose_loop_stopped_is_handed_back_and_it_unloads(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    """A runner whose decode loop stopped on a bug takes no job: one that reaches it,
    nothing of it run, is placed again (once, anywhere), and the runner unloads as the
    last job counted on it ends, counted as a breakdown: the model serves again from a
    fresh load, not from a runner that would refuse every job until it expired."""
    deliver(db, runtime, job("load it"))
    broken_loop(runtime)
    arrived = job("a")

    def placement_sees() -> bytes | None:  # as the job is handed back
        return db.hget(keys.runner("r"), "state")

    seen: list[bytes | None] = []
    handing_back = runtime.state.end

    def end(*args: Any) -> Any:
        seen.append(placement_sees())
        return handing_back(*args)

    runtime.state.end = end  # type: ignore[method-assign]
    with pytest.raises(HandBack, match="can serve no more jobs.*decode loop"):
        deliver(db, runtime, arrived)
    assert seen == [b"unloading"]  # placed again, the job cannot be routed back to it
    record = SentJob.model_validate_json(db.hget(keys.ORPHANS, arrived.id) or b"")
    assert record.job.attempt == 0 and record.avoid == []
    assert not db.exists(keys.job_chunks(arrived.id))  # nothing streamed, no error
    assert_broke_down_once(db, runtime)


def test_a_job_whose_loop_stops_before_its_first_token_is_placed_again(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    deliver(db, runtime, job("load it"))
    break_admission(runtime)
    first = job("b")
    with pytest.raises(HandBack, match="runner stopped.*decode loop of 'tiny' stopped"):
        deliver(db, runtime, first)
    record = SentJob.model_validate_json(db.hget(keys.ORPHANS, first.id) or b"")
    assert record.job.attempt == 0 and not db.exists(keys.job_chunks(first.id))
    assert_broke_down_once(db, runtime)


def test_a_job_that_streamed_when_its_loop_stops_fails_saying_so(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    """Its answer so far is out: it ends with the error, which names the bug."""
    deliver(db, runtime, job("load it"))
    break_admission(runtime, at_step=4)  # the job has 3 of its 4 tokens
    failing = job("b")
    with pytest.raises(JobFailed, match="after 3 generated tokens.*decode loop of 'tiny'"):
        deliver(db, runtime, failing)
    last = stream(db, failing.id)[-1]  # its end says what happened
    assert last["done"] and "decode loop of 'tiny' stopped" in last["error"]["message"]
    assert_broke_down_once(db, runtime)


def test_a_stopped_runner_waits_for_the_last_job_counted_on_it_however_it_goes(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    """With another job still counted on it (placed, not sent yet), a stopped runner is
    only marked unloading; when placement counts that job off itself (a job it never
    sent), the worker's next look unloads it. A job placed again already fails there,
    saying so."""
    deliver(db, runtime, job("load it"))
    placements = PlacementState(db)
    assert placements.assign("r", "p2", 1e12)  # counted, never sent
    broken_loop(runtime)
    again = job("a").model_copy(update={"attempt": 1})
    with pytest.raises(JobFailed, match="can serve no more jobs.*submit the job again"):
        deliver(db, runtime, again)
    assert db.hget(keys.runner("r"), "state") == b"unloading"  # routed nothing more
    assert "r" in runtime.runners  # p2 still counts on it
    runtime._unload_stopped()
    assert "r" in runtime.runners
    seen = placements.prune("r", set(), 1e12, 0).unaccounted
    assert placements.prune("r", seen, 1e12, 0).forgotten == {"p2"}
    runtime._unload_stopped()  # the expiry loop's look, each second
    assert_broke_down_once(db, runtime)


def test_a_job_that_ran_here_and_comes_again_after_redis_lost_its_run_is_not_run_again(
    db: redis.Redis, runtime: WorkerRuntime
) -> None:
    """Redis came back from before this worker's run of a job (a restore from an older
    snapshot): the job is in flight again with no start claim, and its message comes again,
    or it is placed again as a new placement. The worker writes the end it wrote again,
    under the placement that came, instead of running the job a second time."""
    deliver(db, runtime, job("load it"))
    ran = job("ran in the writes Redis lost")
    assert deliver(db, runtime, ran)["eval_count"] == 4
    final = stream(db, ran.id)[-1]

    def as_before_the_run(placement_id: str) -> dict[str, Any]:
        db.delete(
            keys.job_chunks(ran.id),
            keys.job_custody(ran.id),
        )
        placement = Placement(id=placement_id, runner_id="r", device_id=DEVICE.id, config=CONFIG)
        assert send(PlacementState(db), SentJob(job=ran, placement=placement, worker="w"))
        return placement.model_dump(mode="json")

    for placement_id in ("p1", "p2"):  # its message again; placed again
        sent = as_before_the_run(placement_id)
        with pytest.raises(NotOwned):
            runtime.run_job(ran.model_dump(mode="json"), sent)
        chunks = stream(db, ran.id)
        assert [c["seq"] for c in chunks] == [final["seq"]]  # its end, and no second run
        assert chunks[0]["eval_count"] == final["eval_count"] and chunks[0]["done"]
        assert not db.hexists(keys.inflight(DEVICE.id), ran.id)
        assert db.hget(keys.job_custody(ran.id), "state") == b"done"
    assert not runtime._running
    assert deliver(db, runtime, job("after"))["eval_count"] == 4  # the runner serves on


def test_a_second_delivery_of_a_run_under_way_here_whose_claim_redis_lost_runs_nothing(
    db: redis.Redis, runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis came back from before a run's start claim while the run goes on here, and the
    job's message with it: its second delivery finds the run under way and runs nothing."""
    deliver(db, runtime, job("load it"))
    once = JobRequest(
        model="tiny", prompt="once", options={**OPTIONS, "num_predict": 200}, submitted_at=1.0
    )
    publish, make = ChunkPublisher.publish, StartClaim.make
    second: dict[str, Any] = {}
    decided = threading.Event()  # the second delivery asked for its claim

    def again() -> None:
        try:
            second["final"] = deliver(db, runtime, once)
        except NotOwned as exc:
            second["refused"] = exc

    def make_then_say(self: StartClaim) -> None:
        try:
            make(self)
        finally:
            if second.get("thread") is threading.current_thread():
                decided.set()

    def then_delivered_again(self: ChunkPublisher, chunk: dict[str, Any]) -> None:
        publish(self, chunk)
        if self.job_id == once.id and self.fence == "p1" and not second:
            db.hdel(keys.job_custody(once.id), "run")  # lost with Redis's last writes
            second["thread"] = threading.Thread(target=again)  # off the text relay's thread
            second["thread"].start()
            # the first run stays under way (its text relay waits here) until the
            # second delivery asked for its claim, however slow the machine
            decided.wait(timeout=60)

    monkeypatch.setattr(StartClaim, "make", make_then_say)
    monkeypatch.setattr(ChunkPublisher, "publish", then_delivered_again)
    assert deliver(db, runtime, once)["done"]
    second["thread"].join(timeout=60)
    assert "refused" in second and "final" not in second
    chunks = stream(db, once.id)
    assert [c["seq"] for c in chunks] == list(range(1, len(chunks) + 1))
    assert sum(1 for c in chunks if c.get("done")) == 1
