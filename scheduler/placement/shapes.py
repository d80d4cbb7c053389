"""What a runner of each (model file, configuration) needs: its memory shape, estimated
once from the GGUF metadata and kept (bounded: jobs may ask for any num_ctx), and the
record a load of it creates."""

from __future__ import annotations

from typing import Any

from scheduler.gguf.estimate import estimate_bytes, group_parts, partial_table
from scheduler.gguf.metadata import ModelInfo
from scheduler.placement.needs import GroupNeeds, Shape
from scheduler.placement.verdict import Load
from scheduler.protocol import RunnerConfig

MAX_SHAPES = 512  # memory tables kept per (model file, configuration), oldest dropped first


class Shapes:
    def __init__(self, limit: int = MAX_SHAPES) -> None:
        self.limit = limit
        self._shapes: dict[tuple[str, RunnerConfig], Shape] = {}

    def of(self, info: ModelInfo, config: RunnerConfig) -> Shape:
        key = (info.path, config)
        if key not in self._shapes:
            if len(self._shapes) >= self.limit:
                self._shapes.pop(next(iter(self._shapes)))
            self._shapes[key] = Shape(
                estimate_bytes(info, config),
                partial_table(info, config),
                GroupNeeds(*group_parts(info, config)),
                info.block_count,
            )
        return self._shapes[key]


def runner_fields(
    model: str,
    config_key: str,
    config: RunnerConfig,
    shape: Shape,
    keep_alive_s: float,
    load: Load,
) -> dict[str, Any]:
    """The record of a runner a Load creates."""
    return {
        "model": model,
        "config_key": config_key,
        "num_ctx": config.num_ctx,
        "num_parallel": config.num_parallel,
        "embedding": int(config.embedding),
        "bytes": load.bytes,
        "total_bytes": shape.bytes,
        "n_gpu_layers": load.n_gpu_layers,
        "block_count": shape.block_count,
        "keep_alive_s": keep_alive_s,
    }
