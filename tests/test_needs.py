"""What a job needs, from its request: the num_gpu rules and the runner's configuration
(pure; the memory tables come in as numbers)."""

from __future__ import annotations

from scheduler.placement.needs import Defaults, GroupNeeds, Shape, job_needs, runner_config
from scheduler.protocol import JobRequest, RunnerConfig

GIB = 1 << 30
SHAPE = Shape(
    bytes=10 * GIB,
    partial=(GIB, 2 * GIB, 3 * GIB),  # 1, 2, 3 of 3 blocks on a GPU
    group=GroupNeeds(per_block=(3 * GIB,) * 3, per_device=GIB // 2, last=GIB),
    block_count=3,
)
CONFIG = RunnerConfig.for_generation(4096, 4, True)
DEFAULTS = Defaults(4096, 2048, 4, {"big": 1}, True)


def needs_for(num_gpu: int, **fields: object) -> tuple[int, int, bool, bool, str]:
    req = JobRequest.model_validate({"model": "m", "options": {"num_gpu": num_gpu}, **fields})
    n = job_needs(req, CONFIG, SHAPE, retry=False)
    return n.bytes, n.n_gpu_layers, bool(n.partial), n.group is not None, n.where.processor


def test_num_gpu_minus_one_may_offload_partly_or_span_gpus() -> None:
    assert needs_for(-1) == (10 * GIB, -1, True, True, "any")


def test_num_gpu_zero_runs_on_the_cpu_whole() -> None:
    assert needs_for(0) == (10 * GIB, -1, False, False, "cpu")


def test_a_layer_count_asks_for_exactly_that_gpu_share() -> None:
    assert needs_for(2) == (2 * GIB, 2, False, False, "gpu")


def test_all_layers_or_more_is_the_whole_model_on_gpus() -> None:
    assert needs_for(4) == (10 * GIB, 0, False, False, "gpu")
    assert needs_for(99)[1] == 0


def test_pinned_and_avoided_devices_travel_with_the_needs() -> None:
    req = JobRequest(model="m", device="gpu:h:1", avoid=["gpu:h:0"])
    where = job_needs(req, CONFIG, SHAPE, retry=True).where
    assert (where.device, where.avoid) == ("gpu:h:1", ("gpu:h:0",))
    assert job_needs(req, CONFIG, SHAPE, retry=True).main_gpu is None  # the policy's choice
    chosen = JobRequest.model_validate({"model": "m", "options": {"main_gpu": 1}})
    assert job_needs(chosen, CONFIG, SHAPE, retry=False).main_gpu == 1


def test_runner_config_follows_request_then_model_then_default() -> None:
    assert runner_config(JobRequest(model="m"), 4096, DEFAULTS).num_parallel == 4
    assert runner_config(JobRequest(model="big"), 4096, DEFAULTS).num_parallel == 1
    asks = JobRequest.model_validate({"model": "big", "options": {"num_parallel": 8}})
    assert runner_config(asks, 4096, DEFAULTS).num_parallel == 8
    embed = runner_config(JobRequest(model="m", kind="embed", input=["x"]), 2048, DEFAULTS)
    assert embed.embedding and embed.n_batch == 2048 and embed.num_parallel == 1
