"""``python -m tests.held_cli HOLD_AFTER ARGS...``: the real ``ggufq`` command line, with a
batch held open once ``HOLD_AFTER`` rows are in its output until it is asked to stop.

A test that interrupts a running batch must find it running: on a fast machine a whole
batch can finish between two looks at its output file. Held here, the batch waits on the
event the test controls (its Ctrl-C) instead of on the machine being slow; everything else,
the jobs, the signal handling and the output file, is the CLI's own.
"""

from __future__ import annotations

import sys
from typing import IO

from api_client.batch import BatchRun
from api_client.cli import main


def hold_after(rows: int) -> None:
    write = BatchRun._write

    def held(self: BatchRun, file: IO[str] | None) -> None:
        write(self, file)
        # waits in steps, so that the main thread runs the CLI's SIGINT handler between them
        while self.next_write >= rows and self.stop is not None and not self.stop.is_set():
            self.stop.wait(0.05)

    BatchRun._write = held  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_after(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
