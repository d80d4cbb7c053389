"""Server-side batches through OpenAI's Batch API, driven by the official `openai` package
(unmodified) on real gateways in front of a real stack; and a batch whose driving gateway
process is SIGKILLed twice, finished by the next ones.

The stack's worker holds a job whose prompt starts with ``HOLD:`` after its first text
until the test releases it (tests/held_worker.py): a batch is still running when a test
cancels it, lets its window pass or kills its driver, because the test holds it so."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from api_client import Client
from api_client.batches import driver, spool
from api_client.batches.handle import BatchHandle
from api_client.batches.lines import read_lines, run_order
from api_client.batches.spool import Spool
from api_client.batches.states import MOVES, BatchState, Mover, sources, tables
from api_client.gateway.keys import KeyStore
from scheduler.errors import Conflict
from scheduler.local.embedded import free_port
from scheduler.placement.metrics import ClusterCollector
from scheduler.store import keys
from scheduler.store.acl import Role
from tests.conftest import Held, held_stack, wait_for
from tests.gateway_server import running_gateway
from tests.held_worker import HOLD, release

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "tiny", "max_tokens": 6, "temperature": 0, "seed": 3}


def line(custom_id: str, prompt: str, url: str = "/v1/completions", **body: Any) -> bytes:
    request = {"custom_id": custom_id, "method": "POST", "url": url}
    return json.dumps({**request, "body": {**BODY, "prompt": prompt, **body}}).encode()


def jsonl(*lines: bytes) -> io.BytesIO:
    return io.BytesIO(b"\n".join(lines) + b"\n")


@pytest.fixture(scope="module")
def held(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    with held_stack(models_dir, tmp_path_factory.mktemp("batches"), "batchhost") as stack:
        yield stack


@pytest.fixture()
def api(held: Held) -> Iterator[openai.OpenAI]:
    with (
        running_gateway(held[1]) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        yield client


def ended(api: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    assert wait_for(lambda: api.batches.retrieve(batch_id).status in ENDED, timeout)
    return api.batches.retrieve(batch_id)


ENDED = {s.value for s in BatchState if s.ended}


def rows(api: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in api.files.content(file_id).text.splitlines() if x]


def release_running(r: redis.Redis, held: set[str], released: set[str]) -> str:
    """Release one of the ``held`` jobs that is running now (waits for one to run)."""
    found: list[str] = []

    def running() -> bool:
        found[:] = [k.decode() for k in r.hkeys(keys.RUNNING) if k.decode() in held - released]
        return bool(found)

    batch_id = next(iter(held)).rsplit("-", 1)[0]
    assert wait_for(running, 60), (
        f"no held line of the batch runs: {sorted(held - released)}; the batch: "
        f"{r.hgetall(keys.batch(batch_id))}, its lease: {r.get(keys.batch_lease(batch_id))}, "
        f"sent: {r.hgetall(keys.batch_sent(batch_id))}, ended: {r.hkeys(keys.batch_out(batch_id))}"
    )
    release(r, found[0])
    released.add(found[0])
    return found[0]


def test_a_batch_runs_on_the_cluster_through_openais_batch_api(api: openai.OpenAI) -> None:
    requests = [line(f"c{i}", f"tell me {i}") for i in range(5)]
    requests.append(
        json.dumps(
            {
                "custom_id": "unknown model",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "nope", "prompt": "x"},
            }
        ).encode()
    )
    upload = api.files.create(file=("in.jsonl", jsonl(*requests)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    batch = api.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert batch.status == "validating" and batch.input_file_id == upload.id
    done = ended(api, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (6, 5)
    assert done.request_counts.failed == 1
    out = rows(api, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(5)]  # input order
    for o in out:
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["text"]
        assert o["response"]["request_id"] == f"{batch.id}-{o['custom_id'][1:]}"
    (failed,) = rows(api, done.error_file_id)
    assert failed["custom_id"] == "unknown model" and failed["response"]["status_code"] == 404
    assert "nope" in failed["response"]["body"]["error"]["message"]
    assert batch.id in [b.id for b in api.batches.list()]
    api.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(upload.id)


def test_a_line_whose_answer_cannot_be_made_ends_with_a_500_not_a_stuck_batch(
    api: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A final record this gateway cannot read (an older worker's, say) fails its line
    with what happened; it does not stop every driver that takes the batch up until the
    window ends. The gateway runs in this process: its driver meets the patched reader."""

    def unreadable(*_args: Any) -> Any:
        raise ValueError("a final record this version cannot read")

    monkeypatch.setattr(driver, "answer_of", unreadable)
    upload = api.files.create(file=("u.jsonl", jsonl(line("u", "hello"))), purpose="batch")
    batch = api.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="1h"
    )
    done = ended(api, batch.id)
    assert done.status == "completed", done
    (failed,) = rows(api, done.error_file_id)
    assert failed["response"]["status_code"] == 500
    assert "cannot read" in failed["response"]["body"]["error"]["message"]


def test_a_batch_with_no_readable_record_is_dropped_not_driven_for_ever(
    api: openai.OpenAI, held: Held
) -> None:
    """An id among the batches not ended whose record is gone (Redis lost it) or not whole:
    the driver that takes it up drops it, instead of failing on it at every look."""
    r = held[2]
    gone, broken = "batch_" + "0" * 24, "batch_" + "1" * 24
    r.hset(keys.batch(broken), mapping={"state": "nonsense", "doc": "{"})
    r.sadd(keys.BATCHES_ACTIVE, gone, broken)
    assert wait_for(lambda: not r.smembers(keys.BATCHES_ACTIVE) & {gone.encode(), broken.encode()})
    r.delete(keys.batch(broken))


def test_a_chat_batch_answers_as_the_endpoint_does(api: openai.OpenAI) -> None:
    url = "/v1/chat/completions"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request = {"custom_id": "a", "url": url, "body": {**BODY, "messages": messages}}
    upload = api.files.create(
        file=("c.jsonl", jsonl(json.dumps(request).encode())), purpose="batch"
    )
    done = ended(
        api, api.batches.create(input_file_id=upload.id, endpoint=url, completion_window="1h").id
    )
    (answer,) = rows(api, done.output_file_id)
    expected = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        seed=3,  # type: ignore[arg-type]
    )
    assert answer["response"]["body"]["object"] == "chat.completion"
    assert (
        answer["response"]["body"]["choices"][0]["message"]["content"]
        == expected.choices[0].message.content
    )


def test_a_malformed_input_fails_the_batch_with_each_lines_error(api: openai.OpenAI) -> None:
    bad = jsonl(
        line("a", "x"),
        b"{not json",
        line("a", "again"),
        line("b", "x", url="/v1/embeddings"),
        json.dumps(
            {"custom_id": "c", "url": "/v1/completions", "body": {"model": "tiny", "top_p": "all"}}
        ).encode(),
    )
    upload = api.files.create(file=("bad.jsonl", bad), purpose="batch")
    done = ended(
        api,
        api.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        ).id,
    )
    assert done.status == "failed"
    assert done.errors is not None and done.errors.data is not None
    found = {(e.line, e.code) for e in done.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_endpoint"),
        (5, "invalid_request"),
    }
    with pytest.raises(openai.BadRequestError, match="not served"):
        api.batches.create(
            input_file_id=upload.id, endpoint="/v1/moderations", completion_window="24h"
        )  # type: ignore[arg-type]


def test_a_cancelled_batch_stops_its_jobs_and_accounts_for_every_line(
    api: openai.OpenAI, held: Held
) -> None:
    upload = api.files.create(
        file=("h.jsonl", jsonl(*(line(f"h{i}", f"{HOLD} {i}") for i in range(3)))), purpose="batch"
    )
    batch = api.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    r = held[2]
    assert wait_for(lambda: any(k.decode().startswith(batch.id) for k in r.hkeys(keys.RUNNING)), 60)
    metrics = {
        (m.name, tuple(sorted(x.labels.items()))): x.value
        for m in ClusterCollector(r, 5).collect()
        for x in m.samples
    }
    assert metrics[("ggufq_batches", (("state", "in_progress"),))] >= 1
    assert metrics[("ggufq_batch_lines", (("count", "total"),))] >= 3
    assert api.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = ended(api, batch.id)
    assert done.status == "cancelled"
    assert sorted(e["custom_id"] for e in rows(api, done.error_file_id)) == ["h0", "h1", "h2"]
    assert wait_for(lambda: not any(k.decode().startswith(batch.id) for k in r.hkeys(keys.RUNNING)))
    with pytest.raises(openai.ConflictError):
        api.batches.cancel(
            ended(
                api,
                api.batches.create(
                    input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
                ).id,
            ).id
        )


def test_lines_not_done_within_the_window_expire_into_the_error_file(
    api: openai.OpenAI, held: Held
) -> None:
    upload = api.files.create(
        file=("w.jsonl", jsonl(line("quick", "hello"), line("slow", f"{HOLD} slow"))),
        purpose="batch",
    )
    batch = api.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="3s"
    )
    done = ended(api, batch.id)
    assert done.status == "expired"
    errors = {e["custom_id"]: e for e in rows(api, done.error_file_id)}
    assert "slow" in errors and errors["slow"]["error"]["code"] == "batch_expired"
    outputs = [o["custom_id"] for o in rows(api, done.output_file_id)]
    assert sorted([*errors, *outputs]) == ["quick", "slow"]


def test_a_batch_goes_on_after_the_process_driving_it_is_killed_twice(held: Held) -> None:
    """Two gateway processes drive batches (leases of 2 s); the test's own gateway only
    takes requests. The one driving the batch is SIGKILLed while lines are held running,
    then the next one too after half the lines; a third finishes it: each custom_id is
    answered once, by the job first sent for it."""
    stack, settings, r = held
    drivers = []

    def start_driver(name: str) -> int:
        env = {"GGUFQ_HTTP_PORT": str(free_port()), "GGUFQ_BATCH_LEASE_S": "2"}
        proc = stack.add_process(name, "api_client.gateway", env=env, role=Role.GATEWAY)
        drivers.append(proc)
        return proc.pid

    pids = {start_driver("batch-a"), start_driver("batch-b")}
    quiet = settings.model_copy(update={"batch_drivers": 0})
    requests = [line(f"q{i}", f"quick {i}") for i in range(4)]
    requests += [line(f"h{i}", f"{HOLD} {i}") for i in range(6)]
    with (
        running_gateway(quiet) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as api,
    ):
        upload = api.files.create(file=("k.jsonl", jsonl(*requests)), purpose="batch")
        batch = api.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        lease = keys.batch_lease(batch.id)

        def holder() -> int | None:
            value = r.get(lease)
            return int(value.decode().split(":")[1]) if value else None

        held_jobs = {f"{batch.id}-{i}" for i in range(4, 10)}  # lines h0 ... h5
        released: set[str] = set()
        release_running(r, held_jobs, released)  # a held line runs: the batch is under way
        first = holder()
        assert first in pids
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: holder() not in (None, first), 30)
        second = holder()
        for _ in range(3):
            release_running(r, held_jobs, released)
        os.kill(second, signal.SIGKILL)  # type: ignore[arg-type]
        third = start_driver("batch-c")
        assert wait_for(lambda: holder() == third, 30)
        while released != held_jobs:
            release_running(r, held_jobs, released)
        done = ended(api, batch.id)
        assert done.status == "completed", done
        answers = rows(api, done.output_file_id)
    assert sorted(a["custom_id"] for a in answers) == sorted(x.decode() for x in ids(requests))
    assert all(a["response"]["status_code"] == 200 for a in answers)
    assert done.error_file_id is None
    # each line answered by the one job sent for it, whichever process waited for it
    assert {a["response"]["request_id"] for a in answers} == {f"{batch.id}-{i}" for i in range(10)}
    assert done.request_counts is not None and done.request_counts.completed == 10


def ids(requests: list[bytes]) -> list[bytes]:
    return [json.loads(x)["custom_id"].encode() for x in requests]


def test_a_key_sees_its_own_files_and_batches_and_its_models_only(held: Held) -> None:
    r = held[2]
    mine, my_token = KeyStore(r).create("batch-owner", models=["tiny"])
    _other, other_token = KeyStore(r).create("batch-other")
    with running_gateway(held[1], require_keys=True) as url:
        with (
            openai.OpenAI(base_url=f"{url}/v1", api_key=my_token, max_retries=0) as api,
            openai.OpenAI(base_url=f"{url}/v1", api_key=other_token, max_retries=0) as other,
        ):
            upload = api.files.create(file=("k.jsonl", jsonl(line("a", "hi"))), purpose="batch")
            batch = api.batches.create(
                input_file_id=upload.id, endpoint="/v1/completions", completion_window="1h"
            )
            with pytest.raises(openai.NotFoundError):
                other.files.retrieve(upload.id)
            with pytest.raises(openai.NotFoundError):
                other.batches.retrieve(batch.id)
            assert batch.id not in [b.id for b in other.batches.list()]
            with pytest.raises(openai.NotFoundError):  # another key's file: not there for it
                other.batches.create(
                    input_file_id=upload.id, endpoint="/v1/completions", completion_window="1h"
                )
            elsewhere = api.files.create(
                file=("m.jsonl", jsonl(line("b", "hi", model="gemma3-270m"))), purpose="batch"
            )
            with pytest.raises(openai.PermissionDeniedError, match="may not use"):
                api.batches.create(
                    input_file_id=elsewhere.id,
                    endpoint="/v1/completions",
                    completion_window="1h",
                )
            assert ended(api, batch.id).status == "completed"
    KeyStore(r).revoke(mine.id)
    KeyStore(r).revoke(_other.id)


def test_python_and_the_cli_start_watch_and_read_a_batch(held: Held, tmp_path: Path) -> None:
    stack, settings, r = held
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(*(line(f"p{i}", f"say {i}") for i in range(3))).getvalue())
    seen: list[str] = []
    env = {
        **os.environ,
        "GGUFQ_REDIS_URL": stack.redis_url,
        "GGUFQ_DATA_DIR": str(settings.data_dir),
    }

    def ggufq(*argv: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "api_client.cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    with running_gateway(settings), Client(stack.redis_url, settings=settings) as client:
        handle = client.submit_batch(path)  # its endpoint: the first line's url
        final = handle.wait(timeout=60, on_progress=lambda b: seen.append(b["status"]))
        assert final["status"] == "completed" and final["request_counts"]["completed"] == 3
        assert seen[-1] == "completed" and len(seen) >= 2
        assert [x["custom_id"] for x in handle.results()] == ["p0", "p1", "p2"]
        assert handle.id in ggufq("batches") and "3/3" in ggufq("batches")
        assert json.loads(ggufq("batches", "status", handle.id))["status"] == "completed"
        results = [json.loads(x) for x in ggufq("batches", "results", handle.id).splitlines()]
        assert results == handle.results()
        with pytest.raises(Conflict):
            handle.cancel()
        batch_id = ggufq("batches", "submit", str(path)).strip()
        done = BatchHandle(client, batch_id).wait(timeout=60)
        assert done["request_counts"]["completed"] == 3


def test_bad_uploads_ids_and_deletes_get_clear_answers(api: openai.OpenAI, held: Held) -> None:
    base = str(api.base_url).rstrip("/")
    no_file = httpx.post(f"{base}/files", files={"purpose": (None, "batch")})
    assert no_file.status_code == 400 and "'file'" in no_file.json()["error"]["message"]
    broken = httpx.post(
        f"{base}/files",
        content=b"--x\r\nnot a part",
        headers={"Content-Type": "multipart/form-data; boundary=x"},
    )
    assert broken.status_code == 400
    as_json = httpx.post(f"{base}/files", json={"file": "x"})
    assert as_json.status_code == 415 and "multipart/form-data" in as_json.text
    for wrong in ("batch_nope", "batch_0123:sent", "../x"):
        assert httpx.get(f"{base}/batches/{wrong}").status_code == 404
    assert httpx.get(f"{base}/files/file-../../etc").status_code == 404
    upload = api.files.create(file=("d.jsonl", jsonl(line("d", f"{HOLD} d"))), purpose="batch")
    batch = api.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="1h"
    )
    with pytest.raises(openai.ConflictError, match="not ended"):
        api.files.delete(upload.id)
    api.batches.cancel(batch.id)
    assert ended(api, batch.id).status == "cancelled"
    assert api.files.delete(upload.id).deleted


def test_a_spool_keeps_answers_on_disk_and_redis_only_their_place(tmp_path: Path) -> None:
    kept = Spool(tmp_path, "batch_x", "a")
    places = [kept.append(b"first"), kept.append(b"second answer")]
    kept.close()
    assert [spool.read(tmp_path, p) for p in places] == [b"first", b"second answer"]
    assert all(len(p) < 40 for p in places)
    assert spool.read(tmp_path, "batch_x.b:0:5") is None  # another host's file: lost
    assert spool.read(tmp_path, "../etc:0:5") is None
    assert spool.remove(tmp_path, "batch_x") == 1 and spool.read(tmp_path, places[0]) is None


def test_lines_are_checked_up_front_and_ordered_by_shared_prefix() -> None:
    system = {"role": "system", "content": "You sort things. " * 20}
    chats = [
        {
            "custom_id": f"{n}",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": s},
                    {"role": "user", "content": f"item {n}"},
                ],
            },
        }
        for n, s in enumerate(["other", system["content"], "other", system["content"]])
    ]
    data = b"\n\n".join(json.dumps(c).encode() for c in chats)
    lines, errors = read_lines(data, "/v1/chat/completions", 100)
    assert errors == [] and [x.index for x in lines] == [0, 1, 2, 3]
    assert [x.custom_id for x in run_order(lines)] == ["1", "3", "0", "2"]
    _, errors = read_lines(data, "/v1/chat/completions", 2)
    assert [e.code for e in errors] == ["too_many_lines"]
    _, errors = read_lines(b"\n", "/v1/completions", 2)
    assert [e.code for e in errors] == ["empty_file"]


def test_each_batch_move_is_in_the_table_and_readme_prints_it() -> None:
    assert sources(BatchState.CANCELLING, Mover.CALLER) == [
        BatchState.VALIDATING,
        BatchState.IN_PROGRESS,
    ]
    assert all(not m.source.ended for m in MOVES)
    assert tables() in (ROOT / "README.md").read_text()
