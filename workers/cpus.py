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
from types import ModuleType
from typing import Any


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


def extra_buffers_safe(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether llama.cpp may repack weights into its extra CPU buffer types.

    Not where the CPU has AMX: llama.cpp's AMX matrix multiply crashes the process on the
    first token of Q4_K_M models on such CPUs (ggml-org/llama.cpp#20824, still open; seen
    on this project's Sapphire Rapids CI machines). Without extra buffers those weights stay
    in the plain CPU buffer, which every CPU computes correctly.
    """
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return True
    return " amx_int8" not in flags and " amx_tile" not in flags


def guard_extra_buffers(*modules: ModuleType) -> None:
    """Make every model this process loads through ``modules`` (llama_cpp and its low-level
    module: llama-cpp-python's ``Llama`` reads the defaults from the latter) skip the extra
    CPU buffers where :func:`extra_buffers_safe` says they crash."""
    if extra_buffers_safe():
        return
    for module in modules:
        original = module.llama_model_default_params
        if getattr(original, "guarded", False):
            continue

        def defaults(original: Callable[[], Any] = original) -> Any:
            params = original()
            params.use_extra_bufts = False
            return params

        defaults.guarded = True  # type: ignore[attr-defined]
        setattr(module, "llama_model_default_params", defaults)  # noqa: B010


def llama() -> ModuleType:
    """llama_cpp, imported on first use (it is heavy), with :func:`guard_extra_buffers`."""
    import llama_cpp
    import llama_cpp.llama_cpp as low_level

    guard_extra_buffers(llama_cpp, low_level)
    return llama_cpp
