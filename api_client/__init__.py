"""ggufq's Python client: ``from api_client import Client`` (or ``AsyncClient``)."""

from api_client.aio import AsyncClient
from api_client.ajob import AsyncJob
from api_client.batch_files import BatchSummary
from api_client.client import Client
from api_client.job import Job
from scheduler.errors import (
    ChunksLost,
    GgufqError,
    InvalidModelFile,
    InvalidRequest,
    JobCancelled,
    JobFailed,
    JobLost,
    JobTimeout,
    LoadFailed,
    ModelNotFound,
    NoCapacity,
    NoWorkers,
    RedisUnavailable,
    ServerBusy,
    StackFailed,
    StackNotRunning,
)
from scheduler.protocol import EmbedResponse, GenerateResponse, Message, Options

__all__ = [
    "Client",
    "Job",
    "AsyncClient",
    "AsyncJob",
    "BatchSummary",
    "EmbedResponse",
    "GenerateResponse",
    "Message",
    "Options",
    "ChunksLost",
    "GgufqError",
    "InvalidModelFile",
    "InvalidRequest",
    "JobCancelled",
    "JobFailed",
    "JobLost",
    "JobTimeout",
    "LoadFailed",
    "ModelNotFound",
    "NoCapacity",
    "NoWorkers",
    "RedisUnavailable",
    "ServerBusy",
    "StackFailed",
    "StackNotRunning",
]
