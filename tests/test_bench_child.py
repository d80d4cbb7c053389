"""The benches' columns run in processes of their own (bench/child.py): a column's result
comes back, its error comes back as text, and a process that dies fails at once with the
column and the signal, where multiprocessing's Pool.apply waited for ever."""

from __future__ import annotations

import os
import signal

import pytest

from bench.child import ColumnDied, ColumnFailed, in_child


def double(x: int) -> int:
    return 2 * x


def killed(sig: int) -> None:
    os.kill(os.getpid(), sig)


def exits(status: int) -> None:
    os._exit(status)


def raises() -> None:
    raise ValueError("no such model")


def test_a_column_gives_its_result() -> None:
    assert in_child(double, 21) == 42


def test_a_column_killed_by_a_signal_fails_at_once_naming_it() -> None:
    with pytest.raises(ColumnDied, match=r"column 'killed' died: killed by SIGKILL"):
        in_child(killed, signal.SIGKILL)
    with pytest.raises(ColumnDied, match=r"column 'exits' died: exit status 3"):
        in_child(exits, 3)


def test_a_column_that_raises_says_what() -> None:
    with pytest.raises(ColumnFailed, match=r"(?s)column 'raises' failed:.*ValueError: no such"):
        in_child(raises)
