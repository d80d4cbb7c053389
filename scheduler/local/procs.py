"""Child processes that die with their parent: no orphans, even if the parent is SIGKILLed."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Run in the child between fork and exec: SIGTERM it when the parent dies (Linux)."""
    os.setpgrp()  # Ctrl-C in the terminal reaches the parent only; it stops children in order
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def niced_child_preexec(nice: int) -> Callable[[], None]:
    """:func:`child_preexec`, then lower the child's CPU priority by ``nice`` (0: unchanged)."""

    def preexec() -> None:
        child_preexec()
        if nice > 0:
            os.nice(nice)

    return preexec


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux keeps one per thread).

    llama.cpp's CPU threads wait for each other at a spinning barrier after every graph
    node: a helper that wakes on a core they use stalls both, so helpers yield to them.
    """
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError):
        pass
