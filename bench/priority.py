"""Urgent requests sent into a busy server: what ``--scheduling-policy priority`` buys them.

``--background`` streamed completions (prompts of about 100 words, ``--background-tokens``
tokens each) go out at once; ``--delay`` seconds later, while their prompts still fill
the engine's steps, ``--urgent`` short ones follow together, with ``priority: -1`` when
``--priority`` says the server runs the priority policy. Printed as JSON: each urgent
request's time to first token and the background ones' mean, in ms.

    kvserve serve --scheduling-policy fcfs &      # then again with priority
    python -m bench.priority --url http://127.0.0.1:8000 [--priority]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from bench.serve import check_loopback


async def first_token_seconds(client: httpx.AsyncClient, url: str, model: str | None, prompt: str,
                              max_tokens: int, priority: int | None) -> float:
    """Seconds from sending a streamed completion to its first chunk with text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if model:
        body["model"] = model
    if priority is not None:
        body["priority"] = priority
    start = time.perf_counter()
    async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:]).get("choices", ())):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without text")


async def run(url: str, model: str | None, background: int, background_tokens: int, urgent: int,
              delay: float, priority: bool) -> dict:
    """The measurement (see the module docstring), JSON-ready."""
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        jobs = [asyncio.create_task(first_token_seconds(client, url, model, f"Background job {i}: " + "word " * 100,
                                                        background_tokens, None)) for i in range(background)]
        await asyncio.sleep(delay)
        fast = await asyncio.gather(*(first_token_seconds(client, url, model, f"Urgent {i}: what is 2+2?", 8,
                                                          -1 if priority else None) for i in range(urgent)))
        slow = await asyncio.gather(*jobs)
    return {"priority": priority, "urgent_ttft_ms": [round(t * 1000) for t in fast],
            "background_ttft_mean_ms": round(sum(slow) / len(slow) * 1000)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.priority", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    p.add_argument("--model", default=None)
    p.add_argument("--background", type=int, default=48)
    p.add_argument("--background-tokens", type=int, default=64)
    p.add_argument("--urgent", type=int, default=4)
    p.add_argument("--delay", type=float, default=1.0, help="seconds between the background and the urgent ones")
    p.add_argument("--priority", action="store_true", help="send the urgent ones with priority -1")
    args = p.parse_args(argv)
    try:
        check_loopback(args.url)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(asyncio.run(run(args.url, args.model, args.background, args.background_tokens, args.urgent,
                                     args.delay, args.priority))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
