"""The `ggufq` command line, run as a user runs it: in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from api_client import Client
from scheduler.local.embedded import EmbeddedRedis, free_port
from scheduler.local.stack import LocalStack
from tests.conftest import ggufq, stack_env, wait_for
from tests.tinymodel import write_slow_model


@pytest.fixture()
def cli_env(stack: LocalStack, models_dir: Path, session_dir: Path) -> dict[str, str]:
    return {**stack_env(models_dir, session_dir / "state"), "GGUFQ_REDIS_URL": stack.redis_url}


def test_models_lists_metadata_and_unusable_files(cli_env: dict[str, str]) -> None:
    out = ggufq("models", env=cli_env)
    assert out.returncode == 0, out.stderr
    tiny = next(line for line in out.stdout.splitlines() if line.startswith("tiny "))
    assert "llama" in tiny and "F32" in tiny and "2048" in tiny
    assert "unusable" in next(
        line for line in out.stdout.splitlines() if line.startswith("notgguf")
    )
    rows = {row["name"]: row for row in json.loads(ggufq("models", "--json", env=cli_env).stdout)}
    assert rows["tiny"]["architecture"] == "llama" and rows["tiny"]["context_length"] == 2048


def test_config_prints_every_setting(cli_env: dict[str, str]) -> None:
    out = ggufq("config", env=cli_env)
    assert out.returncode == 0
    for name in (
        "GGUFQ_REDIS_URL",
        "GGUFQ_MODELS_DIR",
        "GGUFQ_KEEP_ALIVE_S",
        "GGUFQ_NUM_PARALLEL",
        "GGUFQ_MAX_LOADED_MODELS",
        "GGUFQ_MAX_QUEUE",
        "GGUFQ_LOAD_TIMEOUT_S",
        "GGUFQ_HOST_ID",
    ):
        assert name in out.stdout
    assert "testhost" in out.stdout and "512" in out.stdout


def test_a_setting_ggufq_cannot_use_is_one_clear_line(cli_env: dict[str, str]) -> None:
    env = {**cli_env, "GGUFQ_NUM_PARALLEL": "0", "GGUFQ_HOST_ID": "rack|7"}
    out = ggufq("config", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1
    assert "GGUFQ_NUM_PARALLEL='0'" in out.stderr and "GGUFQ_HOST_ID='rack|7'" in out.stderr


def one_line(out: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The single error line a failed command printed (no traceback)."""
    assert out.returncode == code, out.stderr
    lines = [line for line in out.stderr.splitlines() if "error" in line]
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    return lines[0]


def test_a_redis_that_does_not_answer_is_one_clear_line(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    dead = {**cli_env, "GGUFQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": "a", "prompt": "hi"}\n')
    for args in (
        ["ps"],
        ["run", "tiny", "hi"],
        ["batch", "tiny", str(rows), "-O", str(tmp_path / "o")],
    ):
        line = one_line(ggufq(*args, env=dead))
        assert "cannot reach Redis at 127.0.0.1:" in line, args
        assert "Connection refused" in line and "`ggufq up`" in line and "GGUFQ_REDIS_URL" in line


def test_the_edges_of_the_command_line_are_one_clear_line(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    binary, rows = tmp_path / "in.bin", tmp_path / "in.jsonl"
    binary.write_bytes(bytes(range(256)))
    rows.write_text('{"id": "a", "prompt": "hi"}\n')
    line = one_line(ggufq("batch", "tiny", str(binary), "-O", str(tmp_path / "o"), env=cli_env))
    assert "not UTF-8 text at byte 128" in line
    line = one_line(ggufq("batch", "tiny", str(rows), "-O", str(tmp_path), env=cli_env))
    assert "is a directory; name a file in it" in line
    line = one_line(ggufq("estimate", "tiny", "--gpus", "8XB", env=cli_env), code=2)
    assert "argument --gpus: size '8XB' is not valid" in line
    line = one_line(ggufq("estimate", "tiny", "--ctx", "-5", env=cli_env), code=2)
    assert "argument --ctx: -5 is out of range: 4 to 1,048,576" in line
    line = one_line(ggufq("cancel", "no-such-job", env=cli_env))
    assert "job no-such-job is not known to the cluster" in line
    line = one_line(ggufq("cancel", "x" * 100_000, env=cli_env))
    assert "is not a job id" in line and "(100,002 chars)" in line and len(line) < 400


def test_run_streams_and_ps_devices_list(cli_env: dict[str, str]) -> None:
    out = ggufq(
        "run", "tiny", "hello", "-o", "num_predict=8", "-o", "temperature=0", "--json", env=cli_env
    )
    assert out.returncode == 0, out.stderr
    final = json.loads(out.stdout)
    assert final["done"] and final["eval_count"] <= 8
    ps = ggufq("ps", env=cli_env)
    assert ps.stdout.split()[:9] == [
        "NAME",
        "SIZE",
        "PROCESSOR",
        "DEVICES",
        "CONTEXT",
        "PARALLEL",
        "JOBS",
        "REPLICA",
        "UNTIL",
    ]
    assert "tiny" in ps.stdout and "100% CPU" in ps.stdout
    devices = ggufq("devices", env=cli_env)
    assert "cpu:testhost" in devices.stdout and "ggufq-cpu@testhost" in devices.stdout


def test_run_errors_are_one_clear_line(cli_env: dict[str, str]) -> None:
    out = ggufq("run", "nope", "hi", env=cli_env)
    assert out.returncode == 1
    assert out.stderr.startswith("error: model 'nope' not found; available:")
    assert "Traceback" not in out.stderr
    bad = ggufq("run", "tiny", "hi", "-o", "temperature=99", env=cli_env)
    assert bad.returncode == 1 and "options.temperature" in bad.stderr


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def _up(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """`ggufq up` in a subprocess, killed and reaped whatever the test does."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "api_client.cli", "up"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()


def _wait_up(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ggufq is up"):
            return line
        if not line and proc.poll() is not None:
            break
    pytest.fail(f"ggufq up did not come up (exit {proc.poll()})")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_up_runs_until_signal_and_leaves_no_orphans(
    models_dir: Path, tmp_path: Path, signum: int
) -> None:
    env = stack_env(models_dir, tmp_path / "state", host="uphost")
    env.pop("GGUFQ_REDIS_URL", None)
    with _up({**env, "GGUFQ_REDIS_URL": ""}) as proc:
        up = _wait_up(proc)
        # its private Redis has a password, which is masked wherever it is printed, and
        # the runtime file that holds it is its user's only
        assert ":****@127.0.0.1:" in up
        runtime = tmp_path / "state" / "stack.json"
        assert runtime.stat().st_mode & 0o777 == 0o600
        url = json.loads(runtime.read_text())["redis_url"]
        anonymous = redis.Redis(port=int(url.rsplit(":", 1)[1].split("/")[0]))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        config = ggufq("config", env={**env, "GGUFQ_REDIS_URL": url})
        assert url not in config.stdout and ":****@" in config.stdout
        children = _descendants(proc.pid)
        names = {Path(f"/proc/{c}/cmdline").read_text().replace("\0", " ") for c in children}
        assert any("redis-server" in n for n in names)  # the private Redis
        # Redis and placement give way to the worker's llama.cpp threads (helper_nice 10)
        base = os.getpriority(os.PRIO_PROCESS, proc.pid)
        roles = {"redis-server": 10, "scheduler.placement.process": 10, "workers.main": 0}
        for child in children:
            cmdline = Path(f"/proc/{child}/cmdline").read_text().replace("\0", " ")
            for role, added in roles.items():
                if role in cmdline:
                    assert os.getpriority(os.PRIO_PROCESS, child) == min(19, base + added), role
        run = ggufq("run", "tiny", "hi", "-o", "num_predict=4", env={**env, "GGUFQ_REDIS_URL": ""})
        assert run.returncode == 0, run.stderr
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == 0
        assert not [c for c in children if _alive(c)]
        assert not (tmp_path / "state" / "stack.json").exists()


def test_up_starts_again_a_worker_that_dies(models_dir: Path, tmp_path: Path) -> None:
    """A worker killed by its OS (a job that took all its memory) is started again, and the
    stack serves on instead of stopping."""
    env = {**stack_env(models_dir, tmp_path / "state", host="again"), "GGUFQ_REDIS_URL": ""}
    with _up(env) as proc:
        _wait_up(proc)

        def workers() -> set[int]:
            found = set()
            for child in _descendants(proc.pid):
                try:
                    if "workers.main" in Path(f"/proc/{child}/cmdline").read_text():
                        found.add(child)
                except OSError:
                    continue
            return found

        (first,) = workers()
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: bool(workers() - {first}), timeout=30)
        assert proc.poll() is None  # up goes on
        served = None
        for _ in range(30):  # the new worker takes over its predecessor's devices
            served = ggufq("run", "tiny", "hi", "-o", "num_predict=2", env=env)
            if served.returncode == 0:
                break
            time.sleep(1)
        assert served is not None and served.returncode == 0, served.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_up_with_redis_url_starts_no_redis(models_dir: Path, tmp_path: Path) -> None:
    external = EmbeddedRedis(tmp_path / "external")
    external.start()
    env = {
        **stack_env(models_dir, tmp_path / "state", host="exthost"),
        "GGUFQ_REDIS_URL": external.url,
    }
    try:
        with _up(env) as proc:
            assert external.url in _wait_up(proc)
            names = {Path(f"/proc/{c}/cmdline").read_text() for c in _descendants(proc.pid)}
            assert not any("redis-server" in n for n in names)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    finally:
        external.stop()


def test_estimate_prints_devices_and_json(cli_env: dict[str, str]) -> None:
    out = ggufq("estimate", "tiny", "--ctx", "1000", "--parallel", "2", env=cli_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:7] == [
        "DEVICE",
        "LAYERS",
        "WEIGHTS",
        "KV",
        "CACHE",
        "COMPUTE",
        "OUTPUT",
    ]
    assert "2 layers × 1024 cells × 2 streams" in out.stdout  # pad(2000) / 2
    assert "placement reserves" in out.stdout and "after its first batch" in out.stdout
    data = json.loads(ggufq("estimate", "tiny", "--gpus", "1GiB", "--json", env=cli_env).stdout)
    assert data["n_gpu_layers"] == 3 and [d["device"] for d in data["devices"]] == ["gpu", "host"]
    assert data["total"] == sum(d["total"] for d in data["devices"])
    assert data["reserved_on_one_device"] > data["total"] - data["devices"][0]["compute"]
    bad = ggufq("estimate", "tiny", "--kv-type", "q8_0", "--no-flash-attn", env=cli_env)
    assert bad.returncode == 1 and "flash attention" in bad.stderr


def test_run_without_prompt_chats_over_stdin(cli_env: dict[str, str]) -> None:
    turns = "the sky is\n\nand then\n/bye\nnever sent\n"
    out = subprocess.run(
        [sys.executable, "-m", "api_client.cli", "run", "tiny", "-o", "num_predict=6"]
        + ["-o", "temperature=0", "--verbose"],
        env={**os.environ, **cli_env},
        input=turns,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    counts = [
        int(line.split()[3]) for line in out.stderr.splitlines() if "prompt eval count" in line
    ]
    assert len(counts) == 2  # two turns; the blank line is skipped, /bye ends the chat
    assert counts[1] > counts[0]  # the second turn carries the first question and answer
    assert out.stdout.strip()
    assert ggufq("run", "tiny", "--json", env=cli_env).returncode == 1


def test_listings_have_json(cli_env: dict[str, str]) -> None:
    devices = json.loads(ggufq("devices", "--json", env=cli_env).stdout)
    assert "cpu:testhost" in [d["id"] for d in devices]
    for command in ("ps", "jobs"):  # models --json: test_models_lists_metadata_...
        out = ggufq(command, "--json", env=cli_env)
        assert out.returncode == 0 and isinstance(json.loads(out.stdout), list), out.stderr


def test_commands_other_than_worker_do_not_import_it() -> None:
    probe = (
        "import sys; from api_client.cli import main; main(['config']); "
        "print(sorted(m for m in sys.modules if m.startswith(('workers', 'llama_cpp'))"
        " and m not in ('workers', 'workers.args')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)], ids=["sigterm", "sighup"]
)
@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "chat"])
def test_run_ended_by_sigterm_cancels_its_job_as_ctrl_c_does(
    stack: LocalStack,
    models_dir: Path,
    session_dir: Path,
    client: Client,
    chat: bool,
    signum: int,
    code: int,
) -> None:
    """A `ggufq run` stopped by SIGTERM (a supervisor, `kill`) or SIGHUP (its terminal
    closed) cancels its job and exits 128 + the signal, as Ctrl-C does (130); killed as by
    default, it left the job running to its end, holding the slot."""
    path = write_slow_model(models_dir / "cli-slow.gguf")
    env = {**stack_env(models_dir, session_dir / "state"), "GGUFQ_REDIS_URL": stack.redis_url}
    argv = ["run", "cli-slow", *([] if chat else ["x"]), "-o", "num_predict=100000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "api_client.cli", *argv],
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        if chat:
            proc.stdin.write(b"hello\n")
            proc.stdin.flush()
        assert proc.stdout.read(1)  # the answer streams: its job runs
        assert [j.model for j in client.jobs()] == ["cli-slow"]
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == code and b"Traceback" not in stderr, stderr
        assert wait_for(lambda: client.jobs() == [], timeout=30)  # cancelled, not left running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        path.unlink()
