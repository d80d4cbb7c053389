"""How many threads llama.cpp computes with on the CPU.

One token per step (a lone sequence) reads every weight for little arithmetic: a thread per
physical core is best, a second thread on a core's SMT sibling only adds contention. Batches
are arithmetic: they take every CPU the process may use. llama-cpp-python's defaults (half of
``os.cpu_count()`` for one token) assume two SMT threads per core, which left one of two
cores idle for single-token steps on a machine without SMT, and ``os.cpu_count()`` counts
the host's CPUs even where a container or ``taskset`` allows fewer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path


def thread_counts(cpus: Iterable[int], core_of: Callable[[int], str]) -> tuple[int, int]:
    """(threads for one token, threads for a batch) given the usable ``cpus`` and a function
    naming each CPU's physical core (SMT siblings share one name)."""
    usable = set(cpus)
    physical = {core_of(cpu) for cpu in usable}
    return max(len(physical), 1), max(len(usable), 1)


def _core_of(cpu: int) -> str:
    """The CPUs of ``cpu``'s core as Linux lists them; the CPU alone where sysfs is silent."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            return (topology / name).read_text().strip()
        except OSError:
            continue
    return str(cpu)


def default_thread_counts() -> tuple[int, int]:
    """:func:`thread_counts` for this process's CPU affinity."""
    try:
        cpus: Iterable[int] = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # no affinity API (not Linux)
        cpus = range(os.cpu_count() or 1)
    return thread_counts(cpus, _core_of)
