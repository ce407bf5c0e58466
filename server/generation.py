"""The engine streams of one HTTP request, merged.

One API request may become several engine requests (a list of prompts); their
output streams are merged here, engine failures become ``EngineFault`` and
``RequestAborted``, and closing the merged stream closes the engine iterators
(which aborts the engine requests and frees their KV blocks) however it ends.
``server.driver`` runs a request on them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import anyio

from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineFault(Exception):
    """The engine failed a request (``RequestOutput.error`` or an engine exception)."""


class RequestAborted(Exception):
    """The server aborted the request: a drain ran past ``--shutdown-timeout``.

    The engine ends an aborted stream with ``finish_reason="abort"``; a client
    that disconnected never sees one, so any that reaches a response is this.
    """


class AdmittedStream:
    """The merged engine streams of one API request, holding its admission place
    (``ServerState.admit``) until :meth:`aclose`, which may be called any number
    of times and also before the first delta (when an async generator's own
    ``aclose`` would not run its cleanup)."""

    def __init__(self, merged: AsyncGenerator[tuple[int, RequestOutput], None],
                 release: Callable[[], None]) -> None:
        self._merged = merged
        self._release = release

    def __aiter__(self) -> "AdmittedStream":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        return await self._merged.__anext__()

    async def aclose(self) -> None:
        try:
            await close_quietly(self._merged)
        finally:
            self._release()


async def close_quietly(it: Any) -> None:
    """Close an async iterator even inside a cancelled scope.

    Shielded because this runs in ``finally`` blocks of cancelled tasks, where
    an unshielded await would be cancelled again before the engine had freed
    the request.
    """
    aclose = getattr(it, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:  # the request is over either way; never mask the original error
            logger.exception("error while closing an engine stream")


async def _checked(gen: AsyncIterator[RequestOutput]) -> AsyncGenerator[RequestOutput, None]:
    """Map engine failures of one stream to ``EngineFault``. (A request the engine
    refuses never gets here: ``engine.generate`` raises before its stream starts.)"""
    try:
        async for out in gen:
            if out.error:
                raise EngineFault(out.error)
            if any(o.finish_reason == "abort" for o in out.outputs):
                raise RequestAborted()
            yield out
    except (EngineFault, RequestAborted, GeneratorExit, asyncio.CancelledError):
        raise
    except Exception as e:  # e.g. EngineDeadError: the loop died under this request
        logger.exception("engine stream failed")
        raise EngineFault(str(e) or type(e).__name__) from e
    finally:
        await close_quietly(gen)


async def merge_outputs(
    gens: list[AsyncIterator[RequestOutput]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield ``(prompt_index, output)`` from several engine streams as they arrive.

    Closing the merged stream closes every engine stream. The first failure of
    any stream is raised and the others are aborted.
    """
    if len(gens) == 1:
        single = _checked(gens[0])
        try:
            async for out in single:
                yield 0, out
        finally:
            await close_quietly(single)
        return

    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()
    checked = [_checked(g) for g in gens]

    async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out, None))
            queue.put_nowait((i, None, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(checked)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        for g in checked:
            await close_quietly(g)
