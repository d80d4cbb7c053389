"""Unit tests of the pure parts: durations, sizes, protocol, keep_alive schedule, num_ctx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import redis

from scheduler.cluster import DeviceState, RunnerState, Snapshot, by_expiry
from scheduler.errors import ChunksLost, InvalidRequest, ModelNotFound, error_from_code
from scheduler.gguf.estimate import choose_num_ctx
from scheduler.local.procs import lower_thread_priority, niced_child_preexec
from scheduler.loops import EXPECTED_RETRY_S, LoopHealth, run_loop
from scheduler.placement.commit import Assigned
from scheduler.placement.fastroute import route_for
from scheduler.protocol import (
    JobRequest,
    Placement,
    RunnerConfig,
    check_model_name,
    parse_request,
)
from scheduler.store.chunk_reading import ChunkOrder
from scheduler.units import format_duration, parse_bytes, parse_duration_s
from tests.test_decision import runner_view
from workers.backlog import Backlog
from workers.cpus import thread_counts
from workers.keepalive import ExpirySchedule, effective_keep_alive, expires_at


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5m", 300),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("0", 0),
        ("-1", -1),
        (42, 42),
        ("1.5s", 1.5),
        ("-5m", -300),
    ],
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "bad", ["", "5x", "m5", "1h 30m", "five", "inf", "nan", float("inf"), float("nan"), "9999h"]
)
def test_bad_durations_name_the_value(bad: str | float) -> None:
    with pytest.raises(ValueError, match=r"duration .* is not (valid|usable)"):
        parse_duration_s(bad)


def test_format_duration() -> None:
    assert format_duration(-1) == "forever"
    assert format_duration(299.6) == "5m00s"
    assert format_duration(3725) == "1h02m"
    assert format_duration(12) == "12s"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("24GB", 24 * 10**9),
        ("1024", 1024),
        ("1.5g", int(1.5 * 2**30)),
    ],
)
def test_sizes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("bad", ["", "8XB", "-1GiB", "0", "lots"])
def test_bad_sizes(bad: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(bad)


@pytest.mark.parametrize(
    "name", ["../etc/passwd", "models/tiny", "tiny.gguf", "C:\\m\\x", "a/../b"]
)
def test_paths_are_not_model_names(name: str) -> None:
    with pytest.raises(InvalidRequest, match="looks like a file path"):
        check_model_name(name)


@pytest.mark.parametrize("name", ["", "-x", "a b", "x" * 200, "naïve"])
def test_bad_model_names(name: str) -> None:
    with pytest.raises(InvalidRequest, match="not valid"):
        check_model_name(name)


def test_model_names_accepted() -> None:
    for name in ["tiny", "gemma3-270m", "llama3.2_1b-q4"]:
        assert check_model_name(name) == name


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": 11}, "options.temperature"),
        ({"top_p": 1.5}, "options.top_p"),
        ({"num_ctx": 2_000_000}, "options.num_ctx"),
        ({"num_predict": -3}, "options.num_predict"),
        ({"seed": -2}, "options.seed"),
        ({"bogus": 1}, "options.bogus"),
    ],
)
def test_invalid_options_name_field_and_range(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request({"model": "tiny", "prompt": "x", "options": options})
    assert field in str(info.value)
    assert "got" in str(info.value)


def test_a_context_below_4_tokens_is_raised_to_4_as_ollama_does() -> None:
    for asked in (3, 1, 0, -5):
        request = parse_request({"model": "tiny", "prompt": "x", "options": {"num_ctx": asked}})
        assert request.options.num_ctx == 4
    assert parse_request({"model": "tiny", "options": {"num_ctx": 8}}).options.num_ctx == 8


def test_keep_alive_in_request_parsed() -> None:
    assert parse_request({"model": "m", "keep_alive_s": "5m"}).keep_alive_s == 300
    assert parse_request({"model": "m"}).keep_alive_s is None
    with pytest.raises(InvalidRequest, match="keep_alive_s"):
        parse_request({"model": "m", "keep_alive_s": "soon"})


def test_error_round_trip_by_code() -> None:
    err = error_from_code("model_not_found", "model 'x' not found")
    assert isinstance(err, ModelNotFound) and str(err) == "model 'x' not found"
    assert type(error_from_code("no-such-code", "m")).__name__ == "GgufqError"


def test_keep_alive_rules() -> None:
    assert effective_keep_alive(None, 300) == 300  # omitted keeps the runner's value
    assert effective_keep_alive(0, 300) == 0
    assert effective_keep_alive(-1, 300) == -1
    assert expires_at(100.0, 300) == 400.0
    assert expires_at(100.0, -1) is None


def test_expiry_schedule_with_injected_time() -> None:
    sched = ExpirySchedule()
    sched.set("a", 10.0)
    sched.set("b", 5.0)
    sched.set("c", None)  # never expires
    assert sched.next_at() == 5.0
    assert sched.pop_due(4.9) == []
    assert sched.pop_due(5.0) == ["b"]
    sched.set("a", 20.0)  # a new job pushed a's expiry back
    assert sched.pop_due(15.0) == []
    sched.cancel("a")
    assert sched.pop_due(100.0) == []
    assert sched.next_at() is None


def test_num_ctx_choice() -> None:
    assert choose_num_ctx(None, 4096, 32768) == (4096, None)
    assert choose_num_ctx(None, 4096, 2048) == (2048, None)
    ctx, warning = choose_num_ctx(8192, 4096, 2048)
    assert ctx == 2048 and warning and "8192" in warning and "2048" in warning
    assert choose_num_ctx(512, 4096, 2048) == (512, None)


def test_slots_per_model_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.settings import Settings

    monkeypatch.setenv("GGUFQ_MODEL_PARALLEL", '{"gemma3-270m": 8}')
    assert Settings().model_parallel == {"gemma3-270m": 8}
    with pytest.raises(InvalidRequest, match="num_parallel"):
        parse_request({"model": "m", "options": {"num_parallel": 0}})


def test_unload_waits_for_the_driver_to_report_memory_back() -> None:
    from workers.devices import wait_for_release

    now = [0.0]
    reports = iter([{"g": 1_000}, {"g": 5_000}, {"g": 8_000}])
    ok = wait_for_release(
        lambda: next(reports),
        before={"g": 1_000},
        held={"g": 8_000},  # 75% of it back = 6,000 more than before
        timeout_s=5,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    assert ok and now[0] == 0.1  # two polls short, the third enough
    stuck = wait_for_release(
        lambda: {"g": 1_000},
        {"g": 1_000},
        {"g": 8_000},
        timeout_s=1,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
    )
    assert not stuck


def test_format_json_without_json_in_the_prompt_warns() -> None:
    from scheduler.placement.needs import format_warning

    assert format_warning(parse_request({"model": "m", "prompt": "Hi", "format": "json"}))
    schema = {"type": "object"}
    assert not format_warning(
        parse_request({"model": "m", "prompt": "Reply in JSON", "format": schema})
    )
    assert not format_warning(parse_request({"model": "m", "prompt": "Hi"}))


def test_chat_rendering_fallback_bos_and_template_errors() -> None:
    from scheduler.chat import render

    turns = [{"role": "user", "content": "hi"}]
    assert render("", turns) == "User: hi\nAssistant:"  # a base model without a template
    with_bos = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert render(with_bos, turns, bos_text="<s>") == "[hi]"  # the runner adds BOS itself
    strict = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(InvalidRequest, match="system first"):
        render(strict, turns, model="m")
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(InvalidRequest, match="did not finish: it ran past 2,000,000 steps"):
        render(endless, turns, model="m")
    long_chat = [{"role": "user", "content": str(n)} for n in range(2000)]  # a real one runs
    assert render("", long_chat).endswith("User: 1999\nAssistant:")


def test_generation_progress_reported_at_most_once_a_second() -> None:
    from workers.generation import Ticker

    now = [0.0]
    published: list[str] = []
    reports: list[tuple[str, int]] = []
    ticker = Ticker(
        lambda state, tokens: reports.append((state, tokens)),
        published.append,
        every_s=1.0,
        clock=lambda: now[0],
    )
    for step in range(25):
        now[0] = step * 0.1
        ticker("x")
    assert len(published) == 25
    assert reports == [("generating", 1), ("generating", 11), ("generating", 21)]


def test_a_load_is_abandoned_only_when_it_stops_progressing() -> None:
    from workers.loadwatch import LoadWatch

    now = [0.0]
    watch = LoadWatch(timeout_s=10, clock=lambda: now[0])
    for step in range(1, 30):  # slow but steady: 29 s in all, never 10 s without progress
        now[0] = float(step)
        assert watch.progress(step / 30)
    now[0] += 11  # then nothing for 11 s
    assert not watch.progress(29 / 30)
    assert "no progress for 11 s at 97%" in watch.describe()


def test_worker_pool_has_a_thread_for_every_slot_and_every_job_let_wait_there() -> None:
    from scheduler.settings import Settings
    from workers.main import pool_size

    assert pool_size(Settings(num_parallel=1, worker_threads=8), 1) == 8
    # 4 slots and (by default) 4 waiting per runner, 3 runners per device, 2 devices
    assert pool_size(Settings(num_parallel=4, max_loaded_models=3), 2) == 48
    assert pool_size(Settings(model_parallel={"big": 16}, max_loaded_models=1), 1) == 32
    assert pool_size(Settings(num_parallel=4, runner_queue=1, max_loaded_models=1), 1) == 8


def test_tensor_split_follows_placements_blocks_per_gpu() -> None:
    from workers.devices import tensor_split

    assert tensor_split(["gpu:h:0", "gpu:h:2"], [10, 7]) == [10.0, 0.0, 8.0]  # +1: output
    assert tensor_split(["gpu:h:1"], [24]) is None  # one device: llama.cpp's own choice
    assert tensor_split(["vgpu:h:0", "vgpu:h:1"], [3, 4]) is None  # computed on the host


def test_helper_threads_and_children_give_way() -> None:
    seen: list[int] = []

    def helper() -> None:
        lower_thread_priority(3)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    base = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert seen == [min(19, base + 3)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # caller unchanged
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.nice(0))"],
        preexec_fn=niced_child_preexec(5),
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(child.stdout) == min(19, base + 5)


def test_a_quiet_reader_backs_off_and_is_brisk_again_after_a_chunk() -> None:
    now = [0.0]
    order = ChunkOrder("j", timeout_s=None, clock=lambda: now[0])
    order.from_record([])
    waits = []
    for _ in range(6):
        waits.append(order.wait_s())
        assert order.from_message(None) is None and order.backfill  # re-check the record
        order.from_record([])
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert order.from_message({"data": '{"seq": 1, "response": "a"}'})["response"] == "a"
    assert order.wait_s() == 1.0
    # a job's timeout still bounds every wait, however long the quiet spell
    timed = ChunkOrder("j", timeout_s=3.0, clock=lambda: now[0])
    for _ in range(3):
        timed.from_message(None)
    now[0] = 1.0
    assert timed.wait_s() == 2.0
    now[0] = 3.0
    with pytest.raises(TimeoutError, match="no chunk of job j for 3.0 s"):
        timed.wait_s()


@pytest.mark.parametrize(
    ("cpus", "cores", "expected"),
    [
        ([0, 1], {0: "0", 1: "1"}, (2, 2)),  # two cores, no SMT: both threads for one token
        ([0, 1, 2, 3], {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}, (2, 4)),  # SMT pairs
        ([2], {2: "2-3"}, (1, 1)),  # a container allowed one CPU of the host's
    ],
)
def test_llama_threads_follow_physical_cores_for_one_token_and_cpus_for_batches(
    cpus: list[int], cores: dict[int, str], expected: tuple[int, int]
) -> None:
    assert thread_counts(cpus, cores.__getitem__) == expected


def test_a_loop_survives_what_its_step_raises_and_reports_it_while_it_fails() -> None:
    stop, health, now = threading.Event(), LoopHealth(), [0.0]
    outcomes: list[Exception | None] = [ValueError("bad message"), KeyError("x"), None, None]

    def step() -> None:
        now[0] += 10.0
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        if not outcomes:
            assert health.failing(now[0], 5.0) == {}  # the success before this cleared it
            stop.set()

    def clock() -> float:
        return now[0]

    seen: list[dict[str, str]] = []
    original = health.failed

    def failed(name: str, error: str, at: float) -> None:
        original(name, error, at)
        seen.append(health.failing(at + 6.0, 5.0))

    health.failed = failed  # type: ignore[method-assign]
    run_loop("demo", step, stop, health, clock=clock, backoff_s=(0.0,))
    assert not outcomes  # every step ran: the exceptions did not end the loop
    assert seen == [{"demo": "ValueError: bad message"}, {"demo": "KeyError: 'x'"}]
    assert health.describe(now[0] + 100, 5.0) == ""
    # the loop that writes the health record does not call itself failing as it writes it
    health.failed("heartbeat", "ConnectionError: refused", 0.0)
    health.failed("strays", "ConnectionError: refused", 0.0)
    assert health.describe(100.0, 5.0, "heartbeat") == "strays: ConnectionError: refused"


def test_a_hole_the_stream_record_cannot_fill_is_an_error_and_garbage_is_ignored() -> None:
    order = ChunkOrder("j", timeout_s=None)

    def entry(seq: int) -> tuple[bytes, dict[bytes, bytes]]:
        return f"0-{seq}".encode(), {b"c": json.dumps({"seq": seq, "response": "x"}).encode()}

    assert [c["seq"] for c in order.from_record([entry(1), entry(2)])] == [1, 2]
    assert order.from_message({"data": b"\xff not json"}) is None and order.backfill
    assert order.from_message({"data": b'{"no": "seq"}'}) is None
    with pytest.raises(ChunksLost, match="chunks 3 to 4 of job j are lost"):
        order.from_record([entry(5)])


def test_writes_redis_missed_are_kept_in_order_and_done_when_it_is_back() -> None:
    done: list[str] = []
    away = [True]

    def write(name: str) -> Callable[[], None]:
        def run() -> None:
            if away[0]:
                raise redis.ConnectionError("Connection refused")
            done.append(name)

        return run

    backlog = Backlog(limit=2)
    for name in ("end a", "end b", "end c"):
        backlog.run(name, write(name))
    assert len(backlog) == 2 and not done  # bounded: the oldest went
    with pytest.raises(redis.ConnectionError):
        backlog.drain()
    away[0] = False
    backlog.run("end d", write("end d"))  # behind the kept ones, not before them
    assert done == [] and len(backlog) == 2  # ... and the bound holds: "end b" went
    assert backlog.drain() == 2
    assert done == ["end c", "end d"]
    backlog.run("end e", write("end e"))  # nothing kept: written at once
    assert done[-1] == "end e" and len(backlog) == 0


def test_no_fast_path_route_beside_a_replica_whose_device_lapsed() -> None:
    """A model with two replicas has no route (placement chooses between them), also while
    one replica's device is between a lapsed beat and its reap (after a Redis outage)."""

    def runner(rid: str, device: str, state: str = "ready") -> RunnerState:
        return RunnerState(rid, "m", "c", {device: 1}, state, 0, -1, 0.0)  # type: ignore[arg-type]

    alive = DeviceState("d1", "w1", "q1", "gpu", 8, 8, 1)
    req = JobRequest(model="m", prompt="p")
    placement = Placement(id="p", runner_id="r1", device_id="d1", config=RunnerConfig(512))

    def route(*others: RunnerState) -> object:
        snap = Snapshot([alive], [runner("r1", "d1"), *others])  # d2 beat no more
        return route_for(req, Assigned("r1", "d1"), placement, snap, "c", None)

    assert route() is not None and route(runner("r2", "d2", "unloading")) is not None
    assert route(runner("r2", "d2")) is None


def test_a_loop_failing_while_redis_is_away_retries_within_a_beat() -> None:
    """A loop that runs every few seconds, failing only because Redis is away, tries again
    within half a second (a heartbeat), so it reads healthy soon after Redis returns."""

    class Pauses(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list[float] = []

        def wait(self, timeout: float | None = None) -> bool:
            self.asked.append(float(timeout or 0.0))
            if len(self.asked) >= 4:
                self.set()
            return self.is_set()

    stop = Pauses()

    def step() -> None:
        raise redis.ConnectionError("Error 111 connecting: Connection refused")

    run_loop("strays", step, stop, LoopHealth(), every_s=5.0, expected=(redis.RedisError,))
    assert stop.asked and max(stop.asked) <= EXPECTED_RETRY_S


def test_ps_lists_the_longest_time_to_expiry_first() -> None:
    soon, busy, later = (
        runner_view(id=i, expires_at=t) for i, t in (("s", 100), ("b", -1), ("l", 200))
    )
    assert [r.id for r in by_expiry([soon, busy, later])] == ["b", "l", "s"]
