"""OpenAI's Batch API on the gateway: ``/v1/files`` (a batch's input, output and error
files) and ``/v1/batches`` (create, list, retrieve, cancel). The batches run on the cluster
(api_client/batches): the request that creates one returns at once, and any gateway
process drives it. A key sees its own files and batches; an admin key, or a keyless
gateway, every one."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import Response

from api_client.batches.files import FileStore, public
from api_client.batches.lines import read_lines
from api_client.batches.states import BatchState, Mover, batch_doc
from api_client.batches.store import Batch, BatchStore, check_cancel
from api_client.gateway.caller import caller_of
from api_client.gateway.core import Routes, gateway_of, json_body, parse_body
from scheduler.errors import Conflict, InvalidRequest

router = Routes(prefix="/v1")


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)


def _files(request: Request) -> FileStore:
    return gateway_of(request).files


def _batches(request: Request) -> BatchStore:
    return gateway_of(request).batches


@router.add("/files", "POST")
async def create_file(request: Request) -> dict[str, Any]:
    caller = caller_of(request)
    try:
        async with request.form(max_files=1, max_fields=8) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise InvalidRequest("the form has no 'file' part: send the JSONL file as 'file'")
            if not isinstance(purpose, str):
                raise InvalidRequest("the form has no 'purpose': send purpose=batch")
            data = await upload.read()
            name = upload.filename or "input.jsonl"
    except (HTTPException, MultiPartException) as exc:
        raise InvalidRequest(
            f"the upload is not a form this takes ({exc}): one 'file' part and 'purpose'"
        ) from None
    keep_s = gateway_of(request).settings.batch_retention_s
    meta = await asyncio.to_thread(
        _files(request).create, data, name, purpose, caller.tenant, keep_s
    )
    return public(meta)


@router.add("/files", "GET")
async def list_files(request: Request) -> dict[str, Any]:
    found = await asyncio.to_thread(_files(request).listing, caller_of(request).only_tenant)
    return {"object": "list", "data": [public(meta) for meta in found], "has_more": False}


@router.add("/files/{file_id}", "GET")
async def get_file(request: Request) -> dict[str, Any]:
    file_id, tenant = request.path_params["file_id"], caller_of(request).only_tenant
    return public(await asyncio.to_thread(_files(request).get, file_id, tenant))


@router.add("/files/{file_id}/content", "GET")
async def file_content(request: Request) -> Response:
    file_id, tenant = request.path_params["file_id"], caller_of(request).only_tenant
    data = await asyncio.to_thread(_files(request).content, file_id, tenant)
    return Response(data, media_type="application/octet-stream")


@router.add("/files/{file_id}", "DELETE")
async def delete_file(request: Request) -> dict[str, Any]:
    file_id, tenant = request.path_params["file_id"], caller_of(request).only_tenant
    for batch in await _batches(request).active_batches():
        if batch.doc["input_file_id"] == file_id:
            raise Conflict(f"file {file_id} is the input of {batch.id}, not ended yet")
    await asyncio.to_thread(_files(request).delete, file_id, tenant)
    return {"id": file_id, "object": "file", "deleted": True}


@router.add("/batches", "POST")
async def create_batch(request: Request) -> dict[str, Any]:
    gateway, caller = gateway_of(request), caller_of(request)
    body: CreateBatch = parse_body(CreateBatch, await json_body(request))
    made = (body.endpoint, body.completion_window, body.metadata, caller.tenant, caller.weight)
    doc = batch_doc(*made, time.time())
    files = _files(request)
    meta = await asyncio.to_thread(files.get, body.input_file_id, caller.only_tenant)
    if meta["purpose"] != "batch":
        raise InvalidRequest(f"file {body.input_file_id} was not uploaded with purpose batch")
    if caller.key is not None:  # its key's models, for every line that parses
        data = await asyncio.to_thread(files.content, body.input_file_id, None)
        limit = gateway.settings.batch_max_lines
        lines, _ = await asyncio.to_thread(read_lines, data, body.endpoint, limit)
        for line in lines:
            caller.check_model(str(line.body.get("model", "")))
    return (await _batches(request).create({**doc, "input_file_id": meta["id"]})).as_openai()


@router.add("/batches", "GET")
async def list_batches(request: Request) -> dict[str, Any]:
    try:
        limit = min(max(int(request.query_params.get("limit", 20)), 1), 100)
    except ValueError:
        raise InvalidRequest("limit must be a whole number from 1 to 100") from None
    after = request.query_params.get("after")
    found = await _batches(request).listing(caller_of(request).only_tenant, limit + 1, after)
    data = [batch.as_openai() for batch in found[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(found) > limit,
    }


async def _batch(request: Request) -> Batch:
    return await _batches(request).get(
        request.path_params["batch_id"], caller_of(request).only_tenant
    )


@router.add("/batches/{batch_id}", "GET")
async def get_batch(request: Request) -> dict[str, Any]:
    return (await _batch(request)).as_openai()


@router.add("/batches/{batch_id}/cancel", "POST")
async def cancel_batch(request: Request) -> dict[str, Any]:
    batch, store = await _batch(request), _batches(request)
    moved, before = await store.move(batch.id, BatchState.CANCELLING, Mover.CALLER)
    check_cancel(batch.id, moved, before)
    return (await store.get(batch.id)).as_openai()
