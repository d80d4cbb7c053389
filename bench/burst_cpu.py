"""Where the CPU goes while the whole stack serves batch_throughput's burst.

On a machine where llama.cpp's threads hold every core, whatever else wakes (the client, the
placement service, Redis, a worker's other threads) takes a core from them mid-step, and
their partner spins at a barrier meanwhile. Tokens/s moves by ±10 % between minutes here;
CPU seconds per process and the count of Redis commands and reader wake-ups move far less,
so they show what a change to the helpers saves. One burst of the system column (64 × 64,
8 slots by default), then per process: CPU seconds during the burst; Redis: connections and
commands by type; the client: chunks read and quiet re-reads.

    python bench/burst_cpu.py [--prompts 64] [--tokens 64] [--parallel 8]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import batch_throughput as bt
import redis

from scheduler.store import chunk_reading

HZ = os.sysconf("SC_CLK_TCK")


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """Every process's command line and CPU seconds so far (threads that ended included)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(pid)] = (cmd[:70], (int(fields[11]) + int(fields[12])) / HZ)
    return out


class ReaderCounts:
    """Counts what the client's readers see, by wrapping the pure ChunkOrder."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        order = chunk_reading.ChunkOrder
        on_message, on_record = order.from_message, order.from_record
        counts = self.counts

        def from_message(self: Any, message: Any) -> Any:
            counts["quiet waits" if message is None else "chunks by pub/sub"] += 1
            return on_message(self, message)

        def from_record(self: Any, entries: Any) -> Any:
            counts["stream re-reads (XRANGE)"] += 1
            return on_record(self, entries)

        order.from_message, order.from_record = from_message, from_record  # type: ignore[method-assign]


@contextlib.contextmanager
def account(redis_url: str, readers: ReaderCounts) -> Iterator[None]:
    r = redis.Redis.from_url(redis_url)
    stats0, cmds0, cpu0 = r.info("stats"), r.info("commandstats"), cpu_by_process()
    readers.counts.clear()
    started = time.perf_counter()
    yield
    wall = time.perf_counter() - started
    stats1, cmds1, cpu1 = r.info("stats"), r.info("commandstats"), cpu_by_process()
    print(f"burst: {wall:.1f} s wall, {wall * (os.cpu_count() or 1):.1f} CPU-s on all cores")
    used = collections.Counter[str]()
    for pid, (cmd, secs) in cpu1.items():
        used[cmd or f"[pid {pid}]"] += secs - cpu0.get(pid, (cmd, 0.0))[1]
    for cmd, secs in used.most_common(8):
        print(f"  {secs:7.2f} CPU-s  {cmd}")
    conns = stats1["total_connections_received"] - stats0["total_connections_received"]
    total = stats1["total_commands_processed"] - stats0["total_commands_processed"]
    calls = {
        k.removeprefix("cmdstat_"): v["calls"] - cmds0.get(k, {"calls": 0})["calls"]
        for k, v in cmds1.items()
    }
    top = sorted(((n, k) for k, n in calls.items() if n), reverse=True)[:8]
    print(f"redis: {conns} connections, {total} commands: " + ", ".join(f"{k} {n}" for n, k in top))
    print("client readers: " + ", ".join(f"{k} {n}" for k, n in readers.counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=8)
    args = parser.parse_args()
    readers = ReaderCounts()
    run = bt.through_system(
        bt.prompts(args.prompts),
        args.tokens,
        args.parallel,
        around=lambda url: account(url, readers),
    )
    print(f"system: {run.tok_s:.1f} tok/s")


if __name__ == "__main__":
    main()
