"""Several choices for one request (OpenAI's ``n``): ``n`` jobs of the same request, run
together on the cluster, answered as one; streamed, their chunks interleave, each with its
choice's index. A client that leaves, or a choice that fails, cancels the rest."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

from api_client.ajob import AsyncJob
from scheduler.errors import InvalidRequest
from scheduler.protocol import GenerateResponse

MAX_CHOICES = 16  # jobs one request may make (a key's in-flight limit counts requests)


def check_choices(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n={n}: ggufq answers 1 to {MAX_CHOICES} choices a request")
    return n


class Choices(AsyncJob):
    """The jobs of one request's choices, as one job to a streamed answer: their chunks as
    they come, whichever choice they belong to (:attr:`index`: the last chunk's), ended by
    the final chunk of the last to end; cancelled together. Not one after the other: a
    later choice may hold the runner's only slot while an earlier one waits for it."""

    def __init__(self, jobs: list[AsyncJob]) -> None:
        super().__init__(jobs[0].client, jobs[0].job)
        self.jobs, self.index, self.ended = jobs, 0, 0

    def ends_with(self, chunk: GenerateResponse) -> bool:
        return chunk.done and self.ended == len(self.jobs)

    async def cancel(self) -> None:
        await asyncio.gather(*(job.cancel() for job in self.jobs))

    async def stream(
        self, timeout: float | None = None, cancel_on_close: bool = True, after: int = 0
    ) -> AsyncIterator[GenerateResponse]:
        came: asyncio.Queue[tuple[int, GenerateResponse | Exception]] = asyncio.Queue()

        async def read(index: int, job: AsyncJob) -> None:
            chunks = cast(AsyncGenerator[GenerateResponse, None], job.stream(timeout))
            try:
                async for chunk in chunks:
                    await came.put((index, chunk))
            except Exception as exc:  # its error ends the answer (the others are cancelled)
                await came.put((index, exc))
            finally:
                await chunks.aclose()  # cancels its job unless it ended

        readers = [asyncio.create_task(read(i, job)) for i, job in enumerate(self.jobs)]
        try:
            while self.ended < len(self.jobs):
                self.index, item = await came.get()
                if isinstance(item, Exception):
                    raise item
                self.ended += item.done
                yield item
        finally:  # left early, or a choice failed: the rest are not wanted
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


async def submit_choices(
    n: int, seed: int | None, submit: Callable[[dict[str, Any]], Awaitable[AsyncJob]]
) -> list[AsyncJob]:
    """``n`` jobs by ``submit(options)``, each with its own seed (``seed`` + its index when
    one is given, so that the choices differ as with OpenAI); if one cannot be submitted,
    those already submitted are cancelled."""
    jobs: list[AsyncJob] = []
    try:
        for index in range(n):
            jobs.append(await submit({} if seed is None else {"seed": seed + index}))
    except BaseException:
        for job in jobs:
            await asyncio.shield(job.cancel())
        raise
    return jobs


async def all_results(
    jobs: list[AsyncJob], result: Callable[[AsyncJob], Awaitable[GenerateResponse]]
) -> list[GenerateResponse]:
    """Every choice's final record; one that fails cancels the others and is raised."""
    tasks = [asyncio.ensure_future(result(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for job in jobs:
            await asyncio.shield(job.cancel())
        raise
