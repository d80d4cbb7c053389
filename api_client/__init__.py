"""ggufq's Python client: ``from api_client import Client`` (or ``AsyncClient``)."""

from api_client.aio import AsyncClient, AsyncJob
from api_client.batch_files import BatchSummary
from api_client.client import Client, Job
from scheduler.errors import (
    GgufqError,
    InvalidModelFile,
    InvalidRequest,
    JobCancelled,
    JobFailed,
    JobTimeout,
    LoadFailed,
    ModelNotFound,
    NoCapacity,
    NoWorkers,
    ServerBusy,
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
    "GgufqError",
    "InvalidModelFile",
    "InvalidRequest",
    "JobCancelled",
    "JobFailed",
    "JobTimeout",
    "LoadFailed",
    "ModelNotFound",
    "NoCapacity",
    "NoWorkers",
    "ServerBusy",
    "StackNotRunning",
]
