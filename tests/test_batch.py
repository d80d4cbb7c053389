"""Batches on the real stack: bounded in flight, rows in input order, errors in their rows,
interrupted (Ctrl-C) and resumed to exactly one row per input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from celery import states

import api_client.batch as batch_module
from api_client import (
    BatchSummary,
    Client,
    InvalidRequest,
    Job,
    JobFailed,
    JobTimeout,
    ModelNotFound,
    NoWorkers,
    ServerBusy,
)
from api_client.batch import BatchStopped, is_transient
from api_client.batch_files import read_rows
from scheduler.local.stack import LocalStack
from tests.conftest import ggufq, stack_env, wait_for

GREEDY = {"temperature": 0, "num_predict": 4, "seed": 3}


@pytest.fixture()
def cli_env(stack: LocalStack, models_dir: Path, session_dir: Path) -> dict[str, str]:
    return {**stack_env(models_dir, session_dir / "state"), "GGUFQ_REDIS_URL": stack.redis_url}


def output_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.parametrize(
    ("signum", "code"),
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
    ids=["ctrl-c", "sigterm", "sighup"],
)
def test_cli_batch_interrupted_by_ctrl_c_then_resumed(
    cli_env: dict[str, str], client: Client, tmp_path: Path, signum: int, code: int
) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Item {i}:"}) + "\n" for i in range(300)))
    argv = ["batch", "tiny", str(source), "-O", str(out), "-o", "num_predict=4"]
    argv += ["-o", "temperature=0", "--concurrency", "8"]
    # held open at 40 rows until its Ctrl-C: 300 short rows can finish between two looks
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.held_cli", "40", *argv],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, **cli_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_for(lambda: complete_lines(out) >= 40 or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, stderr
    assert "--resume" in stderr and "Traceback" not in stderr
    first = output_rows(out)  # every line whole: a valid file to resume from
    assert 40 <= len(first) < 300
    assert [r["id"] for r in first] == [str(i) for i in range(len(first))]
    # the jobs that were in flight were cancelled, none keeps running
    assert wait_for(lambda: client.jobs() == [], 60)

    resumed = ggufq(*argv, "--resume", env=cli_env)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{300 - len(first)} done, 0 failed, {len(first)} skipped" in resumed.stdout
    rows = output_rows(out)
    assert [r["id"] for r in rows] == [str(i) for i in range(300)]
    assert rows[: len(first)] == first
    for i, row in enumerate(rows):
        assert row["input"] == f"Item {i}:" and row["error"] is None
        assert 0 < row["stats"]["eval_count"] <= 4 and row["stats"]["done_reason"]


def test_rows_fail_alone_chat_and_per_row_options(client: Client) -> None:
    chat = [{"role": "user", "content": "the sky is"}]
    rows: list[Any] = [
        {"id": "plain", "prompt": "The sky is"},
        {"id": "bad", "prompt": "x", "options": {"temperature": 99}},
        {"id": "chat", "messages": chat},
        {"id": "short", "prompt": "Once upon", "options": {"num_predict": 1}},
        {"id": 70, "prompt": "a number as id"},
        {"prompt": "no id: its index"},
        {"id": "neither"},
        "a bare prompt",
    ]
    summary = client.batch("tiny", rows, options=GREEDY, concurrency=3)
    out = {str(r["id"]): r for r in summary.rows}
    ids = ["plain", "bad", "chat", "short", 70, "5", "neither", "7"]
    assert [r["id"] for r in summary.rows] == ids
    assert (summary.total, summary.done, summary.failed, summary.skipped) == (8, 6, 2, 0)
    assert out["bad"]["error"]["code"] == "invalid_request"
    assert "options.temperature" in out["bad"]["error"]["message"]
    assert out["bad"]["response"] is None and out["bad"]["stats"] is None
    assert "exactly one of" in out["neither"]["error"]["message"]
    assert (
        out["plain"]["response"] == client.generate("tiny", "The sky is", options=GREEDY).response
    )
    answer = client.chat("tiny", chat, options=GREEDY)
    assert out["chat"]["input"] == chat and out["chat"]["response"] == answer.response
    assert out["short"]["stats"]["eval_count"] == 1
    assert summary.tokens == sum(r["stats"]["eval_count"] for r in summary.rows if r["stats"])
    assert summary.tokens_per_s > 0


def test_interrupted_in_python_then_resumed(client: Client, tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    prompts = [f"Question {i}?" for i in range(30)]

    def stop_after_five(summary: BatchSummary) -> None:
        if summary.done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        client.batch("tiny", prompts, output=out, options=GREEDY, on_progress=stop_after_five)
    assert [r["id"] for r in output_rows(out)] == ["0", "1", "2", "3", "4"]
    assert wait_for(lambda: client.jobs() == [], 60)
    with out.open("a") as f:
        f.write('{"id": "5", "inp')  # a row torn by a kill mid-write is not a row

    seen: list[int] = []
    summary = client.batch(
        "tiny",
        prompts,
        output=out,
        options=GREEDY,
        resume=True,
        on_progress=lambda s: seen.append(s.finished),
    )
    assert (summary.done, summary.failed, summary.skipped) == (25, 0, 5)
    assert seen == list(range(5, 31))  # once before the first job, then after each row
    rows = output_rows(out)
    assert [r["id"] for r in rows] == [str(i) for i in range(30)]
    assert [r["input"] for r in rows] == prompts


def test_at_most_concurrency_jobs_in_flight(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    submitted: list[Job] = []
    unfinished_at_submit: list[int] = []
    submit = client.submit

    def counting_submit(*args: Any, **kwargs: Any) -> Job:
        unfinished = [j for j in submitted if j.status() not in states.READY_STATES]
        unfinished_at_submit.append(len(unfinished))
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(client, "submit", counting_submit)
    options = {**GREEDY, "num_predict": 24}
    summary = client.batch("tiny", [f"n{i}" for i in range(12)], options=options, concurrency=3)
    assert summary.done == 12 and len(unfinished_at_submit) == 12
    assert max(unfinished_at_submit) <= 2  # a job is submitted only when fewer than 3 are out


def test_transient_failures_are_retried_then_reported(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_module, "RETRY_BACKOFF_S", 0.01)
    calls: dict[str, int] = {}
    submit = client.submit

    def flaky_submit(model: str, prompt: str = "", **kwargs: Any) -> Any:
        calls[prompt] = calls.get(prompt, 0) + 1
        if prompt == "busy once" and calls[prompt] == 1:
            raise ServerBusy("max_queue 1 reached; try again later")
        if prompt == "no workers":
            raise NoWorkers("no ggufq worker is running")
        return submit(model, prompt, **kwargs)

    monkeypatch.setattr(client, "submit", flaky_submit)
    prompts = ["busy once", "no workers", "fine"]
    summary = client.batch("tiny", prompts, options=GREEDY, retries=2)
    busy, down, fine = summary.rows
    assert busy["error"] is None and calls["busy once"] == 2
    assert down["error"]["code"] == "no_workers" and calls["no workers"] == 3
    assert fine["error"] is None and calls["fine"] == 1


def test_which_errors_are_transient() -> None:
    lost = "job x was lost: worker w (cpu:h) stopped heartbeating while it held the job"
    assert is_transient(JobFailed(lost)) and is_transient(JobTimeout("no progress"))
    assert not is_transient(JobFailed("job x failed on cpu:h: boom"))
    assert not is_transient(InvalidRequest("invalid request: options.top_p"))


def test_input_problems_are_refused_before_any_job(client: Client, tmp_path: Path) -> None:
    rows = [{"id": "a", "prompt": "1"}, {"id": "b", "prompt": "2"}, {"id": "a", "prompt": "3"}]
    out = tmp_path / "never.jsonl"
    with pytest.raises(InvalidRequest, match=r"duplicate ids in the batch: 'a' at rows \[0, 2\]"):
        client.batch("tiny", rows, output=out)
    assert not out.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": oops}\n')
    with pytest.raises(InvalidRequest, match=r"bad.jsonl:3: not JSON"):
        read_rows(bad)
    with pytest.raises(InvalidRequest, match="cannot read the batch input"):
        read_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ModelNotFound, match="'nope' not found"):
        client.batch("nope", ["a", "b"], options=GREEDY)


def test_cli_batch_reports_failed_rows(cli_env: dict[str, str], tmp_path: Path) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"id": "q1", "prompt": "Hello"},
        {"id": "q2", "prompt": "Hi", "options": {"top_p": 3}},
        {"id": "q3", "messages": [{"role": "user", "content": "hey"}]},
    ]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    done = ggufq(
        "batch", "tiny", str(source), "-O", str(out), "-o", "num_predict=3", "--json", env=cli_env
    )
    assert done.returncode == 1
    assert "1 of 3 rows failed, the first with: invalid request: options.top_p" in done.stderr
    assert f"all their errors are in {out}" in done.stderr
    summary = json.loads(done.stdout)
    assert (summary["done"], summary["failed"], summary["output"]) == (2, 1, str(out))
    assert [r["id"] for r in output_rows(out)] == ["q1", "q2", "q3"]


def test_a_batch_stopped_before_it_starts_leaves_its_output_as_it_was(
    client: Client, tmp_path: Path
) -> None:
    # Ctrl-C while the CLI is still starting only sets the stop flag: the rows of an
    # earlier run (the user forgot --resume) must not be truncated by opening the file
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "0"}\n')
    stop = threading.Event()
    stop.set()
    with pytest.raises(BatchStopped):
        client.batch("tiny", [{"prompt": "x"}], output=out, stop=stop)
    assert out.read_text() == '{"id": "0"}\n'
