"""What the dialects' renderers share: the per-choice state of one API request.

``Choices`` accumulates each choice's text, tokens, logprobs and finish reason
from engine deltas (``server.driver`` fills it); the helpers name tokens and
prompt logprobs as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.engine_client import TokenizerLike
from server.protocol_responses import PromptLogprob, PromptLogprobs, Usage, json_logprob


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it, if one did
    # The prompt's own logprobs (first entry None), when the request asked for them.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's answer

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Choices:
    """Per-choice accumulation for ``len(prompts) * n`` choices.

    Choice ``i * n + k`` is sample ``k`` of prompt ``i``, as OpenAI numbers them.
    """

    def __init__(self, prompt_lens: list[int], n: int) -> None:
        self.n = n
        self.prompt_lens = prompt_lens
        self.cached = [0] * len(prompt_lens)
        self.states = [ChoiceState() for _ in range(len(prompt_lens) * n)]

    def index(self, prompt_index: int, out: CompletionOutput) -> int:
        return prompt_index * self.n + out.index

    def update(self, prompt_index: int,
               ro: RequestOutput) -> list[tuple[int, CompletionOutput, bool]]:
        """Fold one delta in; returns ``(choice, output, newly_finished)`` per output."""
        self.cached[prompt_index] = ro.num_cached_tokens
        changed = []
        for out in ro.outputs:
            idx = self.index(prompt_index, out)
            st = self.states[idx]
            st.text.append(out.text)
            st.token_ids.extend(out.token_ids)
            if out.logprobs:
                st.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                st.prompt_logprobs = out.prompt_logprobs
            if out.embedding is not None:
                st.embedding = out.embedding
            newly = out.finish_reason is not None and st.finish_reason is None
            if newly:
                st.finish_reason, st.stop_reason = out.finish_reason, out.stop_reason
            changed.append((idx, out, newly))
        return changed

    def usage(self, generated: bool = True) -> Usage:
        """Token counts; ``generated=False`` when the sampled tokens are not returned
        (a completions ``echo`` with ``max_tokens: 0``)."""
        completion = sum(s.num_tokens for s in self.states) if generated else 0
        return Usage.of(sum(self.prompt_lens), completion, sum(self.cached))


class TokenIdDeltas:
    """With vLLM's ``return_token_ids``, a stream's token ids: each choice's ids not yet
    sent go with its next chunk (a token whose text is held back waits for one)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pending: dict[int, list[int]] = {}

    def add(self, idx: int, token_ids: list[int]) -> None:
        if self.enabled:
            self._pending.setdefault(idx, []).extend(token_ids)

    def take(self, idx: int) -> list[int] | None:
        """Choice ``idx``'s ids for its next chunk (None: not asked for)."""
        return self._pending.pop(idx, []) if self.enabled else None


def token_name(tokenizer: TokenizerLike, token_id: int, as_id: bool) -> str:
    """How a logprob entry names its token: its text, or with vLLM's
    ``return_tokens_as_token_ids`` ``token_id:<id>``, which names it exactly where a
    text cannot (part of a character, or two tokens of one text)."""
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id], skip_special_tokens=False)


def vllm_prompt_logprobs(tokenizer: TokenizerLike, entries: list[TokenLogprob | None] | None) -> PromptLogprobs:
    """The prompt's logprobs in vLLM's ``prompt_logprobs`` shape: per token, None for
    the first, else its own entry (with its rank) then its top alternatives', by token id."""
    assert entries is not None, "the engine sends prompt logprobs with a sample's first tokens"

    def entry(token_id: int, logprob: float, rank: int | None) -> PromptLogprob:
        return PromptLogprob(logprob=json_logprob(logprob), rank=rank,
                             decoded_token=tokenizer.decode([token_id], skip_special_tokens=False))

    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        tokens = {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
        for rank, (token_id, logprob) in enumerate(e.top, start=1):
            tokens.setdefault(str(token_id), entry(token_id, logprob, rank))
        out.append(tokens)
    return out

