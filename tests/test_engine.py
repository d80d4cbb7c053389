"""The runner's engine: continuous batching on one llama.cpp context.

Pure parts (stop strings, UTF-8 buffering, budgets, sampler plan, admission) without
llama.cpp; the rest on tiny generated models (fast, exact) and the demo model for what
needs a real tokenizer and a model that can write JSON.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.errors import InvalidRequest, JobFailed, LoadFailed
from scheduler.protocol import Options, RunnerConfig
from tests.conftest import needs_demo, wait_for
from tests.tinymodel import write_tiny_model
from workers.engine.batching import (
    Admission,
    Feed,
    batch_rows,
    best_slot,
    by_reuse,
    common_prefix,
    prompt_take,
    reusable,
)
from workers.engine.job import Job, StepTimes
from workers.engine.relay import TextRelay
from workers.engine.sampling import sampler_plan
from workers.engine.text import GenerationStats, StopMatcher, Utf8Stream, token_budget
from workers.runner import Runner

GREEDY = {"temperature": 0, "repeat_penalty": 1.1}
PROMPTS = [
    "the sky is blue",
    "a",
    "hello world and more words to make it longer than the others",
    "of the and",
    "xyz",
    "to be or not to be",
    "blue sky",
    "the",
]


# -- pure parts ---------------------------------------------------------------------------


def ignore(_text: str) -> None:
    pass


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_string_split_over_pieces_is_cut_and_never_emitted() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", False)  # "</" may begin the stop string
    assert m.feed("en") == ("", False)
    assert m.feed("d> more") == ("", True)


def test_held_text_that_is_not_a_stop_string_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("x S") == ("x ", False)
    assert m.flush() == "S"


def test_earliest_of_several_stop_strings_wins() -> None:
    assert feed_all(StopMatcher(["world", "lo w"]), ["hel", "lo world"]) == ("hel", True)
    assert feed_all(StopMatcher(["\n\n", "END"]), ["a\n", "b END\n\n"]) == ("a\nb ", True)


def test_no_stop_strings_passes_text_through() -> None:
    m = StopMatcher(["", ""])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_utf8_characters_split_between_tokens_are_buffered() -> None:
    stream = Utf8Stream()
    data = "é€😀".encode()
    out = [stream.feed(data[i : i + 1]) for i in range(len(data))]
    assert "".join(out) == "é€😀"
    assert out[0] == "" and out[1] == "é"  # nothing half-decoded is ever emitted
    assert stream.feed(b"\xf0\x9f") == "" and stream.flush() == "\ufffd"


def test_token_budget() -> None:
    assert token_budget(-1, 100, 10) == 90  # until the slot is full
    assert token_budget(-2, 100, 10) == 90
    assert token_budget(5, 100, 10) == 5
    assert token_budget(500, 100, 10) == 90


def test_sampler_plan_orders_and_prefilters_penalties() -> None:
    greedy = sampler_plan(Options(temperature=0, repeat_penalty=1.1, repeat_last_n=64), 512)
    assert greedy == [("top_k", 65), ("penalties", 64, 1.1, 0.0, 0.0), ("greedy",)]
    plain = sampler_plan(Options(temperature=0, repeat_penalty=1.0), 512)
    assert plain == [("greedy",)]
    sampled = sampler_plan(Options(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3), 512)
    assert [s[0] for s in sampled] == [
        "top_k", "penalties", "top_k", "top_p", "min_p", "temp", "dist",
    ]  # fmt: skip
    assert sampled[0] == ("top_k", 40 + 64) and sampled[-1] == ("dist", 3)
    # a penalty that can raise logits needs the whole vocabulary
    raising = sampler_plan(Options(temperature=0, presence_penalty=-0.5), 512)
    assert raising[0][0] == "penalties"
    whole_ctx = sampler_plan(Options(temperature=0, repeat_last_n=-1), 512)
    assert ("penalties", 512, 1.1, 0.0, 0.0) in whole_ctx


def test_admission_is_first_come_first_served_over_free_slots() -> None:
    adm: Admission[str] = Admission(2)
    for job in "abcd":
        adm.push(job)
    assert adm.admit() == [("a", 0), ("b", 1)]
    assert adm.admit() == []
    assert adm.take_cancelled(lambda j: j == "c") == ["c"]
    adm.release(1)
    assert adm.admit() == [("d", 1)]
    adm.push("e")
    assert adm.drain() == ["e"] and adm.admit() == []


# -- the engine on tiny models ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


def tiny(directory: Path, arch: str = "llama") -> str:
    path = directory / f"tiny-{arch}.gguf"
    if not path.exists():
        write_tiny_model(path, arch, n_embd=128)
    return str(path)


def make_runner(
    path: str, parallel: int, num_ctx: int = 256, n_batch: int = 512, device_sampling: bool = False
) -> Runner:
    config = RunnerConfig(num_ctx, parallel, n_batch=n_batch, n_ubatch=n_batch)
    return Runner("r", "tiny", path, config, ["cpu:t"], 0, None, 0, device_sampling=device_sampling)


@pytest.fixture()
def runner_factory(tiny_dir: Path) -> Iterator[Callable[..., Runner]]:
    made: list[Runner] = []

    def factory(
        parallel: int = 2,
        num_ctx: int = 256,
        arch: str = "llama",
        n_batch: int = 512,
        device_sampling: bool = False,
    ) -> Runner:
        path = tiny(tiny_dir, arch)
        made.append(make_runner(path, parallel, num_ctx, n_batch, device_sampling))
        return made[-1]

    yield factory
    for runner in made:
        runner.close()


def run_all(
    runner: Runner, prompts: list[str], options: Options, **kw: Any
) -> list[GenerationStats]:
    """generate() for every prompt, each from its own thread, all at once."""
    results: list[GenerationStats | BaseException | None] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = runner.generate(prompts[i], options, lambda _t: None, **kw)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, GenerationStats)]


@pytest.mark.parametrize("parallel", [2, 3, 4])
def test_concurrent_jobs_all_complete_with_their_stats(
    runner_factory: Callable[..., Runner], parallel: int
) -> None:
    runner = runner_factory(parallel)
    options = Options(num_predict=12, **GREEDY)
    results = run_all(runner, PROMPTS, options)
    for prompt, stats in zip(PROMPTS, results, strict=True):
        assert stats.done_reason == "length"
        assert stats.eval_count == 12
        assert stats.prompt_eval_count == len(runner.engine.tokenize(prompt))
        assert stats.prompt_eval_duration_ns > 0 and stats.eval_duration_ns > 0
        assert stats.text


@pytest.mark.parametrize("penalty", [1.1, 1.0], ids=["sampler-chain", "argmax"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_output_is_the_same_alone_and_in_a_batch(
    runner_factory: Callable[..., Runner], arch: str, penalty: float
) -> None:
    # Exact on these f32 models. On the quantized demo model llama.cpp's CPU kernels give
    # a row slightly different logits depending on how many rows share the matmul, so
    # near-ties can break differently (see bench/README.md, batch_throughput).
    runner = runner_factory(4, arch=arch)
    options = Options(num_predict=40, temperature=0, repeat_penalty=penalty)
    prompts = PROMPTS * 2  # more jobs than slots: sequences join and leave mid-batch
    alone = [runner.generate(p, options, lambda _t: None).text for p in prompts]
    batched = [s.text for s in run_all(runner, prompts, options)]
    assert batched == alone


def test_prompts_fed_in_chunks_beside_running_sequences_answer_as_alone(
    runner_factory: Callable[..., Runner],
) -> None:
    # n_batch 5 with 4 slots: long prompts go in over several steps, their last token a
    # step after the rest while others decode
    runner = runner_factory(4, n_batch=5)
    options = Options(num_predict=16, temperature=0, repeat_penalty=1.0)
    prompts = [PROMPTS[2], "a", PROMPTS[0], PROMPTS[2] + " again", "of the and", "xyz"]
    alone = [runner.generate(p, options, lambda _t: None).text for p in prompts]
    assert [s.text for s in run_all(runner, prompts, options)] == alone


def greedy_through_llama_cpp(options: Options, num_ctx: int) -> list[tuple[Any, ...]]:
    """Plain greedy as a plan the sampler hands to llama.cpp's chain (top-k 0 keeps all)."""
    plan = sampler_plan(options, num_ctx)
    assert plan == [("greedy",)]
    return [("top_k", 0), *plan]


@pytest.mark.parametrize("model", ["tiny", pytest.param("demo", marks=needs_demo)])
def test_plain_greedy_picks_the_tokens_of_llama_cpps_greedy_sampler(
    runner_factory: Callable[..., Runner],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    model: str,
) -> None:
    # plain greedy takes the argmax with numpy instead of llama.cpp's sampler chain
    runner = request.getfixturevalue("demo") if model == "demo" else runner_factory(1)
    options = Options(num_predict=48, temperature=0, repeat_penalty=1.0)
    prompts = ["Write a short story about a cat.", "The capital of France is", "1, 2, 3,"]
    fast = [runner.generate(p, options, ignore).text for p in prompts]
    monkeypatch.setattr("workers.engine.prepare.sampler_plan", greedy_through_llama_cpp)
    chain = [runner.generate(p, options, ignore).text for p in prompts]
    assert fast == chain and all(fast)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_on_the_device_picks_the_hosts_tokens_beside_other_samplers(
    runner_factory: Callable[..., Runner], arch: str
) -> None:
    """Plain greedy jobs take their tokens in llama_decode (workers/engine/device_sampling.py)
    while seeded and penalized jobs share the batch and the slots: a slot's greedy chain is
    attached and detached as jobs of either kind take it, and every job answers as it does
    with every token sampled on the host."""
    greedy = Options(num_predict=24, temperature=0, repeat_penalty=1.0)
    seeded = Options(num_predict=24, temperature=0.9, seed=7)
    penalized = Options(num_predict=24, temperature=0, repeat_penalty=1.2)
    jobs = [(p, o) for p in PROMPTS for o in (greedy, seeded, greedy, penalized)]
    answers = []
    for on_device in (True, False):
        runner = runner_factory(3, arch=arch, device_sampling=on_device)
        assert runner.engine._device.enabled is on_device
        results: list[str] = [""] * len(jobs)

        def one(i: int, runner: Runner = runner, results: list[str] = results) -> None:
            prompt, options = jobs[i]
            results[i] = runner.generate(prompt, options, ignore).text

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        answers.append(results)
        device = runner.engine._device
        assert (device.tokens > 0) is on_device  # greedy jobs' tokens came from llama_decode
    assert answers[0] == answers[1] and all(answers[0])


def test_a_slot_back_to_greedy_gets_a_new_chain_on_the_device(
    runner_factory: Callable[..., Runner],
) -> None:
    """One slot, jobs in turn: greedy attaches a chain, a seeded job detaches it, and the
    next greedy job attaches a new one (llama.cpp initializes a chain once: the same one
    again would abort the process); each answers as on the host."""
    greedy = Options(num_predict=12, temperature=0, repeat_penalty=1.0)
    seeded = Options(num_predict=12, temperature=0.9, seed=3)
    turns = [("The sky", greedy), ("The sky", seeded), ("A river", greedy), ("1, 2", greedy)]
    on_host = runner_factory(1, device_sampling=False)
    expected = [on_host.generate(p, o, ignore).text for p, o in turns]
    runner = runner_factory(1, device_sampling=True)
    assert [runner.generate(p, o, ignore).text for p, o in turns] == expected
    device = runner.engine._device
    assert (device.attaches, device.detaches) == (2, 1)
    assert device.tokens == 3 * 12


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(
    runner_factory: Callable[..., Runner],
) -> None:
    runner = runner_factory(4)
    options = Options(num_predict=30, temperature=0.9, seed=7)
    alone = [runner.generate(p, options, lambda _t: None).text for p in PROMPTS]
    assert [s.text for s in run_all(runner, PROMPTS, options)] == alone


class Gate:
    """Holds a job's text inside its on_text until released, and so the decode loop once
    its text relay is LAG steps behind (tests only): a gated job needs more than LAG + 1
    tokens to keep its slot."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, _text: str) -> None:
        self.entered.set()
        assert self.release.wait(30)


def start(
    runner: Runner,
    prompt: str,
    options: Options,
    on_text: Callable[[str], None] = lambda _t: None,
    **kw: Any,
) -> tuple[threading.Thread, dict[str, Any]]:
    """generate() in a thread of its own; the box gets its stats or its error."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["stats"] = runner.generate(prompt, options, on_text, **kw)
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def wait_queued(runner: Runner, n: int) -> None:
    for _ in range(3000):
        if len(runner.engine._admission.waiting) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{n} jobs never queued")


def test_jobs_beyond_the_slots_are_served_in_arrival_order(
    runner_factory: Callable[..., Runner],
) -> None:
    runner = runner_factory(1)
    gate = Gate()
    order: list[int] = []
    first, _ = start(runner, "a", Options(num_predict=8, **GREEDY), gate)
    assert gate.entered.wait(30)
    threads = []
    for i in range(4):

        def note(_text: str, i: int = i) -> None:
            if i not in order:
                order.append(i)

        threads.append(start(runner, PROMPTS[i], Options(num_predict=3, **GREEDY), note))
        wait_queued(runner, i + 1)  # each arrives after the one before
    gate.release.set()
    for t, box in [(first, {}), *threads]:
        t.join(30)
        assert "error" not in box
    assert order == [0, 1, 2, 3]


def test_cancel_while_running_frees_the_slot_for_the_next_job(
    runner_factory: Callable[..., Runner],
) -> None:
    runner = runner_factory(1, num_ctx=2048)
    at_cancel: list[int] = []

    def cancelled() -> bool:  # polled by the decode loop before each step: the count is settled
        job = runner.engine._active[0] if runner.engine._active else None
        mine = job is not None and job.cancelled is cancelled  # not the later job, in the slot
        if not at_cancel and mine and job.generated >= 2:
            at_cancel.append(job.generated)
        return bool(at_cancel)

    running, box = start(
        runner, "the", Options(num_predict=-1, **GREEDY), lambda _t: None, cancelled=cancelled
    )
    later, later_box = start(runner, "a", Options(num_predict=5, **GREEDY))
    running.join(30)
    later.join(30)
    stats = box["stats"]
    assert stats.done_reason == "cancel"
    assert stats.eval_count == at_cancel[0]  # not one more token after the request
    assert later_box["stats"].done_reason == "length" and later_box["stats"].eval_count == 5


def test_cancel_during_a_long_prompts_processing_stops_it_there(
    runner_factory: Callable[..., Runner],
) -> None:
    """A long prompt is fed n_batch tokens a step, and cancellation is polled at every
    step: a job cancelled after its first chunk leaves its slot at the next step, not once
    its whole prompt would have been processed (the slot's state tells, not a timer)."""
    runner = runner_factory(1, num_ctx=4096, n_batch=32)
    seen: dict[str, int] = {}

    def cancelled() -> bool:  # polled by the loop at the start of each step
        (job,) = runner.engine._active or (None,)
        if job is not None and job.fed and "fed" not in seen:
            seen.update(fed=job.fed, prompt=len(job.tokens))
        if job is not None:
            seen["last"] = job.fed
        return "fed" in seen

    thread, box = start(
        runner, "one two " * 300, Options(num_predict=4, **GREEDY), cancelled=cancelled
    )
    thread.join(60)
    assert "error" not in box, box.get("error")
    assert box["stats"].done_reason == "cancel" and box["stats"].eval_count == 0
    assert seen["prompt"] > 20 * 32  # a prompt of many steps' worth
    assert seen["last"] == seen["fed"] <= 2 * 32  # it went no further than where it stood
    later, later_box = start(runner, "a", Options(num_predict=3, **GREEDY))
    later.join(30)
    assert later_box["stats"].done_reason == "length"  # the slot serves the next job


def test_cancel_while_waiting_never_starts(runner_factory: Callable[..., Runner]) -> None:
    runner = runner_factory(1)
    gate = Gate()
    first, first_box = start(runner, "a", Options(num_predict=8, **GREEDY), gate)
    assert gate.entered.wait(30)
    called: list[str] = []
    cancel = threading.Event()
    waiting, box = start(
        runner,
        "b",
        Options(num_predict=3, **GREEDY),
        called.append,
        cancelled=cancel.is_set,
    )
    wait_queued(runner, 1)
    cancel.set()
    gate.release.set()
    waiting.join(30)
    first.join(30)
    assert box["stats"].done_reason == "cancel"
    assert box["stats"].eval_count == 0 and box["stats"].text == "" and called == []
    assert first_box["stats"].done_reason == "length"


def test_a_job_whose_start_fails_in_the_loop_fails_and_the_loop_serves_on(
    runner_factory: Callable[..., Runner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure while the loop starts a job in its slot (attaching its sampler, finding
    its prompt in the slot's cache) fails that job; it never leaves its caller waiting."""
    runner = runner_factory(1, device_sampling=True)
    options = Options(num_predict=4, **GREEDY)

    def broken(*_a: Any) -> bool:
        raise RuntimeError("llama.cpp refused the sampler")

    with monkeypatch.context() as patch:
        patch.setattr(runner.engine._device, "take", broken)
        with pytest.raises(JobFailed, match="refused the sampler"):
            runner.generate("the sky", options, ignore)
    assert runner.generate("the sky", options, ignore).eval_count == 4


def test_a_job_whose_start_fails_fails_alone_beside_a_running_one(
    runner_factory: Callable[..., Runner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that cannot start in its slot fails alone: a job already running on the
    runner goes on to its end."""
    runner = runner_factory(2, num_ctx=512, device_sampling=True)
    gate = Gate()
    running, box = start(runner, "a", Options(num_predict=8, **GREEDY), gate)
    assert gate.entered.wait(30)  # it runs, held in its first piece of text

    tried = threading.Event()

    def broken(*_a: Any) -> bool:
        tried.set()
        raise RuntimeError("llama.cpp refused the sampler")

    with monkeypatch.context() as patch:
        patch.setattr(runner.engine._device, "take", broken)
        failing, failed = start(runner, "b", Options(num_predict=4, **GREEDY))
        # queued behind the held loop, or started (and failed) before the loop waited
        assert wait_for(lambda: runner.engine._admission.waiting or tried.is_set())
        gate.release.set()
        failing.join(30)
    running.join(30)
    assert "refused the sampler" in str(failed["error"])
    assert box["stats"].done_reason == "length" and box["stats"].eval_count == 8


def test_stop_string_ends_the_job_before_it(runner_factory: Callable[..., Runner]) -> None:
    runner = runner_factory(2)
    options = Options(num_predict=60, **GREEDY)
    full = runner.generate("the sky", options, lambda _t: None).text
    at = next(k for k in range(4, len(full) - 3) if full[k : k + 3].replace(" ", "a").isalpha())
    stop = full[at : at + 3]
    streamed: list[str] = []
    options = Options(num_predict=60, stop=[stop], **GREEDY)
    stats = runner.generate("the sky", options, streamed.append)
    assert stats.done_reason == "stop"
    assert stats.text == full[: full.index(stop)] == "".join(streamed)


def test_a_stop_string_found_off_the_decode_thread_counts_the_tokens_up_to_it(
    runner_factory: Callable[..., Runner],
) -> None:
    """The text relay finds a stop string a step or more after the token that made it was
    decoded: the answer still ends before it, and its account counts the tokens up to that
    one, not those the loop decoded meanwhile."""
    runner = runner_factory(2)
    tokens: list[int] = []
    full = runner.generate("the sky", Options(num_predict=60, **GREEDY), ignore, answer=tokens).text
    at = next(k for k in range(4, len(full) - 3) if full[k : k + 3].replace(" ", "a").isalpha())
    stop = full[at : at + 3]
    piece = runner.engine._tokenizer.piece

    def text_of(n: int) -> str:  # the first n tokens' text
        return b"".join(piece(t)[0] for t in tokens[:n]).decode(errors="replace")

    made = next(n for n in range(1, len(tokens) + 1) if stop in text_of(n))
    stats = runner.generate("the sky", Options(num_predict=60, stop=[stop], **GREEDY), ignore)
    assert (stats.done_reason, stats.text) == ("stop", full[: full.index(stop)])
    assert stats.eval_count == made


def test_num_predict_bounds_the_output(runner_factory: Callable[..., Runner]) -> None:
    runner = runner_factory(2, num_ctx=48)
    n_prompt = len(runner.engine.tokenize("the sky"))
    for num_predict, expected in ((7, 7), (-1, 48 - n_prompt), (-2, 48 - n_prompt)):
        stats = runner.generate("the sky", Options(num_predict=num_predict, **GREEDY), ignore)
        assert (stats.done_reason, stats.eval_count) == ("length", expected)
    stats = runner.generate("the sky", Options(num_predict=0), ignore)
    assert (stats.done_reason, stats.eval_count, stats.text) == ("length", 0, "")


def test_prompt_longer_than_a_slot_is_refused(runner_factory: Callable[..., Runner]) -> None:
    runner = runner_factory(2, num_ctx=32)
    with pytest.raises(InvalidRequest, match="shorten the prompt or raise options.num_ctx"):
        runner.generate("the sky is blue " * 20, Options(), ignore)
    assert runner.generate("a", Options(num_predict=2, **GREEDY), ignore).eval_count == 2


def test_failed_decode_fails_its_jobs_and_the_loop_keeps_serving(
    runner_factory: Callable[..., Runner],
) -> None:
    runner = runner_factory(2)
    engine = runner.engine
    real = engine._L

    class FailOnce:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def llama_decode(self, _ctx: Any, _batch: Any) -> int:
            engine._L = real
            return 1

    engine._L = FailOnce()  # type: ignore[assignment]
    with pytest.raises(JobFailed, match=r"llama_decode returned 1 \(no room in the KV cache"):
        runner.generate("the sky", Options(num_predict=5, **GREEDY), ignore)
    assert runner.generate("the sky", Options(num_predict=5, **GREEDY), ignore).eval_count == 5


def test_a_failing_consumer_fails_only_its_job(runner_factory: Callable[..., Runner]) -> None:
    runner = runner_factory(2)

    def broken(_text: str) -> None:
        raise ConnectionError("redis went away")

    with pytest.raises(JobFailed, match="redis went away"):
        runner.generate("the sky", Options(num_predict=5, **GREEDY), broken)
    assert runner.generate("the sky", Options(num_predict=5, **GREEDY), ignore).eval_count == 5


def test_close_ends_running_and_waiting_jobs(tiny_dir: Path) -> None:
    runner = make_runner(tiny(tiny_dir), 1)
    gate = Gate()
    jobs = [start(runner, "a", Options(num_predict=8, **GREEDY), gate)]
    assert gate.entered.wait(30)
    jobs += [start(runner, p, Options(num_predict=5, **GREEDY)) for p in PROMPTS[:2]]
    wait_queued(runner, 2)
    closer = threading.Thread(target=runner.close)
    closer.start()
    gate.release.set()
    closer.join(30)
    for thread, box in jobs:
        thread.join(30)
        assert isinstance(box.get("error"), JobFailed)
        assert "unloaded" in str(box["error"])
    with pytest.raises(JobFailed, match="takes no more jobs"):
        runner.generate("a", Options(num_predict=2), ignore)


def test_a_schemas_strings_parse_on_a_vocabulary_of_byte_tokens(
    runner_factory: Callable[..., Runner],
) -> None:
    """The tiny model's vocabulary is mostly byte tokens (<0x04>, <0xE4> ...), as Gemma's
    and most SentencePiece vocabularies fall back on: a string the grammar lets through
    must hold no raw control character and no broken UTF-8, and keep its maxLength
    (18 of 20 seeds broke one of these before); a pattern's "." no bare quote either."""
    runner = runner_factory(parallel=1)
    name = {"type": "string", "maxLength": 10}
    code = {"type": "string", "pattern": "^a.b$"}
    schema = {"type": "object", "properties": {"name": name, "code": code}}
    schema["required"] = ["name", "code"]
    for seed in range(20):
        options = Options(temperature=1.0, seed=seed, num_predict=160)
        stats = runner.generate("x", options, lambda _t: None, format=schema)
        value = json.loads(stats.text)  # no control character: JSON refuses them
        assert len(value["name"]) <= 10 and "\ufffd" not in value["name"], (seed, stats.text)
        assert len(value["code"]) == 3 and value["code"][::2] == "ab", (seed, stats.text)


def test_logprobs_are_the_models_own_with_their_alternatives(
    runner_factory: Callable[..., Runner],
) -> None:
    """Each generated token's log probability and its top alternatives, from the logits:
    greedy picks the likeliest, so it heads its alternatives; sampling records too."""
    runner = runner_factory(parallel=2)
    greedy = runner.generate(
        "the sky", Options(temperature=0, num_predict=6, top_logprobs=3), lambda _t: None
    )
    assert greedy.logprobs is not None and len(greedy.logprobs) == greedy.eval_count
    for token in greedy.logprobs:
        alternatives = token["top_logprobs"]
        assert len(alternatives) == 3 and alternatives[0]["logprob"] == token["logprob"] <= 0
        assert bytes(token["bytes"]).decode("utf-8", "replace") == token["token"]
        assert sum(math.exp(a["logprob"]) for a in alternatives) <= 1.0 + 1e-6
    assert "".join(t["token"] for t in greedy.logprobs) == greedy.text
    sampled = runner.generate(
        "x", Options(temperature=1.0, seed=2, num_predict=4, top_logprobs=0), lambda _t: None
    )
    assert sampled.logprobs is not None and all(t["top_logprobs"] == [] for t in sampled.logprobs)
    plain = runner.generate("x", Options(temperature=0, num_predict=2), lambda _t: None)
    assert plain.logprobs is None
    argmax = Options(temperature=0, repeat_penalty=1.0, num_predict=3, top_logprobs=1)
    greedy_alone = runner.generate("x", argmax, lambda _t: None)  # no chain: the argmax
    assert greedy_alone.logprobs is not None and len(greedy_alone.logprobs) == 3


def test_format_with_an_invalid_value_is_refused(runner_factory: Callable[..., Runner]) -> None:
    runner = runner_factory(1)
    with pytest.raises(InvalidRequest, match="format"):
        runner.generate("a", Options(), ignore, format="yaml")


# -- the demo model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> Iterator[Runner]:
    from scheduler.gguf.registry import demo_model_path

    runner = Runner(
        "demo", "gemma3-270m", str(demo_model_path()), RunnerConfig(1024, 2), ["cpu"], 0, None, 0
    )
    yield runner
    runner.close()


@needs_demo
def test_format_json_yields_json(demo: Runner) -> None:
    options = Options(temperature=0, num_predict=128)
    prompt = "Describe a cat as a JSON object with the keys name and age."
    stats = demo.generate(prompt, options, lambda _t: None, format="json")
    assert stats.done_reason == "stop", stats.text
    assert isinstance(json.loads(stats.text), dict)


@needs_demo
def test_format_schema_yields_an_object_of_that_schema(demo: Runner) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    options = Options(temperature=0, num_predict=128)
    prompt = "Give the name and age of a famous scientist as JSON."
    stats = demo.generate(prompt, options, lambda _t: None, format=schema)
    value = json.loads(stats.text)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


@needs_demo
def test_demo_model_streams_whole_characters(demo: Runner) -> None:
    pieces: list[str] = []
    options = Options(temperature=0, num_predict=40)
    stats = demo.generate("Write three words in Japanese:", options, pieces.append)
    assert "".join(pieces) == stats.text and "\ufffd" not in stats.text


def test_a_load_without_progress_is_abandoned(tiny_dir: Path) -> None:
    # no time at all without progress: llama.cpp's first progress report aborts the load
    with pytest.raises(LoadFailed, match="made no progress"):
        Runner(
            "r",
            "tiny",
            tiny(tiny_dir),
            RunnerConfig(256),
            ["cpu:t"],
            0,
            None,
            0,
            load_timeout_s=0.0,
        )


def test_a_prompts_last_token_waits_for_the_next_step_while_others_decode() -> None:
    assert prompt_take(9, 512, others_decode=True) == (8, False)
    assert prompt_take(1, 512, others_decode=True) == (1, True)  # now it rides with them
    assert prompt_take(9, 512, others_decode=False) == (9, True)  # alone: no reason to wait
    assert prompt_take(9, 4, others_decode=True) == (4, False)  # a chunk of a long prompt
    assert prompt_take(9, 4, others_decode=False) == (4, False)
    assert prompt_take(2, 2, others_decode=False) == (2, True)


def test_batch_rows_list_every_sequences_first_token_in_id_order_then_the_rest() -> None:
    feeds = [
        Feed(seq=0, tokens=[100], pos=40, output=True),  # running sequences
        Feed(seq=3, tokens=[101], pos=12, output=True),
        Feed(seq=2, tokens=[7, 8, 9], pos=0, output=False),  # joining: all but its last
        Feed(seq=1, tokens=[5, 6], pos=4, output=True),  # a prompt's final chunk
    ]
    assert batch_rows(feeds) == [
        (0, 100, 40, 0, True),
        (3, 5, 4, 1, False),
        (2, 7, 0, 2, False),
        (1, 101, 12, 3, True),
        (3, 6, 5, 1, True),
        (2, 8, 1, 2, False),
        (2, 9, 2, 2, False),
    ]
    # what llama.cpp then splits off first: one token of every sequence, ids 0..3 in a run
    first = batch_rows(feeds)[: len(feeds)]
    assert [row[3] for row in first] == [0, 1, 2, 3]


def test_admission_prefers_the_slot_that_holds_the_prompts_start() -> None:
    adm: Admission[str] = Admission(3)
    cached = {0: 0, 1: 5, 2: 9}  # tokens each slot could reuse for any job
    for job in "ab":
        adm.push(job)
    assert adm.admit(by_reuse(lambda _job, slot: cached[slot])) == [("a", 2), ("b", 1)]
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2 and common_prefix([], [1]) == 0


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=6),
    caches=st.dictionaries(st.integers(0, 5), st.lists(st.integers(0, 3), max_size=6)),
    free=st.sets(st.integers(0, 5), min_size=1),
)
def test_the_quick_slot_choice_is_the_slot_rule(
    tokens: list[int], caches: dict[int, list[int]], free: set[int]
) -> None:
    """best_slot looks closely only at caches that start like the prompt: it must choose
    exactly as the rule that looks at every free slot."""
    rule = by_reuse(lambda job, slot: reusable(caches.get(slot, []), job))
    slots = list(free)  # in no particular order: the rule's lowest on a tie is the slot id's
    assert best_slot(tokens, slots, caches) == rule(tokens, slots)


def test_a_slot_rule_that_fails_loses_no_job(caplog: pytest.LogCaptureFixture) -> None:
    adm: Admission[str] = Admission(2)
    adm.push("a")

    def broken(_job: str, _free: list[int]) -> int:
        raise KeyError("a bug")

    assert adm.admit(broken) == [("a", 0)]  # out of the queue, and in the lowest slot
    assert "choosing a slot failed" in caplog.text


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_prompt_that_extends_a_cached_one_answers_as_if_evaluated_whole(
    runner_factory: Callable[..., Runner], arch: str
) -> None:
    options = Options(num_predict=24, **GREEDY)
    first = "the sky is blue and the sky"
    longer = first + " is a blue sky of the"
    fresh = runner_factory(1, arch=arch).generate(longer, options, lambda _t: None)
    runner = runner_factory(1, arch=arch)
    runner.generate(first, options, lambda _t: None)  # leaves its KV in the slot
    reused = runner.generate(longer, options, lambda _t: None)
    assert runner.engine.reused_tokens == len(runner.engine.tokenize(first))
    again = runner.generate(longer, options, lambda _t: None)  # all but the last token
    assert runner.engine.reused_tokens > 2 * len(runner.engine.tokenize(first))
    assert reused.text == fresh.text == again.text
    assert reused.prompt_eval_count == fresh.prompt_eval_count
    # each job's record says how much of its prompt the slot's cache held
    assert fresh.prompt_cached_count == 0
    assert reused.prompt_cached_count == len(runner.engine.tokenize(first))
    assert again.prompt_cached_count == len(runner.engine.tokenize(longer)) - 1


def test_the_loop_accounts_for_its_steps(runner_factory: Callable[..., Runner]) -> None:
    # what bench/step_split.py reports: every step counted, its parts within its whole
    runner = runner_factory(2)
    before = runner.engine.times.copy()
    emitted: list[str] = []
    stats = runner.generate(PROMPTS[0], Options(num_predict=12, **GREEDY), emitted.append)
    spent = runner.engine.times.since(before)
    assert spent.tokens == stats.eval_count == 12 and spent.steps >= 12
    assert spent.decode_ns > 0 and spent.sample_ns > 0 and spent.emit_ns > 0 and emitted
    assert spent.decode_ns + spent.sample_ns + spent.emit_ns <= spent.step_ns
    assert spent.bookkeeping_ns >= 0


class ListSampler:
    """A job's sampler as the text relay sees it: what it recorded of each sampled token."""

    top_logprobs = None

    def __init__(self, logprobs: list[dict[str, Any]]) -> None:
        self.logprobs = logprobs


def relayed(stops: list[str], on_text: Callable[[str], None], *items: Any) -> Job:
    """A job whose tokens (token, piece) and end (reason, error) go through a text relay,
    as the decode loop hands them over; once the relay is closed."""
    job = Job(
        tokens=[9],
        budget=10,
        sampler=ListSampler([{"token": n} for n in range(len(items))]),  # type: ignore[arg-type]
        on_text=on_text,
        cancelled=lambda: False,
        stops=StopMatcher(stops),
        first_ns=5,
    )
    relay = TextRelay("t", StepTimes())
    for item in items:
        if isinstance(item[0], int):
            relay.put([7, (job, *item)])
        else:
            job.error = item[1]  # the decode loop's, set before it hands the end over
            relay.put([(job, item[0], 9, True)])
    relay.close()
    assert job.done.is_set() and not relay._thread.is_alive()
    return job


def test_the_text_relay_keeps_an_answer_that_ended_at_its_stop_string_whole() -> None:
    """The loop decoded a token past the stop string, then met an error before it saw the
    relay's halt: the answer up to the stop is whole, and is the job's outcome."""
    said: list[str] = []
    error = JobFailed("llama_decode returned -1")
    job = relayed(["!"], said.append, (1, b"ab"), (2, b"c!d"), (3, b"zz"), ("error", error))
    assert job.error is None and job.stats is not None
    assert (job.stats.text, job.stats.done_reason, job.stats.eval_count) == ("abc", "stop", 2)
    assert said == ["ab", "c"] and job.out == [1, 2]
    assert job.stats.eval_duration_ns == 7 - 5  # to its stop's step, not to its end's
    assert job.sampler.logprobs == [{"token": 0}, {"token": 1}]


@pytest.mark.parametrize("raised", [ConnectionError("redis went away"), SystemExit(3)])
def test_a_consumer_that_raises_fails_its_job_and_the_relay_goes_on(raised: BaseException) -> None:
    def broken(text: str) -> None:
        if text == "b":
            raise raised

    job = relayed([], broken, (1, b"a"), (2, b"b"), (3, b"c"), ("length", None))
    assert isinstance(job.error, JobFailed) and job.stats is None and job.out == [1, 2]


def test_a_decode_loop_that_stops_on_a_bug_fails_its_jobs_and_takes_no_more(
    runner_factory: Callable[..., Runner], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug outside a step (here, in admission) ends the loop: it says so, the job that
    waited fails with what happened instead of waiting for ever, a later job is refused,
    and the runner still closes (its relay too)."""
    runner = runner_factory(1)

    def broken(*_a: Any) -> list[Any]:
        raise RuntimeError("admission lost its slots")

    monkeypatch.setattr(runner.engine._admission, "admit", broken)
    with pytest.raises(JobFailed, match="decode loop of 'tiny' stopped.*lost its slots"):
        runner.generate("the sky", Options(num_predict=4, **GREEDY), ignore)
    with pytest.raises(JobFailed, match="takes no more jobs"):
        runner.generate("the sky", Options(num_predict=4, **GREEDY), ignore)
    runner.close()
    assert not runner.engine._relay._thread.is_alive()
