"""One job end to end through the real stack: client → placement → worker → llama.cpp."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from celery.result import AsyncResult

from api_client import (
    Client,
    InvalidModelFile,
    InvalidRequest,
    LoadFailed,
    ModelNotFound,
    NoWorkers,
    StackNotRunning,
)
from scheduler.local.embedded import EmbeddedRedis
from scheduler.settings import Settings
from scheduler.store import keys
from tests.conftest import wait_for

GREEDY = {"temperature": 0, "num_predict": 16, "seed": 7}


def test_generate_returns_text_and_ollama_stats(client: Client) -> None:
    result = client.generate("tiny", "Why is the sky blue?", options=GREEDY)
    assert result.done and result.model == "tiny"
    assert result.done_reason in ("stop", "length")
    assert 0 < (result.eval_count or 0) <= 16
    assert result.prompt_eval_count and result.prompt_eval_count > 5
    for name in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(result, name), int) and getattr(result, name) > 0
    assert result.load_duration is not None and result.load_duration >= 0
    assert (result.total_duration or 0) >= (result.eval_duration or 0)
    assert result.device == "cpu:testhost"


def test_greedy_output_is_repeatable(client: Client) -> None:
    first = client.generate("tiny", "The sky is", options=GREEDY).response
    second = client.generate("tiny", "The sky is", options=GREEDY).response
    assert first == second and first


def test_stream_yields_chunks_then_final_and_result_has_whole_text(client: Client) -> None:
    job = client.submit("tiny", "Once upon a time", options=GREEDY)
    chunks = list(job.stream())
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert len(chunks) >= 2  # text (a chunk holds one token or a few), then the final one
    streamed = "".join(c.response for c in chunks[:-1])
    final = job.result()
    assert final.response == streamed
    assert final.eval_count == chunks[-1].eval_count
    # One id end to end: the Celery task, the stream, the final record.
    assert AsyncResult(job.id, app=client.app).state == "SUCCESS"
    assert client.r.exists(keys.job_chunks(job.id))
    assert final.job_id == job.id


def test_generate_stream_true_iterates(client: Client) -> None:
    chunks = list(client.generate("tiny", "hello", stream=True, options=GREEDY))
    assert chunks[-1].done and chunks[-1].eval_count


def test_num_ctx_above_trained_is_lowered_with_a_warning(client: Client) -> None:
    result = client.generate("tiny", "hi", options={**GREEDY, "num_ctx": 100_000})
    assert any("2048" in w for w in result.warnings)


def test_unknown_model_lists_available_names(client: Client) -> None:
    with pytest.raises(ModelNotFound) as info:
        client.generate("llama3", "hi", options=GREEDY)
    assert "'llama3' not found" in str(info.value) and "tiny" in str(info.value)


def test_paths_and_bad_options_are_refused_before_submitting(client: Client) -> None:
    with pytest.raises(InvalidRequest, match="file path"):
        client.submit("../models/tiny", "hi")
    with pytest.raises(InvalidRequest, match=r"options.top_p.*less than or equal to 1"):
        client.submit("tiny", "hi", options={"top_p": 3})
    with pytest.raises(InvalidRequest, match="keep_alive"):
        client.submit("tiny", "hi", keep_alive="sometimes")


def test_bad_files_fail_cleanly_and_the_worker_keeps_serving(client: Client) -> None:
    with pytest.raises(InvalidModelFile, match="notgguf.gguf is not a GGUF file"):
        client.generate("notgguf", "hi", options=GREEDY)
    with pytest.raises(InvalidModelFile, match="truncated.gguf is truncated"):
        client.generate("truncated", "hi", options=GREEDY)
    with pytest.raises(LoadFailed, match="could not load model 'alien'"):
        client.generate("alien", "hi", options=GREEDY)
    # The failed load left no runner and no reservation behind.
    assert not [r for r in client.ps() if r.model == "alien"]
    runner_ids = {r.id.encode() for r in client.ps()}
    for device in client.devices():
        assert set(client.r.hkeys(keys.reservations(device.id))) <= runner_ids
    assert client.generate("tiny", "still there?", options=GREEDY).done


def test_keep_alive_zero_unloads_and_releases_memory(client: Client) -> None:
    client.generate("tiny", "hi", options=GREEDY, keep_alive=0)

    def unloaded() -> bool:
        runners = client.ps()
        held = sum(r.bytes for r in runners)
        reserved = sum(d.reserved for d in client.devices())
        return not [r for r in runners if r.model == "tiny"] and reserved == held

    assert wait_for(unloaded)


def test_empty_prompt_preloads_and_keep_alive_zero_unloads(client: Client) -> None:
    loaded = client.generate("tiny", "", keep_alive=-1)
    assert loaded.done_reason == "load"
    runners = [r for r in client.ps() if r.model == "tiny"]
    assert len(runners) == 1 and runners[0].expires_at == -1
    # A job that omits keep_alive keeps the runner's value (never expire).
    client.generate("tiny", "hi", options=GREEDY)
    assert [r.expires_at for r in client.ps() if r.model == "tiny"] == [-1]
    assert client.generate("tiny", "", keep_alive=0).done_reason == "unload"
    assert wait_for(lambda: not [r for r in client.ps() if r.model == "tiny"])


def test_runner_stays_resident_between_jobs(client: Client) -> None:
    client.generate("tiny", "warm up", options=GREEDY, keep_alive="5m")
    second = client.generate("tiny", "again", options=GREEDY)
    assert second.load_duration == 0
    (runner,) = [r for r in client.ps() if r.model == "tiny"]
    assert runner.state == "ready" and runner.in_flight == 0
    assert 295 < runner.expires_at - time.time() <= 300


def test_a_stream_that_ended_finds_its_slot_free(client: Client) -> None:
    """A job's end is written with its final chunk (lua/end.lua): a reader that sees
    ``done`` finds the runner idle with its expiry, as the demo's `ps` right after its
    stream shows it, never busy with the job just read."""
    client.generate("tiny", "warm up", options=GREEDY, keep_alive="5m")
    for _ in range(5):
        *_, last = client.generate("tiny", "The sky is", options=GREEDY, stream=True)
        assert last.done
        (runner,) = [r for r in client.ps() if r.model == "tiny"]
        assert runner.in_flight == 0 and runner.expires_at > 0, runner
        assert not [j for j in client.jobs() if j.model == "tiny"]


def test_no_worker_is_reported_quickly(session_dir: Path) -> None:
    lonely = EmbeddedRedis(session_dir / "lonely")
    lonely.start()
    try:
        started = time.monotonic()
        with Client(lonely.url, timeout=60) as c, pytest.raises(NoWorkers, match="ggufq up"):
            c.generate("tiny", "hi")
        assert time.monotonic() - started < 5
    finally:
        lonely.stop()


def test_no_stack_and_no_url_says_how_to_start(tmp_path: Path) -> None:
    with pytest.raises(StackNotRunning, match="ggufq up"):
        Client(settings=Settings(redis_url=None, state_dir=tmp_path))


def test_device_registered_with_heartbeat(client: Client, r: redis.Redis) -> None:
    (device,) = [d for d in client.devices() if d.id == "cpu:testhost"]
    assert device.kind == "cpu" and device.worker == "ggufq-cpu@testhost"
    assert device.total > device.reserved >= 0
    beat = device.heartbeat
    assert wait_for(lambda: float(r.hget(keys.device("cpu:testhost"), "heartbeat") or 0) > beat)
    assert client.health()["ok"]


def test_embed_gives_one_normalized_vector_per_input(client: Client) -> None:
    result = client.embed("tiny", ["hello there", "a different text", "hello there"])
    vectors = result.embeddings
    assert len(vectors) == 3 and len(vectors[0]) == 64  # the tiny model's n_embd
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    # the same text gives the same vector (up to float noise of its place in the batch)
    assert max(abs(a - b) for a, b in zip(vectors[0], vectors[2], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(vectors[0], vectors[1], strict=True)) > 1e-2
    assert result.prompt_eval_count and result.prompt_eval_count >= 6
    embedders = [r for r in client.ps() if r.embedding]
    assert [(r.model, r.num_parallel) for r in embedders] == [("tiny", 1)]
    # an input longer than the context is refused unless the job asks to truncate
    long = "word " * 200
    with pytest.raises(InvalidRequest, match="set truncate=True"):
        client.embed("tiny", [long], options={"num_ctx": 64})
    (cut,) = client.embed("tiny", long, options={"num_ctx": 64}, truncate=True).embeddings
    assert len(cut) == 64
    with pytest.raises(InvalidRequest, match="embed job needs input"):
        client.embed("tiny", [])


def test_chat_renders_the_models_own_template(client: Client) -> None:
    from scheduler.chat import render
    from tests.tinymodel import CHAT_TEMPLATE

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the sky is"},
    ]
    prompt = render(CHAT_TEMPLATE, messages)
    assert prompt == "<|system|>be brief\n<|user|>the sky is\n<|assistant|>"
    result = client.chat("tiny", messages, options=GREEDY)
    assert result.message is not None and result.message.role == "assistant"
    assert result.message.content == result.response
    # the same prompt through generate gives the same greedy answer and prompt size
    plain = client.generate("tiny", prompt, options=GREEDY)
    assert (plain.response, plain.prompt_eval_count) == (result.response, result.prompt_eval_count)
    chunks = list(client.chat("tiny", messages, options=GREEDY, stream=True))
    assert "".join(c.response for c in chunks[:-1]) == result.response
    with pytest.raises(InvalidRequest, match="chat job needs messages"):
        client.chat("tiny", [])


def test_a_job_id_belongs_to_the_first_job_submitted_with_it(client: Client) -> None:
    first = client.submit("tiny", "Once", options={"num_predict": 2}, extra={"id": "mine-1"})
    assert first.result().done
    with pytest.raises(InvalidRequest, match="'mine-1' is already taken"):
        client.submit("tiny", "Twice", options={"num_predict": 2}, extra={"id": "mine-1"})


def test_an_id_stays_taken_while_redis_knows_its_job(client: Client) -> None:
    """An id's claim lives the longer of GGUFQ_RESULT_TTL_S and GGUFQ_STREAM_TTL_S, its
    job's custody record as long as the job waits and a while after it ends: an id whose
    claim lapsed before its record is still taken, on the normal path and the fast path
    alike (a client's mistake, not a move the custody table refused), and free once Redis
    forgets the job."""
    first = client.submit("tiny", "Once", options={"num_predict": 2}, extra={"id": "mine-2"})
    assert first.result().done
    client.r.delete(keys.job_submitted("mine-2"))  # as once it lapsed
    again = client.request("tiny", "Twice", options={"num_predict": 2}, extra={"id": "mine-2"})
    with pytest.raises(InvalidRequest, match="'mine-2' is already taken"):
        client.send_to_placement(again)
    with pytest.raises(InvalidRequest, match="'mine-2' is already taken"):
        client.submit("tiny", "Twice", options={"num_predict": 2}, extra={"id": "mine-2"})
    assert not client.r.exists(keys.job_submitted("mine-2"))  # the refusal claimed nothing
    assert not client.r.hexists(keys.CUSTODY_REFUSED, "done -> sent")
    client.r.delete(keys.job_custody("mine-2"), keys.job_chunks("mine-2"))  # as they expired
    client._claim_id(again)
    assert client.r.get(keys.job_submitted("mine-2")) == repr(again.submitted_at).encode()
    client._claim_id(again)  # asked again after a lost reply: still this submission's
    client.r.delete(keys.job_submitted("mine-2"))  # never sent: nothing to keep
