"""Streams picked up again (api_client/gateway/resume.py): a client that went away, or whose
gateway was killed, gets the rest of its answer from any gateway with
``GET /v1/stream/{id}``, nothing repeated and nothing missing, on a real stack.

The stack's worker holds a job whose prompt starts with ``HOLD:`` after its first text
(tests/held_worker.py): the gateway is killed while the job is held running, an event the
test controls. The other streams need no hold: what they check holds whether the job is
still running or has ended when its stream is picked up.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_client.gateway.keys import KeyStore
from scheduler.local.embedded import free_port
from scheduler.store import keys
from scheduler.store.acl import Role
from tests.conftest import Held, held_stack, wait_for
from tests.gateway_server import running_gateway
from tests.held_worker import HOLD, release

GREEDY = {"temperature": 0, "seed": 7}


@pytest.fixture(scope="module")
def held(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    with held_stack(models_dir, tmp_path_factory.mktemp("resume"), "resumehost") as stack:
        yield stack


@dataclass
class Event:
    name: str | None  # its SSE id: "<job id>.<seq>"
    data: str

    @property
    def id(self) -> int | None:
        """The seq of the chunk whose last event this is."""
        return None if self.name is None else int(self.name.rpartition(".")[2])


def events(lines: Iterator[str]) -> Iterator[Event]:
    """Server-sent events, as a browser's EventSource reads them (comments skipped)."""
    name: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield Event(name, "\n".join(data))
            name, data = None, []
        elif line.startswith("id:"):
            name = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def content(event: Event) -> str:
    if event.data == "[DONE]":
        return ""
    body = json.loads(event.data)
    choice = body["choices"][0]
    return str(choice.get("delta", {}).get("content") or choice.get("text") or "")


def finish(event: Event) -> str | None:
    if event.data == "[DONE]":
        return None
    reason = json.loads(event.data)["choices"][0].get("finish_reason")
    return str(reason) if reason else None


def picked_up(http: httpx.Client, url: str, name: str, **headers: str) -> list[Event]:
    with http.stream("GET", f"{url}/v1/stream/{name}", headers=headers) as answer:
        assert answer.status_code == 200, answer.read()
        return list(events(answer.iter_lines()))


def test_a_chat_stream_left_by_its_client_is_picked_up_where_it_stopped(held: Held) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me about the sea"}],
        "stream": True,
        "max_tokens": 40,
        **GREEDY,
    }
    with running_gateway(held[1]) as url, httpx.Client(timeout=60) as http:
        seen: list[Event] = []
        opened = http.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers={"X-Conversation-Id": "sea"}
        )
        with opened as answer:
            assert answer.status_code == 200
            assert answer.headers["x-conversation-id"] == "sea"
            job_id = answer.headers["x-ggufq-job"]
            for event in events(answer.iter_lines()):
                seen.append(event)
                if event.id is not None:
                    break  # the client goes away after its first chunk
        last = [e.name for e in seen if e.name is not None][-1]
        assert last is not None and last.startswith(f"{job_id}.")
        rest = picked_up(http, url, "sea", **{"Last-Event-ID": last})
        whole = picked_up(http, url, job_id)  # by the job's id, from the first chunk
        # the name goes on to a newer stream: the old stream's event id is told apart
        http.post(f"{url}/v1/chat/completions", json=body, headers={"X-Conversation-Id": "sea"})
        spliced = http.get(f"{url}/v1/stream/sea", headers={"Last-Event-ID": last})
        assert spliced.status_code == 409 and job_id in spliced.text
        # after the end of a stream that ended: nothing to send, and an EventSource stops
        past = http.get(f"{url}/v1/stream/{job_id}?from={whole[-1].id + 1}")
        assert past.status_code == 204 and not past.content
    ids = [e.id for e in [*seen, *rest] if e.id is not None]
    assert ids == sorted(set(ids)), ids  # none twice, in order
    assert ids == [e.id for e in whole if e.id is not None]  # none missing
    both = [*seen, *rest]
    text = "".join(content(e) for e in both)
    assert text == "".join(content(e) for e in whole) and text
    assert both[-1].data == "[DONE]" and finish(both[-2]) in ("length", "stop")
    assert finish(both[-2]) == finish(whole[-2])  # it ran to its end: not cancelled


def test_an_ollama_stream_is_picked_up_from_a_chunk(held: Held) -> None:
    body = {"model": "tiny", "prompt": "the sky is", "options": {**GREEDY, "num_predict": 12}}
    with running_gateway(held[1]) as url, httpx.Client(timeout=60) as http:
        first: list[dict[str, Any]] = []
        with http.stream(
            "POST", f"{url}/api/generate", json=body, headers={"X-Conversation-Id": "sky"}
        ) as answer:
            for line in answer.iter_lines():
                first.append(json.loads(line))
                if "seq" in first[-1]:
                    break  # the client reads its first chunk, and goes
        after = first[-1]["seq"]
        with http.stream("GET", f"{url}/v1/stream/sky?from={after + 1}") as answer:
            rest = [json.loads(line) for line in answer.iter_lines() if line]
        with http.stream("GET", f"{url}/v1/stream/sky") as answer:
            whole = [json.loads(line) for line in answer.iter_lines() if line]
    seqs = [c["seq"] for c in [*first, *rest] if "seq" in c]
    assert seqs == list(range(1, len(seqs) + 1)) == [c["seq"] for c in whole if "seq" in c]
    text = "".join(c["response"] for c in [*first, *rest])
    assert text == "".join(c["response"] for c in whole) and text
    assert rest[-1]["done"] and whole[-1]["eval_count"] == rest[-1]["eval_count"]


def test_a_stream_outlives_its_gateway_killed_mid_answer(held: Held) -> None:
    """The gateway process serving a held job's stream is SIGKILLed; the job goes on (the
    reader's lease lapses only after GGUFQ_HTTP_READER_LEASE_S), and another gateway
    process serves the rest to the client that comes back with its last event's id."""
    stack, _settings, r = held

    def gateway(name: str) -> tuple[Any, str]:
        port = free_port()
        env = {"GGUFQ_HTTP_PORT": str(port), "GGUFQ_BATCH_DRIVERS": "0"}
        proc = stack.add_process(name, "api_client.gateway", env=env, role=Role.GATEWAY)
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: answers(url), timeout=60), f"{name} did not start"
        return proc, url

    first, url = gateway("gateway-a")
    body = {"model": "tiny", "prompt": f"{HOLD} the story goes", "stream": True}
    body |= {"max_tokens": 16, **GREEDY}
    seen: list[Event] = []
    with httpx.Client(timeout=60) as http:
        with pytest.raises(httpx.HTTPError):  # the connection dies with its gateway
            opened = http.stream(
                "POST", f"{url}/v1/completions", json=body, headers={"X-Conversation-Id": "story"}
            )
            with opened as answer:
                job_id = answer.headers["x-ggufq-job"]
                for event in events(answer.iter_lines()):
                    seen.append(event)
                    if content(event):  # its first text: the job is held running
                        first.send_signal(signal.SIGKILL)
        assert seen and content(seen[-1])
        release(r, job_id)  # the job goes on, with no gateway reading it
        _second, url = gateway("gateway-b")
        rest = picked_up(http, url, "story", **{"Last-Event-ID": str(seen[-1].name)})
        whole = picked_up(http, url, job_id)
    text = "".join(content(e) for e in [*seen, *rest])
    assert text == "".join(content(e) for e in whole)
    assert len([e for e in whole if content(e)]) > 1  # more came after the kill
    assert finish(rest[-2]) in ("length", "stop")


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_stream_nobody_picks_up_is_cancelled_when_its_lease_lapses(held: Held) -> None:
    """The client of a held job leaves at once (before its reader's lease was renewed
    even once) and never comes back: the job is cancelled after the lease, not left to
    run unread. Greedy, on a prompt whose answer runs past the steps its decode loop takes
    while its first text is held (relay.LAG): a sampled answer could end there, done."""
    stack, settings, r = held
    quick = settings.model_copy(update={"http_reader_lease_s": 2.0})
    body = {"model": "tiny", "prompt": f"{HOLD} the story goes", "stream": True}
    body |= {"max_tokens": 16, **GREEDY}
    with running_gateway(quick) as url, httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"X-Conversation-Id": "gone"}
        ) as answer:
            job_id = answer.headers["x-ggufq-job"]
        custody = keys.job_custody(job_id)
        assert wait_for(lambda: r.hget(custody, "state") == b"cancelled", timeout=60)


def test_another_key_cannot_pick_up_a_stream(held: Held) -> None:
    r = held[2]
    _mine, my_token = KeyStore(r).create("stream-owner")
    _other, other_token = KeyStore(r).create("stream-other")
    body = {"model": "tiny", "prompt": "hi", "options": {"num_predict": 2}}
    with running_gateway(held[1], require_keys=True) as url, httpx.Client(timeout=60) as http:
        mine = {"Authorization": f"Bearer {my_token}"}
        made = http.post(
            f"{url}/api/generate", json=body, headers={**mine, "X-Conversation-Id": "private"}
        )
        job_id = made.headers["x-ggufq-job"]
        assert http.get(f"{url}/v1/stream/private", headers=mine).status_code == 200
        theirs = {"Authorization": f"Bearer {other_token}"}
        for name in ("private", job_id):
            assert http.get(f"{url}/v1/stream/{name}", headers=theirs).status_code == 404


def test_unknown_streams_and_bad_positions_get_clear_errors(held: Held) -> None:
    with running_gateway(held[1]) as url, httpx.Client(timeout=30) as http:
        missing = http.get(f"{url}/v1/stream/no-such-conversation")
        assert missing.status_code == 404
        assert "X-Conversation-Id" in missing.text
        body = {"model": "tiny", "prompt": "hi", "options": {"num_predict": 2}}
        http.post(f"{url}/api/generate", json=body, headers={"X-Conversation-Id": "c"})
        bad = http.get(f"{url}/v1/stream/c?from=two")
        assert bad.status_code == 400 and "whole number" in bad.text
        named = http.post(f"{url}/api/generate", json=body, headers={"X-Conversation-Id": "a/b"})
        assert named.status_code == 400 and "X-Conversation-Id" in named.text
