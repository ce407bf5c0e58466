"""The load generator's prompts (``bench.serve``): random-tag prompts of common words, or
paragraphs and code to give back edited (``--load quote`` / ``code``), each opening with a
tag unique to the run, level and index; ``PromptMaker`` sizes them to ``--input-len``
tokens with the server's own tokenizer where it has one."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import httpx

from bench.serve_config import BenchConfig

WORDS = tuple("""the of and to in is was for on with as by at from that this it be are
have has had not but or an they we you he she his her their our your its which who what
when where how all some any each many more most other such only own same so than too
very can will just should now time year people way day man thing woman life child world
school state family student group country problem hand part place case week company
system program question work government number night point home water room mother area
money story fact month lot right study book eye job word business issue side kind head
house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment
air teacher force education river stone bridge garden window light music paper
""".split())


QUOTE_SOURCE = Path(__file__).parent / "data" / "quality_text.txt"
QUOTE_ASK = "Rewrite the following paragraph, fixing its typos. Change nothing else.\n\nParagraph: "
QUOTE_ANSWER = "\n\nRewritten paragraph: "
EDIT_SOURCE = Path(__file__).parent / "data" / "edit_source.py"
# (old, new) names the code load renames, one drawn per prompt.
EDIT_RENAMES = (("item", "entry"), ("amount", "count"), ("name", "label"), ("ledger", "book"),
                ("quantity", "stock"), ("price", "cost"))
EDIT_ASK = "Rename every `{old}` to `{new}` in the following Python code. Change nothing else.\n\n```python\n"
EDIT_ANSWER = "```\n\nThe code with `{old}` renamed to `{new}`:\n\n```python\n"


def prompt_tag(seed: int, run_id: str, level: int, index: int) -> str:
    """A uuid-like tag, unique to the run, the level and the prompt."""
    rng = random.Random(f"tag:{seed}:{run_id}:{level}:{index}")
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def draft_prompt(seed: int, run_id: str, level: int, index: int, num_words: int) -> str:
    """The tag, then ``num_words`` words drawn from the seed (same words on every run)."""
    rng = random.Random(f"words:{seed}:{level}:{index}")
    return prompt_tag(seed, run_id, level, index) + " " + " ".join(
        rng.choice(WORDS) for _ in range(num_words))


def _typo(word: str, rng: random.Random) -> str:
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def quote_prompt(seed: int, run_id: str, level: int, index: int, num_words: int) -> str:
    """The tag, then the request to rewrite ``num_words`` words of the quote source
    (from a place drawn from the seed) in which one word in eight has two letters swapped."""
    rng = random.Random(f"quote:{seed}:{level}:{index}")
    words = QUOTE_SOURCE.read_text(encoding="utf-8").split()
    start = rng.randrange(0, len(words) - num_words)
    para = [_typo(w, rng) if len(w) > 4 and w.isalpha() and rng.random() < 0.125 else w
            for w in words[start:start + num_words]]
    return prompt_tag(seed, run_id, level, index) + "\n" + QUOTE_ASK + " ".join(para) + QUOTE_ANSWER


def edit_prompt(seed: int, run_id: str, level: int, index: int, num_lines: int) -> str:
    """The tag, then the request to rename one name in ``num_lines`` lines of the code
    source (from a place drawn from the seed)."""
    rng = random.Random(f"code:{seed}:{level}:{index}")
    lines = EDIT_SOURCE.read_text(encoding="utf-8").splitlines(keepends=True)
    start = rng.randrange(0, max(1, len(lines) - num_lines))
    old, new = rng.choice(EDIT_RENAMES)
    code = "".join(lines[start:start + num_lines])
    return (prompt_tag(seed, run_id, level, index) + "\n" + EDIT_ASK.format(old=old, new=new) + code
            + EDIT_ANSWER.format(old=old, new=new))


class PromptMaker:
    """Builds prompts of about ``input_len`` tokens, using the server's tokenizer when it
    has one: vLLM/kvserve ``{"prompt"} -> {"tokens"}`` or llama-server
    ``{"content"} -> {"tokens"}``, and ``/detokenize`` to cut at exactly ``input_len``."""

    def __init__(self, client: httpx.AsyncClient, cfg: BenchConfig, model: str) -> None:
        self.client, self.cfg, self.model = client, cfg, model
        self.dialect: str | None = None   # "vllm", "llama" or "none", found on first use

    async def _post(self, path: str, body: dict) -> dict | None:
        try:
            r = await self.client.post(self.cfg.base + path, json=body, headers=self.cfg.headers)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def _tokenize(self, text: str, dialect: str) -> list[int] | None:
        body = ({"model": self.model, "prompt": text, "add_special_tokens": False}
                if dialect == "vllm" else {"content": text, "add_special": False})
        out = await self._post("/tokenize", body)
        tokens = out.get("tokens") if isinstance(out, dict) else None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    async def detect(self) -> str:
        """Which ``/tokenize`` shape the server speaks ("none" if neither)."""
        if self.dialect is None:
            self.dialect = "none"
            for dialect in ("vllm", "llama"):
                if await self._tokenize("hello world", dialect):
                    self.dialect = dialect
                    break
        return self.dialect

    async def make(self, level: int, index: int) -> tuple[str, int]:
        """``(prompt, token count)``; the count is estimated without a tokenizer."""
        cfg = self.cfg
        if cfg.load in ("quote", "code"):
            return await self._quote(level, index)
        if await self.detect() != "none":
            text = draft_prompt(cfg.seed, cfg.run_id, level, index, 2 * cfg.input_len)
            tokens = await self._tokenize(text, self.dialect)
            if tokens is not None:
                if len(tokens) <= cfg.input_len:
                    return text, len(tokens)
                out = await self._post("/detokenize",
                                       {"model": self.model, "tokens": tokens[:cfg.input_len]})
                cut = out and (out.get("prompt") or out.get("content"))
                if isinstance(cut, str) and cut:
                    return cut, cfg.input_len
        tag_tokens = len(prompt_tag(cfg.seed, cfg.run_id, level, index)) // 2
        words = max(1, round((cfg.input_len - tag_tokens) * cfg.words_per_token))
        return draft_prompt(cfg.seed, cfg.run_id, level, index, words), cfg.input_len

    async def _quote(self, level: int, index: int) -> tuple[str, int]:
        # The paragraph (the code's lines) is sized to fill --input-len (the question and
        # the answer's lead-in are kept whole): one measured guess, then a proportional fit.
        cfg = self.cfg
        code = cfg.load == "code"
        words = max(8, round(cfg.input_len * (0.08 if code else 0.6)))
        for _ in range(3):
            text = (edit_prompt if code else quote_prompt)(cfg.seed, cfg.run_id, level, index, words)
            tokens = (await self._tokenize(text, self.dialect)
                      if await self.detect() != "none" else None)
            count = len(tokens) if tokens is not None else round(len(text.split()) / cfg.words_per_token)
            if count <= cfg.input_len:
                return text, count
            words = max(8, int(words * cfg.input_len / count) - 1)
        return text, count
