"""What a job needs of the cluster, from its request and its model's shape. Pure: the memory
tables come in computed (the service memoizes them per model file and configuration)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from scheduler.protocol import JobRequest, RunnerConfig

if TYPE_CHECKING:
    from scheduler.settings import Settings


@dataclass(frozen=True)
class GroupNeeds:
    """What a model needs when its blocks are split over several GPUs of one worker."""

    per_block: tuple[int, ...]  # weights + KV cache of each block, in order
    per_device: int  # each GPU holds a compute buffer
    last: int  # the output layer, on the GPU that holds the last blocks


@dataclass(frozen=True)
class JobNeeds:
    model: str
    config_key: str
    bytes: int
    # partial[n] = GPU bytes with n layers offloaded (n = 1..block_count; llama.cpp's
    # n_gpu_layers, output layer first); empty when no partial offload is allowed
    partial: tuple[int, ...] = ()
    group: GroupNeeds | None = None  # None: the model may not span devices
    num_parallel: int | None = None  # slots the job asks for; None: any runner's
    # the job asks for this many layers on a GPU (``bytes`` is their GPU share); -1 = as
    # many as fit (any runner), 0 = the whole model on GPUs (no partial runner)
    n_gpu_layers: int = -1
    where: Where = field(default_factory=lambda: Where())
    retry: bool = False  # a parked job tried again: already counted among the parked
    # replicas of this model and configuration (branch 3): demand grows them up to
    # max_replicas; below min_replicas (a floor pinned by `ggufq load --replicas`) one is
    # loaded even while the others have free slots
    max_replicas: int = 1
    min_replicas: int = 0
    affine: str | None = None  # the runner that last served this job's prompt prefix
    # jobs that may wait at one runner beyond its slots; -1 = no bound (always route).
    # With a bound, work beyond it parks, where it is retried in fair order across tenants
    queue_depth: int = -1
    main_gpu: int | None = None  # a new runner goes to a GPU of this index when one takes it


@dataclass(frozen=True)
class Where:
    """Which devices a job may use at all."""

    device: str | None = None  # pinned to this device
    avoid: tuple[str, ...] = ()  # its model failed to load there
    num_gpu: int = -1  # Ollama's: 0 = the CPU only; > 0 = that many layers, on GPUs only
    layers: int = 0  # how many layers that is for this model (for the message)

    @property
    def processor(self) -> Literal["any", "cpu", "gpu"]:
        return "cpu" if self.num_gpu == 0 else "gpu" if self.num_gpu > 0 else "any"


@dataclass(frozen=True)
class Shape:
    """A model's memory under one configuration, as the estimate gives it."""

    bytes: int  # the whole model on one device
    partial: tuple[int, ...]  # GPU bytes with n = 1 .. block_count layers offloaded
    group: GroupNeeds  # split over several GPUs of one worker
    block_count: int


@dataclass(frozen=True)
class Defaults:
    """The settings a runner's configuration falls back on."""

    num_ctx: int
    embed_num_ctx: int
    num_parallel: int
    model_parallel: Mapping[str, int]  # per model, else num_parallel
    flash_attention: bool
    max_replicas: int = 1
    model_replicas: Mapping[str, int] = field(default_factory=dict)  # per model
    runner_queue: int | None = None  # None: as many as a runner's slots; -1: no bound

    @classmethod
    def of(cls, s: Settings) -> Defaults:
        """The defaults the settings (GGUFQ_NUM_CTX, ...) give."""
        parallel = (s.num_parallel, s.model_parallel, s.flash_attention)
        return cls(
            s.num_ctx, s.embed_num_ctx, *parallel, s.max_replicas, s.model_replicas, s.runner_queue
        )

    def slots(self, model: str) -> int:
        return self.model_parallel.get(model, self.num_parallel)

    def replicas(self, model: str) -> int:
        return self.model_replicas.get(model, self.max_replicas)


def runner_config(req: JobRequest, num_ctx: int, defaults: Defaults) -> RunnerConfig:
    """The configuration of the runner that serves ``req`` (``num_ctx`` already chosen)."""
    if req.kind == "embed":
        return RunnerConfig.for_embedding(num_ctx, defaults.flash_attention)
    parallel = req.options.num_parallel or defaults.slots(req.model)
    return RunnerConfig.for_generation(num_ctx, parallel, defaults.flash_attention)


def job_needs(
    req: JobRequest,
    config: RunnerConfig,
    shape: Shape,
    retry: bool,
    defaults: Defaults | None = None,
    affine: str | None = None,
) -> JobNeeds:
    """Ollama's num_gpu decides the layers: -1 = as many on a GPU as fit (partial offload
    and spanning GPUs allowed); 0 = the CPU only; 1 .. block_count = exactly that many on a
    GPU; more = the whole model on GPUs, never a partial runner. ``defaults`` bound the
    model's replicas and the jobs let wait at a runner (without: one runner, no bound);
    ``affine`` is the runner that last served the job's prompt prefix."""
    num_gpu, whole = req.options.num_gpu, shape.block_count + 1
    queue = -1 if defaults is None else defaults.runner_queue
    needs = JobNeeds(
        req.model,
        config.key(),
        shape.bytes,
        num_parallel=None if req.kind == "embed" else req.options.num_parallel,
        where=Where(req.device, tuple(req.avoid), num_gpu, min(num_gpu, whole)),
        retry=retry,
        max_replicas=1 if defaults is None else defaults.replicas(req.model),
        min_replicas=req.replicas,
        affine=affine,
        queue_depth=config.num_parallel if queue is None else queue,
        main_gpu=req.options.main_gpu,
    )
    if 0 < num_gpu < whole:
        return replace(needs, bytes=shape.partial[num_gpu - 1], n_gpu_layers=num_gpu)
    if num_gpu >= whole:
        return replace(needs, n_gpu_layers=0)
    if num_gpu < 0:
        return replace(needs, partial=shape.partial, group=shape.group)
    return needs


def format_warning(req: JobRequest) -> str | None:
    """Constrained to JSON by a prompt that never asks for JSON, models tend to emit endless
    whitespace (a lesson from Ollama)."""
    if req.format is None or "json" in req.prompt.lower():
        return None
    return (
        "format asks for JSON but the prompt never mentions JSON; models then tend to emit "
        "endless whitespace: ask for JSON in the prompt"
    )


def config_of(req: JobRequest) -> tuple[object, ...]:
    """What decides a job's runner configuration, as far as its request tells."""
    o = req.options
    return (req.model, req.kind, o.num_ctx, o.num_parallel, o.num_gpu, req.device)
