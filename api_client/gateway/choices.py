"""Several choices for one request (OpenAI's ``n``): ``n`` jobs of the same request, run
together on the cluster, answered as one; streamed, their chunks interleave, each with its
choice's index. A client that leaves, or a choice that fails, cancels the rest."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

from api_client.ajob import AsyncJob, Reader
from api_client.gateway.caller import Caller
from api_client.gateway.errors import NotPermitted
from scheduler.errors import InvalidRequest, JobTimeout
from scheduler.protocol import GenerateResponse

MAX_CHOICES = 16  # jobs one request may make (a key's in-flight limit counts requests)


def check_choices(n: int | None, caller: Caller) -> int:
    """The number of choices asked for, within bounds: at most MAX_CHOICES, and no more
    than the caller's key may have jobs in flight (its limit counts requests, and these are
    ``n`` jobs)."""
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n={n}: ggufq answers 1 to {MAX_CHOICES} choices a request")
    limit = caller.key.max_in_flight if caller.key is not None else 0
    if limit and n > limit:
        raise NotPermitted(
            f"n={n} choices are {n} jobs, more than API key {caller.tenant!r} may have in "
            f"flight ({limit}): ask for at most {limit}"
        )
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

    def reader(
        self,
        timeout: float | None = None,
        cancel_on_close: bool = True,
        after: int = 0,
        lapse_on_close: bool = False,
    ) -> Reader:
        """The choices' chunks as they come (:meth:`AsyncJob.stream` gives them too).
        ``timeout`` bounds the silence of the answer, not of each choice: with one slot, a
        choice is silent while those ahead of it run. Always cancelled when left early,
        never picked up again by another reader (resume.py), never resumed: the other
        arguments are not theirs."""
        return cast(AsyncGenerator[GenerateResponse, None], self._interleaved(timeout))

    async def _interleaved(self, timeout: float | None) -> AsyncIterator[GenerateResponse]:
        came: asyncio.Queue[tuple[int, GenerateResponse | Exception]] = asyncio.Queue()
        wait = self.client.timeout if timeout is None else timeout
        ended: set[int] = set()

        async def read(index: int, job: AsyncJob) -> None:
            chunks = job.reader(wait * len(self.jobs))
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
                try:
                    self.index, item = await asyncio.wait_for(came.get(), wait)
                except TimeoutError:
                    raise JobTimeout(
                        f"no choice of job {self.id} sent anything for {wait:g} s; they are "
                        "cancelled"
                    ) from None
                if isinstance(item, Exception):
                    raise item
                if item.done:
                    self.ended += 1
                    ended.add(self.index)
                yield item
        finally:  # left early, or a choice failed: the rest are not wanted
            for index, reader in enumerate(readers):
                if index not in ended:  # an ended one is letting go of its channel: not cut
                    reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


async def submit_choices(
    n: int, seed: int | None, submit: Callable[[dict[str, Any]], Awaitable[AsyncJob]]
) -> list[AsyncJob]:
    """``n`` jobs by ``submit(options)``, each with its own seed (``seed`` + its index when
    one is given, so that the choices differ as with OpenAI; none, or -1: each its own
    random one); if one cannot be submitted, those already submitted are cancelled."""
    jobs: list[AsyncJob] = []
    try:
        for index in range(n):
            fixed = {} if seed is None or seed < 0 or n == 1 else {"seed": (seed + index) % 2**32}
            jobs.append(await submit(fixed))
    except BaseException:
        await cancel_all(jobs)
        raise
    return jobs


async def cancel_all(jobs: list[AsyncJob]) -> None:
    """Cancel every job; one whose cancel Redis did not take is cancelled once it is back."""
    done = await asyncio.gather(
        *(asyncio.shield(job.cancel()) for job in jobs), return_exceptions=True
    )
    for job, outcome in zip(jobs, done, strict=True):
        if isinstance(outcome, Exception):
            job.cancel_once_back()


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
        await cancel_all(jobs)
        raise
