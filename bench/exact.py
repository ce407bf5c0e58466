"""kvserve's exact path against transformers, token for token, over HTTP.

    python -m bench.exact --model qwen2.5-coder-1.5b
    python -m bench.exact                          # the default model
    python -m bench.exact --kvserve-args '--kv-cache-dtype float32'
    python -m bench.exact --model gemma-3-270m --long-prompts 4   # 4 of the 16 past a 512-token window

Starts ``kvserve serve --model M --dtype float32 --quantization none`` (the
exact path: the file's own weights, dequantised, computed in float32) on a
free loopback port, sends ``PROMPTS`` (16 fixed prompts: chat turns in the
model's own template and raw code completions, from about 20 to 300 tokens),
all at once by default, greedily (temperature 0, ``max_tokens`` 32, the
answer's token ids and each position's top-2 logprobs asked for), and stops
it. Then transformers loads the same file in float32
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)``)
and generates greedily from the prompt token ids the server used, stopping at
the same EOS tokens. The two run one after the other, so only one copy of the
float32 weights is in memory at a time.

Prints, per prompt, whether the tokens match and where they first differ,
with the gap between the top two logits there on each side (a gap under
``NEAR_TIE`` is a near tie, where the order of a float sum decides), and
whether transformers' tokenizer gives the server's prompt ids. Writes the JSON
to ``bench/results/exact-<time>[-<file>].json``; exits 1 if any prompt differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench import llama_cpp
from bench.peers import _kvserve_argv, free_port, server

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "bench" / "data" / "quality_text.txt"
MAX_TOKENS = 32
NEAR_TIE = 1e-4

_BUGGY = '''def merge_intervals(intervals):
    intervals.sort()
    merged = []
    for start, end in intervals:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def test_merge():
    assert merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]) == [[1, 6], [8, 10], [15, 18]]
    assert merge_intervals([[1, 4], [4, 5]]) == [[1, 5]]
    assert merge_intervals([]) == []
'''
_LRU = '''from collections import OrderedDict


class LRUCache:
    """A fixed-size cache that evicts the least recently used key first."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.items: OrderedDict[str, object] = OrderedDict()

    def get(self, key: str) -> object | None:
        """The value of ``key``, now the most recently used; None if absent."""
        if key not in self.items:
            return None
        self.items.move_to_end(key)
        return self.items[key]

    def put(self, key: str, value: object) -> None:
        """Store ``value`` under ``key``, evicting the least recently used key when full."""
'''


def _excerpt(words: int) -> str:
    return " ".join(TEXT.read_text().split()[:words])


# (kind, prompt): "chat" is one user turn; "completion" is raw text to continue.
PROMPTS: list[tuple[str, str]] = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a Python function that checks whether a string is a palindrome."),
    ("chat", "Explain the difference between a process and a thread in two sentences."),
    ("chat", "Translate 'Good morning, how are you?' into Spanish and German."),
    ("chat", "Write a SQL query that returns the ten customers with the highest total order value, "
             "from the tables customers(id, name) and orders(id, customer_id, amount)."),
    ("chat", "What does this Rust program print?\n```rust\nfn main() {\n    let v = vec![1, 2, 3];\n"
             "    let s: i32 = v.iter().map(|x| x * x).sum();\n    println!(\"{}\", s);\n}\n```"),
    ("chat", "List three prime numbers greater than 100."),
    ("chat", f"The second test of this code fails. Find the bug and explain it.\n```python\n{_BUGGY}```"),
    ("chat", f"Summarize the following text in one sentence.\n\n{_excerpt(180)}"),
    ("chat", "Write a bash one-liner that counts the lines of all .py files under the current directory."),
    ("chat", "Convert this JavaScript to Python:\n```js\nfunction add(a, b) { return a + b; }\n"
             "console.log([1, 2, 3].map(x => add(x, 1)));\n```"),
    ("chat", "Is 2^31 - 1 a prime number? Answer briefly, then say why."),
    ("completion", 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number, '
                   'with fibonacci(0) == 0 and fibonacci(1) == 1."""\n'),
    ("completion", "#include <stdio.h>\n\n/* Print the squares of 0..9, one a line. */\nint main(void) {\n"
                   "    int i;\n    for (i = 0; i < 10; i++) {\n"),
    ("completion", "The three laws of thermodynamics, stated simply for a student, are as follows. "
                   "The first law says that"),
    ("completion", _LRU),
]


@dataclass
class Answer:
    """One prompt's greedy tokens from one engine, and each position's top-2 logit gap
    (the server's from its logprobs: the same gap)."""

    prompt_ids: list[int]
    tokens: list[int]
    gaps: list[float | None]


@dataclass
class Comparison:
    """One prompt's outcome."""

    kind: str
    prompt_tokens: int
    match: bool
    first_difference: int | None  # the first position where the tokens differ (None: they agree)
    kvserve_gap: float | None  # top-2 gap there on each side
    transformers_gap: float | None
    same_prompt_ids: bool | None  # transformers' tokenizer gives the server's prompt ids (None: not checked)
    closest: float | None  # the smallest top-2 gap (transformers') where the tokens agree: how close a call it was
    kvserve_tokens: list[int]
    transformers_tokens: list[int]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ, a shorter one's end included; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _gap(top: list[float]) -> float | None:
    return top[0] - top[1] if len(top) >= 2 else None


def ask(client: httpx.Client, url: str, kind: str, prompt: str) -> Answer:
    """One greedy request to the server: its prompt ids, answer ids and top-2 logprob gaps."""
    # Token ids name the alternatives: two tokens of the same text stay two.
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    if kind == "chat":
        body |= {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": 2}
        r = client.post(f"{url}/v1/chat/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        tops = [sorted((t["logprob"] for t in c["top_logprobs"]), reverse=True)
                for c in choice["logprobs"]["content"]]
    else:
        body |= {"prompt": prompt, "logprobs": 2}
        r = client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        tops = [sorted(t.values(), reverse=True) for t in choice["logprobs"]["top_logprobs"]]
    prompt_ids = choice.get("prompt_token_ids") or r.json().get("prompt_token_ids")
    return Answer(prompt_ids, choice["token_ids"], [_gap(t) for t in tops])


def long_prompts(count: int) -> list[tuple[str, str]]:
    """``PROMPTS`` with its last ``count`` replaced by raw excerpts of the quality text of
    600 words and more (800 tokens and more: past a sliding window of 512)."""
    return PROMPTS[:len(PROMPTS) - count] + [("completion", _excerpt(600 + 150 * i)) for i in range(count)]


def serve_answers(model: Path, extra: list[str], concurrency: int, log: Path,
                  prompts: list[tuple[str, str]] = PROMPTS) -> list[Answer]:
    """The exact path's answers to ``prompts`` from a ``kvserve serve`` started for them."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*_kvserve_argv(port), "--model", str(model), "--dtype", "float32", "--quantization", "none", *extra]
    with server(argv, f"{url}/ready", log), httpx.Client(timeout=1800.0, trust_env=False) as client:
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: ask(client, url, *p), prompts))


def transformers_answers(model: Path, prompt_ids: list[list[int]], eos: list[int]) -> tuple[list[Answer], list]:
    """transformers' float32 greedy answers from the same prompt ids; and its tokenizer."""
    import torch
    import transformers

    where = {"gguf_file": model.name} if model.is_file() else {}
    directory = str(model.parent if model.is_file() else model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **where)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **where).eval()
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=eos,
                                           pad_token_id=eos[0], return_dict_in_generate=True, output_logits=True)
    answers = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), generation_config=config)
            tokens = out.sequences[0, len(ids):].tolist()
            gaps = [_gap(step[0].float().topk(2).values.tolist()) for step in out.logits]
            answers.append(Answer(ids, tokens, gaps))
            print(f"  transformers: {len(answers)}/{len(prompt_ids)}", file=sys.stderr, flush=True)
    return answers, tokenizer


def reference_prompt_ids(tokenizer, kind: str, prompt: str) -> list[int] | None:
    """The prompt's ids by transformers' tokenizer (and the file's chat template; None for a
    chat prompt where the file has no template: a base model, which kvserve gives its default)."""
    if kind == "chat" and tokenizer.chat_template is None:
        return None
    if kind == "chat":
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
        return tokenizer(prompt, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def compare(kind: str, ours: Answer, theirs: Answer, reference_ids: list[int] | None) -> Comparison:
    """One prompt's outcome: where the answers first differ and how close a tie it was there."""
    at = first_difference(ours.tokens, theirs.tokens)

    def gap(answer: Answer) -> float | None:
        return answer.gaps[at] if at is not None and at < len(answer.gaps) else None

    agreed = [g for g in theirs.gaps[:len(theirs.tokens) if at is None else at] if g is not None]
    return Comparison(kind, len(ours.prompt_ids), at is None, at, gap(ours), gap(theirs),
                      None if reference_ids is None else reference_ids == ours.prompt_ids, min(agreed, default=None),
                      ours.tokens, theirs.tokens)


def line(i: int, c: Comparison) -> str:
    """One prompt's line of the report."""
    head = f"{i:2d} {c.kind:10s} {c.prompt_tokens:4d} prompt tokens: "
    tail = "" if c.same_prompt_ids is not False else "  (transformers' tokenizer gives other prompt ids)"

    def fmt(g: float | None) -> str:
        return "n/a" if g is None else f"{g:.3g}{' (near tie)' if g < NEAR_TIE else ''}"

    if c.match:
        return head + f"match ({len(c.kvserve_tokens)} tokens, closest top-2 gap {fmt(c.closest)})" + tail

    return (head + f"MISMATCH at token {c.first_difference}: kvserve {c.kvserve_tokens[c.first_difference:][:1]}"
            f" vs transformers {c.transformers_tokens[c.first_difference:][:1]}; top-2 logit gap there: "
            f"kvserve {fmt(c.kvserve_gap)}, transformers {fmt(c.transformers_gap)}" + tail)


def main(argv: list[str] | None = None) -> int:
    from models.loader import DEFAULT_MODEL, read_tokenizer, resolve_model_path

    p = argparse.ArgumentParser(prog="python -m bench.exact", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|FILE",
                   help=f"as kvserve serve --model takes it (default {DEFAULT_MODEL})")
    p.add_argument("--kvserve-args", default="", help="more flags for kvserve serve, e.g. '--kv-cache-dtype float32'")
    p.add_argument("--concurrency", type=int, default=len(PROMPTS), help="requests in flight at once (default: all)")
    p.add_argument("--cache-dir", type=Path, default=llama_cpp.DEFAULT_CACHE, help="the server's log goes in logs/")
    p.add_argument("--long-prompts", type=int, default=0, metavar="K",
                   help="replace the last K prompts by text excerpts of 800 tokens and more (a window's test)")
    args = p.parse_args(argv)
    prompts = long_prompts(args.long_prompts)
    try:
        model = resolve_model_path(args.model)
    except ValueError as exc:
        p.error(f"--model {args.model!r}: {exc}")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    log = args.cache_dir / "logs" / f"kvserve-exact-{stamp}.log"
    ours = serve_answers(model, shlex.split(args.kvserve_args), args.concurrency, log, prompts)
    eos = sorted(read_tokenizer(args.model).eos_token_ids)
    theirs, tokenizer = transformers_answers(model, [a.prompt_ids for a in ours], eos)
    rows = [compare(kind, a, b, reference_prompt_ids(tokenizer, kind, prompt))
            for (kind, prompt), a, b in zip(prompts, ours, theirs)]
    print(f"{model.name}: kvserve serve --dtype float32 --quantization none {args.kvserve_args} vs transformers "
          f"float32, greedy, {MAX_TOKENS} tokens")
    for i, row in enumerate(rows):
        print(line(i, row))
    matched = sum(r.match for r in rows)
    closest = min((r.closest for r in rows if r.closest is not None), default=None)
    print(f"{matched}/{len(rows)} prompts give the same tokens ({sum(len(r.kvserve_tokens) for r in rows)} "
          f"kvserve tokens; the closest top-2 gap where they agree: {closest})")
    tag = "" if args.model == DEFAULT_MODEL else f"-{model.stem}"
    out = REPO / "bench" / "results" / f"exact-{stamp}{tag}.json"
    command = shlex.join(["python", "-m", "bench.exact", *(sys.argv[1:] if argv is None else argv)])
    out.write_text(json.dumps({"date": stamp, "command": command, "model": model.name, "server_log": str(log),
                               "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"wrote {out.relative_to(REPO)}", file=sys.stderr)
    return 0 if matched == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
