"""``kvserve run-batch``: a file of OpenAI Batch API requests answered in process.

Each input line is one request, as OpenAI's Batch API and vLLM's ``run-batch`` take it::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and each output line its answer, in the input's order::

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}}, "error": null}

The bodies go to the same FastAPI app ``kvserve serve`` runs, through httpx's
in-process ASGI transport, so a line gets the answer a server would give it: the
same checks, defaults and error shapes. A request the app refuses keeps its
status and error body in ``response`` and its error's code and message in
``error`` as well (where OpenAI's and vLLM's readers look). Up to ``concurrency``
requests run at once, so the engine batches them continuously.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TextIO

import httpx
from fastapi import FastAPI
from tqdm import tqdm

from server.app import API_PATHS


@dataclass(frozen=True)
class BatchRequest:
    """One line of a batch file: its line number (1-based) and its request."""

    line: int
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchSummary:
    """How a batch went: requests answered 2xx and the others."""

    succeeded: int
    failed: int


def parse_batch(lines: Iterable[str]) -> list[BatchRequest]:
    """The requests of a batch file's lines (blank lines skipped).

    ``ValueError`` naming the first bad line: not a JSON object, no string
    ``custom_id`` or one used before (OpenAI's rule), a method other than POST,
    a ``url`` the server does not serve, a ``body`` that is not an object.
    """
    requests: list[BatchRequest] = []
    seen: set[str] = set()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number}: not JSON ({e})") from None
        if not isinstance(item, dict):
            raise ValueError(f"line {number}: a request is a JSON object")
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            raise ValueError(f"line {number}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise ValueError(f"line {number}: custom_id {custom_id!r} is used twice")
        if not isinstance(method, str) or method.upper() != "POST":
            raise ValueError(f"line {number}: method must be POST, got {method!r}")
        if url not in API_PATHS:
            raise ValueError(f"line {number}: url {url!r} is not one of {', '.join(sorted(API_PATHS))}")
        if not isinstance(body, dict):
            raise ValueError(f"line {number}: body must be a JSON object")
        seen.add(custom_id)
        requests.append(BatchRequest(number, custom_id, url, body))
    return requests


def _error_of(body: Any, status: int) -> dict[str, Any]:
    """``error``'s code and message from an OpenAI-shaped error body."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return {"code": str(status), "message": str(body)}
    return {"code": err.get("code") or err.get("type") or str(status), "message": err.get("message", "")}


def _answer_line(request: BatchRequest, status: int, body: Any) -> dict[str, Any]:
    ok = 200 <= status < 300
    request_id = body.get("id") if ok and isinstance(body, dict) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": status,
                         "request_id": request_id if isinstance(request_id, str) else f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None if ok else _error_of(body, status)}


async def _answer(client: httpx.AsyncClient, request: BatchRequest) -> dict[str, Any]:
    if request.body.get("stream"):
        # A batch's answer is one JSON body; the app would send an event stream.
        return _answer_line(request, 400, {"error": {
            "message": "stream is not supported in a batch: leave it out or set it false",
            "type": "invalid_request_error", "param": "stream", "code": None}})
    response = await client.post(request.url, json=request.body)
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return _answer_line(request, response.status_code, body)


async def run_batch(app: FastAPI, requests: list[BatchRequest], out: TextIO, *,
                    concurrency: int, progress: bool = True) -> BatchSummary:
    """Answer ``requests`` through ``app`` (its lifespan runs here: it binds the
    engine to this event loop and shuts it down at the end) and write one JSON line
    per request to ``out``, in order, each as soon as those before it are written."""
    assert concurrency > 0, concurrency
    limit = asyncio.Semaphore(concurrency)
    succeeded = failed = 0

    async def one(client: httpx.AsyncClient, request: BatchRequest) -> dict[str, Any]:
        async with limit:
            return await _answer(client, request)

    # NOTE: raise_app_exceptions=False: a bug's 500 is that line's answer, not the batch's end.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://kvserve", timeout=None) as client:
        tasks = [asyncio.create_task(one(client, r)) for r in requests]
        try:
            with tqdm(total=len(tasks), unit="req", desc="run-batch", disable=not progress) as bar:
                for task in tasks:
                    line = await task
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
                    out.flush()
                    if line["error"] is None:
                        succeeded += 1
                    else:
                        failed += 1
                    bar.update()
        finally:
            for task in tasks:
                task.cancel()  # a failed write leaves no request running
            await asyncio.gather(*tasks, return_exceptions=True)
    return BatchSummary(succeeded, failed)
