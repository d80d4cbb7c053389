"""A bench column in a process of its own, that fails at once when the process dies.

``multiprocessing.Pool.apply`` waits for ever for a child that dies (a llama.cpp build that
traps on an instruction this CPU lacks, an out-of-memory kill): the pool starts another
worker and the task's result never comes. :func:`in_child` watches the child itself, and
raises :class:`ColumnDied` with the column's name and the signal or exit status.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

T = TypeVar("T")


class ColumnDied(RuntimeError):
    """A column's process ended without its result."""


class ColumnFailed(RuntimeError):
    """A column raised; the message holds its traceback."""


def in_child(column: Callable[..., T], *args: Any) -> T:
    """``column(*args)`` in a new (spawned) process; its result, or its error."""
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    name = getattr(column, "__name__", repr(column))
    child = context.Process(target=_run, args=(writer, column, args), name=f"column-{name}")
    child.start()
    writer.close()  # the child's copy is the only one: its death closes the pipe
    try:
        ok, value = reader.recv()  # EOFError when the child ends without sending
    except EOFError:
        child.join()
        raise ColumnDied(f"column {name!r} died: {_status(child.exitcode)}") from None
    finally:
        reader.close()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()
    if not ok:
        raise ColumnFailed(f"column {name!r} failed:\n{value}")
    return value  # type: ignore[no-any-return]


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _run(writer: Connection, column: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        result = (True, column(*args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        result = (False, traceback.format_exc())
    writer.send(result)
    writer.close()
