"""Every Python example and `ggufq` listing or run command in README.md runs on the stack."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.local.stack import LocalStack
from tests.conftest import needs_demo, stack_env

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def cli_commands() -> list[str]:
    commands = []
    for block in blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if command.startswith("ggufq ") and command.split()[1] in {
                "run",
                "ps",
                "devices",
                "config",
                "models",
                "estimate",
            }:
                commands.append(command)
    return commands


@pytest.fixture()
def env(stack: LocalStack, models_dir: Path, session_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        **stack_env(models_dir, session_dir / "state"),
        "GGUFQ_REDIS_URL": stack.redis_url,
    }


def test_readme_has_examples() -> None:
    assert len(blocks("python")) >= 2
    assert len(cli_commands()) >= 6


@needs_demo
@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_example_runs(index: int, env: dict[str, str]) -> None:
    code = blocks("python")[index]
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=170
    )
    assert out.returncode == 0, f"example {index} failed:\n{code}\n{out.stderr}"
    assert out.stdout.strip()


@needs_demo
@pytest.mark.parametrize("command", cli_commands())
def test_cli_example_runs(command: str, env: dict[str, str]) -> None:
    argv = shlex.split(command)
    out = subprocess.run(
        [sys.executable, "-m", "api_client.cli", *argv[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, f"{command}:\n{out.stderr}"
    assert out.stdout.strip()


def test_ci_runs_the_readme_test_command() -> None:
    command = (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[dev,demo]' "
        "&& .venv/bin/python -m pytest"
    )
    assert command in README.read_text()
    assert command in (README.parent / ".ci" / "run").read_text()
