"""Child processes that die with their parent: no orphans, even if the parent is SIGKILLed."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Run in the child between fork and exec: SIGTERM it when the parent dies (Linux)."""
    os.setpgrp()  # Ctrl-C in the terminal reaches the parent only; it stops children in order
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
