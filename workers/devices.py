"""The devices a worker owns: NVIDIA GPUs (pynvml), virtual GPUs, or the host CPU.

No NVML library, no driver, no GPU: all normal; the worker then serves from the CPU.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from scheduler.cluster import DeviceInfo

log = logging.getLogger(__name__)


def system_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory, from /proc/meminfo."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                name, rest = line.split(":", 1)
                values[name] = int(rest.split()[0]) * 1024
    except OSError:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages
    total = values.get("MemTotal", 0)
    return total, values.get("MemAvailable", total)


def nvidia_gpus(host: str, worker: str) -> list[DeviceInfo]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no library, no driver: a CPU-only machine
        log.info("no NVIDIA GPUs (%s)", exc)
        return []
    devices = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        devices.append(
            DeviceInfo(
                id=f"gpu:{host}:{index}",
                host=host,
                worker=worker,
                name=name.decode() if isinstance(name, bytes) else name,
                kind="gpu",
                total=int(mem.total),
                free=int(mem.free),
                virtual=False,
                uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
            )
        )
    return devices


def nvidia_free(devices: list[DeviceInfo]) -> dict[str, int]:
    import pynvml

    free = {}
    for dev in devices:
        index = int(dev.id.rsplit(":", 1)[1])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        free[dev.id] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    return free


def virtual_gpus(host: str, worker: str, sizes: list[int]) -> list[DeviceInfo]:
    return [
        DeviceInfo(
            id=f"vgpu:{host}:{i}",
            host=host,
            worker=worker,
            name=f"virtual GPU {i} ({size / 2**30:.1f} GiB, compute on CPU)",
            kind="vgpu",
            total=size,
            free=size,
            virtual=True,
        )
        for i, size in enumerate(sizes)
    ]


def cpu_device(host: str, worker: str) -> DeviceInfo:
    total, available = system_memory()
    return DeviceInfo(
        id=f"cpu:{host}",
        host=host,
        worker=worker,
        name=f"CPU ({os.cpu_count()} cores)",
        kind="cpu",
        total=total,
        free=available,
        virtual=False,
    )


def detect_devices(
    host: str, worker: str, virtual_sizes: list[int], use_gpus: bool = True
) -> list[DeviceInfo]:
    """Virtual GPUs when asked for, else the NVIDIA GPUs, else the CPU."""
    if virtual_sizes:
        return virtual_gpus(host, worker, virtual_sizes)
    gpus = nvidia_gpus(host, worker) if use_gpus else []
    return gpus or [cpu_device(host, worker)]


def reported_free(devices: list[DeviceInfo]) -> dict[str, int]:
    """Free memory as the hardware reports it now (virtual GPUs report their size)."""
    free = {d.id: d.total for d in devices if d.kind == "vgpu"}
    gpus = [d for d in devices if d.kind == "gpu"]
    if gpus:
        free.update(nvidia_free(gpus))
    for dev in devices:
        if dev.kind == "cpu":
            free[dev.id] = system_memory()[1]
    return free


def tensor_split(device_ids: list[str], blocks: list[int]) -> list[float] | None:
    """llama.cpp's tensor_split for a runner placed over several NVIDIA GPUs: per CUDA
    index, the share of layers placement gave that GPU (blocks in order; the output layer
    goes with the last). None for a runner on one device, or on virtual GPUs / the CPU,
    where llama.cpp computes on the host anyway.

    CUDA indices match NVML's because workers set CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    if len(device_ids) < 2 or len(blocks) != len(device_ids):
        return None
    if not all(d.startswith("gpu:") for d in device_ids):
        return None
    indices = [int(d.rsplit(":", 1)[1]) for d in device_ids]
    shares = [0.0] * (max(indices) + 1)
    for i, (index, n) in enumerate(zip(indices, blocks, strict=True)):
        shares[index] = float(n + (1 if i == len(blocks) - 1 else 0))
    return shares


def close_and_wait(
    close: Callable[[], None], gpus: list[DeviceInfo], reserved: dict[str, int], wait_s: float
) -> bool:
    """``close()`` a runner; on NVIDIA GPUs wait up to ``wait_s`` until the driver shows the
    memory it held there (``reserved``) free again. False when it did not in time."""
    held = {d: n for d, n in reserved.items() if d in {g.id for g in gpus}}
    before = reported_free(gpus) if held else {}
    close()
    return wait_for_release(lambda: reported_free(gpus), before, held, wait_s)


def wait_for_release(
    read_free: Callable[[], dict[str, int]],
    before: dict[str, int],
    held: dict[str, int],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    fraction: float = 0.75,
) -> bool:
    """After an unload, wait until the driver reports most of the memory back.

    Drivers report freed GPU memory late; placing into it at once would over-commit. Waits
    until each GPU in ``held`` (bytes the runner held there) shows ``fraction`` of them
    back over ``before`` (free before the unload), or ``timeout_s`` passes (False).
    """
    if not held:
        return True
    deadline = clock() + timeout_s
    while True:
        free = read_free()
        if all(free.get(d, 0) - before.get(d, 0) >= fraction * n for d, n in held.items()):
            return True
        if clock() >= deadline:
            return False
        sleep(0.05)
