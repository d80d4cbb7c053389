"""A job whose worker dies mid-answer goes on elsewhere from its last token
(scheduler/midstream.py): on a real stack of two hosts, the worker of a streaming greedy job
is SIGKILLed while the job is held running there (tests/held_worker.py), and the reader gets
one stream: every chunk once, no gap, and, with flash attention off, the same text token for
token as the job run without a fault. The same for a job under a JSON schema and for a stop
string that straddles the cut. The pure parts are unit tests at the end."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api_client import Client
from scheduler.midstream import TOKENS, Skip, SoFar, for_readers, why_not_resumed
from scheduler.store import keys
from scheduler.store.stats import job_timings
from tests.conftest import wait_for
from tests.held_worker import is_held, release
from tests.test_faults import Hosts, held_hosts
from workers.engine.job import Job
from workers.engine.text import StopMatcher

GREEDY = {"temperature": 0, "num_predict": 120, "num_ctx": 2048}


@pytest.fixture()
def two_hosts(tmp_path: Path) -> Iterator[Hosts]:
    """h1 (a 2 GiB virtual GPU) and h2 (1 GiB), whose worker holds HOLD@N: jobs after their
    Nth token: binpack sends the slow model to h2 first (tests/test_faults.py). Flash
    attention off, so a prefix evaluated in one batch gives the same logits as token by
    token."""
    with held_hosts(tmp_path, GGUFQ_FLASH_ATTENTION="false") as hosts:
        yield hosts


def killed_mid_answer(
    client: Client, h2: subprocess.Popen[bytes], prompt: str, **kw: Any
) -> tuple[list[dict[str, Any]], Any]:
    """Submit ``prompt`` (held on h2 after N tokens), read its stream while it is held,
    SIGKILL h2, then read on to the end from the same stream: (every chunk read, the
    result)."""
    assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
    job = client.submit("slow", prompt, **kw)
    assert wait_for(lambda: is_held(client.r, job.id), timeout=60)
    stream = iter(job.stream(cancel_on_close=False))
    streamed = client.r.xlen(keys.job_chunks(job.id))
    chunks = [next(stream).model_dump() for _ in range(streamed)]
    h2.send_signal(signal.SIGKILL)
    h2.wait(10)
    chunks += [chunk.model_dump() for chunk in stream]
    return chunks, job.result(timeout=60)


def one_stream(chunks: list[dict[str, Any]]) -> str:
    """The text of a stream read whole: every seq once, in order, no gap."""
    seqs = [c["seq"] for c in chunks if c["seq"] is not None]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    assert all(TOKENS not in c for c in chunks)  # readers never see the token ids
    return "".join(c["response"] for c in chunks if not c["done"])


def baseline(client: Client, prompt: str, **kw: Any) -> Any:
    """The same job run without a fault (on h1: h2 is gone)."""
    job = client.submit("slow", prompt, **kw)
    release(client.r, job.id)
    return job.result(timeout=60)


def test_a_greedy_job_whose_worker_is_killed_goes_on_elsewhere_token_for_token(
    two_hosts: Hosts,
) -> None:
    st, h2, settings = two_hosts
    prompt = "HOLD@20: the resumed answer"
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        chunks, result = killed_mid_answer(client, h2, prompt, options=GREEDY)
        text = one_stream(chunks)
        assert result.done and result.done_reason == "length"
        assert text == result.response
        assert result.device == "vgpu:h1:0"
        (note,) = result.resumed
        assert note.device == "vgpu:h2:0" and note.chunks >= 1
        assert note.went_on_s is not None and note.went_on_s >= 0
        assert result.eval_count == GREEDY["num_predict"]  # the whole answer counted
        again = baseline(client, prompt, options=GREEDY)
        assert again.response == text  # token for token, as if nothing had happened
        assert not again.resumed


def test_a_stop_string_that_straddles_the_cut_ends_the_answer(two_hosts: Hosts) -> None:
    """The stop string begins in text held back when the worker dies and ends after the
    cut: the resumed run finds it, and nothing of it reaches the reader."""
    st, h2, settings = two_hosts
    prompt = "HOLD@12: a stop across the cut"
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        assert wait_for(lambda: len(client.devices()) == 2, timeout=60)
        whole = baseline(client, prompt, options=GREEDY).response  # on h2, released
        # where its 12th token's text ends
        probe = client.submit("slow", prompt, options=GREEDY)
        assert wait_for(lambda: is_held(client.r, probe.id), timeout=60)
        cut = len(_streamed(client, probe.id))
        release(client.r, probe.id)
        assert probe.result(timeout=60).response == whole
        start = next(i for i in range(cut - 3, 0, -1) if whole.find(whole[i : cut + 3]) == i)
        stop = whole[start : cut + 3]
        options = {**GREEDY, "stop": [stop]}
        chunks, result = killed_mid_answer(client, h2, prompt, options=options)
        text = one_stream(chunks)
        assert result.done_reason == "stop" and result.stop_sequence == stop
        assert text == result.response == whole[:start]
        assert len(result.resumed) == 1


def _streamed(client: Client, job_id: str) -> str:
    entries = client.r.xrange(keys.job_chunks(job_id))
    return "".join(json.loads(f[b"c"]).get("response", "") for _id, f in entries)


def test_a_job_under_a_json_schema_goes_on_with_its_grammar_advanced(two_hosts: Hosts) -> None:
    st, h2, settings = two_hosts
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["n", "tag"],
    }
    prompt = "HOLD@4: some JSON"
    options = {**GREEDY, "num_predict": 200}
    with Client(st.redis_url, settings=settings, timeout=60) as client:
        chunks, result = killed_mid_answer(client, h2, prompt, options=options, format=schema)
        text = one_stream(chunks)
        answer = json.loads(text)
        assert set(answer) == {"n", "tag"} and answer["tag"] in ("red", "green", "blue")
        assert len(result.resumed) == 1
        again = baseline(client, prompt, options=options, format=schema)
        assert again.response == text


# -- the pure parts ------------------------------------------------------------------------


def test_so_far_joins_tokens_and_text_up_to_the_final_chunk() -> None:
    chunks = [
        {"seq": 1, "response": "he", TOKENS: [1]},
        {"seq": 2, "thinking": "hm", TOKENS: [2, 3]},
        {"seq": 3, "response": "llo", TOKENS: []},
        {"seq": 4, "done": True, "response": "hello"},
    ]
    held = SoFar.of(chunks)
    assert held == SoFar((1, 2, 3), "hello", "hm", 3, True)
    older = SoFar.of([{"seq": 1, "response": "he"}])  # an older worker's chunk: no tokens
    assert not older.complete
    holed = SoFar.of([{"seq": 1, "response": "a", TOKENS: [1]}, {"seq": 3, TOKENS: []}])
    assert not holed.complete  # Redis lost chunk 2: nothing to go on from


def test_skip_drops_what_the_stream_holds_across_chunks_and_kinds() -> None:
    skip = Skip(SoFar((1, 2), "hello", "hm", 2))
    assert skip({"response": "he"}) is None
    assert skip({"thinking": "h"}) is None
    assert skip({"response": "llo w"}) == {"response": " w"}
    assert skip({"thinking": "mm"}) == {"thinking": "m"}
    assert skip({"response": "orld"}) == {"response": "orld"}


def test_why_not_resumed_names_the_reason() -> None:
    assert why_not_resumed("chat", False, 0, 2) == ""
    assert why_not_resumed("generate", False, 1, 2) == ""
    assert "GGUFQ_RESUME_MAX=2" in why_not_resumed("generate", False, 2, 2)
    assert "GGUFQ_RESUME_MAX is 0" in why_not_resumed("generate", False, 0, 0)
    assert "logprobs" in why_not_resumed("generate", True, 0, 2)
    assert for_readers({"response": "a", TOKENS: [1]}) == {"response": "a"}


class RecordingSampler:
    """What a job's sampler is told of a replayed answer (the real one: llama.cpp's chain)."""

    top_logprobs = None

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_a_replayed_answer_keeps_a_character_and_a_stop_string_that_straddle_the_cut() -> None:
    """The old run streamed "a"; its token 1 also began the stop string "xé!" and the
    character "é", both held back. The replay holds the same back (the skip drops "a"), and
    the token after the cut finishes the character and meets the stop string."""
    pieces = {1: b"ax\xc3", 2: b"\xa9!"}
    said: list[str] = []
    skip = Skip(SoFar((1,), "a", "", 1))
    sampler = RecordingSampler()
    job = Job(
        tokens=[9, 1],
        budget=10,
        sampler=sampler,  # type: ignore[arg-type]
        on_text=lambda text: said.extend(
            c["response"] for c in [skip({"response": text})] if c is not None
        ),
        cancelled=lambda: False,
        stops=StopMatcher(["xé!"]),
        out=[1],
        forced=1,
        generated=1,
    )
    assert job.replay(lambda token: (pieces[token], False)) is None
    assert sampler.accepted == [1] and said == []  # "a" was streamed: dropped
    text, stopped = job.stops.feed(job.utf8.feed(pieces[2]))  # the token after the cut
    assert (text, stopped, said) == ("", True, [])
    stats = job.finished("stop", 0)
    assert (stats.text, stats.stop_sequence, stats.eval_count) == ("a", "xé!", 1)
    assert stats.prompt_eval_count == 1 and stats.prompt_eval_duration_ns == 0


def test_a_resumed_job_adds_no_timings_of_its_last_run_as_the_jobs() -> None:
    """Its last run's first token and rate are not the job's (the answer so far came from
    the run that stopped): the histograms leave it out."""
    hops = {"admitted": 5.0, "first_token": 6.0}
    final = {"eval_count": 100, "eval_duration": 10**9}
    assert set(job_timings(1.0, hops, final)) == {"queue_wait", "ttft", "tokens_per_s"}
    assert job_timings(1.0, hops, {**final, "resumed": [{"device": "d"}]}) == {}
