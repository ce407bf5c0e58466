"""A text completion's answer, OpenAI's shapes with vLLM's extensions: a choice per
prompt and sample, whole or in chunks, the prompt echoed where asked."""

from __future__ import annotations

from collections.abc import Iterator

from starlette.responses import JSONResponse, Response

from engine.outputs import RequestOutput, TokenLogprob
from server.driver import Job, Renderer
from server.engine_client import TokenizerLike
from server.protocol import CompletionRequest
from server.protocol_responses import (CompletionChoice, CompletionLogprobs, CompletionResponse, Usage,
                                       json_logprob, now, sse)
from server.serving_common import ChoiceState, Choices, TokenIdDeltas, token_name, vllm_prompt_logprobs


class LogprobsWriter:
    """Writes OpenAI's parallel-list logprobs for one choice, keeping each token's
    ``text_offset``: where its text starts, counted in the tokens' texts."""

    def __init__(self, tokenizer: TokenizerLike, as_ids: bool) -> None:
        """``as_ids``: vLLM's ``return_tokens_as_token_ids`` (each token named ``token_id:<id>``)."""
        self.tokenizer = tokenizer
        self.offset = 0  # where the next token's text starts
        self.as_ids = as_ids

    def name(self, token_id: int) -> str:
        return token_name(self.tokenizer, token_id, self.as_ids)

    def _place(self, token_id: int) -> str:
        """The token's name; its text's place goes into the offsets."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        self.offset += len(text)
        return token_name(self.tokenizer, token_id, True) if self.as_ids else text

    def prompt(self, prompt: list[int], entries: list[TokenLogprob | None] | None) -> CompletionLogprobs:
        """An echoed prompt's logprobs: its first token has none (``null``, as OpenAI sends
        it), each later one its logprob given the tokens before it."""
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        out = CompletionLogprobs(text_offset=[self.offset], tokens=[self._place(prompt[0])],
                                 token_logprobs=[None], top_logprobs=[None])
        return self.tokens(entries[1:], out)  # type: ignore[arg-type]

    def tokens(self, lps: list[TokenLogprob], out: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """``lps``' entries, appended to ``out`` if given."""
        out = out if out is not None else CompletionLogprobs()
        for lp in lps:
            out.text_offset.append(self.offset)
            token = self._place(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(json_logprob(lp.logprob))
            # The alternatives and the sampled token, as OpenAI ("up to logprobs + 1") and vLLM
            # send them: so logprobs=0 gives the sampled token's entry, never null.
            top = {self.name(t): json_logprob(v) for t, v in lp.top}
            top.setdefault(token, json_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return out


class CompletionRenderer(Renderer):
    """A text completion: a choice per prompt and sample, whole or in chunks, with the
    prompt echoed where asked (OpenAI's shapes, with vLLM's extensions)."""

    def __init__(self, tok: TokenizerLike, body: CompletionRequest, job: Job,
                 given: list[str | list[int]]) -> None:
        """``given``: the prompts as the body gave them (``CompletionRequest.prompts``), for echo."""
        super().__init__(Choices([len(p) for p in job.prompts], job.params.n))
        self.tok, self.body, self.job = tok, body, job
        # NOTE: echo of a token-id (or truncated) prompt returns its decoded text.
        self.echoes = [(p if isinstance(p, str) and body.truncate_prompt_tokens is None else tok.decode(ids))
                       if body.echo else "" for p, ids in zip(given, job.prompts)]
        self.want_logprobs = job.params.logprobs is not None
        # echo with max_tokens 0: the prompt alone; the token the engine sampled is dropped.
        self.echo_only = body.echo_only
        # One writer per choice. With echo the prompt's tokens come first, so the generated
        # ones' text_offset starts after theirs (which may hold a BOS the echoed text does not).
        self.writers = [LogprobsWriter(tok, bool(body.return_tokens_as_token_ids)) for _ in self.choices.states]
        self.created = now()
        self.echoed = [False] * len(self.choices.states)
        self.ids = TokenIdDeltas(bool(body.return_token_ids))
        self.sent_prompt_ids: set[int] = set()

    def _prompt(self, idx: int) -> list[int]:
        return self.job.prompts[idx // self.job.params.n]

    def _echo_logprobs(self, idx: int, st: ChoiceState) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        if not self.body.echo:
            return CompletionLogprobs()
        return self.writers[idx].prompt(self._prompt(idx), st.prompt_logprobs)

    def _finish_reason(self, st: ChoiceState) -> str | None:
        return "length" if self.echo_only else st.finish_reason

    def _usage(self) -> Usage:
        return self.choices.usage(generated=not self.echo_only)

    def whole(self) -> Response:
        body, echo_only = self.body, self.echo_only
        result = CompletionResponse(id=self.job.request_id, model=self.job.model, usage=self._usage(), choices=[])
        for idx, st in enumerate(self.choices.states):
            echo = self.echoes[idx // self.job.params.n]
            lps = self._echo_logprobs(idx, st)
            if lps is not None and not echo_only:
                self.writers[idx].tokens(st.logprobs, lps)
            text = echo if echo_only else echo + "".join(st.text)
            result.choices.append(CompletionChoice(
                index=idx, text=text, logprobs=lps, finish_reason=self._finish_reason(st),
                prompt_logprobs=(vllm_prompt_logprobs(self.tok, st.prompt_logprobs)
                                 if body.prompt_logprobs is not None else None),
                prompt_token_ids=self._prompt(idx) if body.return_token_ids else None,
                token_ids=([] if echo_only else st.token_ids) if body.return_token_ids else None))
        return JSONResponse(result.model_dump(mode="json"))

    def _chunk(self, idx: int, text: str, finish_reason: str | None = None,
               logprobs: CompletionLogprobs | None = None) -> str:
        # With return_token_ids: the prompt's ids on a choice's first chunk, and the new ids on each.
        prompt_ids = None
        if self.ids.enabled and idx not in self.sent_prompt_ids:
            self.sent_prompt_ids.add(idx)
            prompt_ids = self._prompt(idx)
        return sse(CompletionResponse(
            id=self.job.request_id, created=self.created, model=self.job.model,
            choices=[CompletionChoice(index=idx, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                      prompt_token_ids=prompt_ids, token_ids=self.ids.take(idx))],
            usage=self._usage() if self.body.continuous_usage else None),
            include_usage=self.body.include_usage)

    def delta(self, prompt_index: int, ro: RequestOutput) -> Iterator[str]:
        for idx, out, finished in self.choices.update(prompt_index, ro):
            st = self.choices.states[idx]
            if self.body.echo and not self.echoed[idx]:
                # On the choice's first delta, which carries the prompt's logprobs.
                self.echoed[idx] = True
                yield self._chunk(idx, self.echoes[prompt_index], logprobs=self._echo_logprobs(idx, st))
            if not self.echo_only:
                self.ids.add(idx, out.token_ids)
            if not self.echo_only and (out.text or out.logprobs):
                lps = self.writers[idx].tokens(out.logprobs or []) if self.want_logprobs else None
                yield self._chunk(idx, out.text, logprobs=lps)
            if finished:
                yield self._chunk(idx, "", finish_reason=self._finish_reason(st))

    def epilogue(self) -> Iterator[str]:
        if self.body.include_usage:
            yield sse(CompletionResponse(id=self.job.request_id, created=self.created, model=self.job.model,
                                         choices=[], usage=self._usage()), include_usage=True)
