"""The command-line flags of a worker (`ggufq worker`, `ggufq up`), in a module that imports
nothing heavy: every `ggufq` command's parser declares them without loading the worker."""

from __future__ import annotations

import argparse


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--virtual-gpu",
        action="append",
        default=[],
        metavar="SIZE",
        help="advertise a virtual GPU of this size (repeatable), e.g. 8GiB; "
        "its compute runs on the CPU",
    )
    parser.add_argument("--cpu", action="store_true", help="serve from the CPU even if GPUs exist")
