"""Structured outputs: a grammar per request, enforced token by token with llguidance.

A request that asks for JSON (any JSON object, or one matching a JSON Schema),
a regex, one of a list of choices or a grammar (Lark, or llama.cpp's GBNF) carries a
``StructuredOutput`` in its ``SamplingParams``. ``GrammarCompiler.compile``
turns it into an llguidance grammar when the request is checked (on the
caller's thread, with the GIL released, under a time and size limit), so a
grammar the library cannot enforce is a ``InvalidRequestError`` (HTTP 400)
that names the problem, never a silently unconstrained answer and never a
stalled engine. Each sample then gets its own ``Grammar`` (an ``LLMatcher``),
owned by its ``Request``: the engine fills every constrained row's allowed-
token bitmask while the model's forward runs (``BitmaskFiller``, llguidance
releases the GIL), the sampler removes the other tokens
(``ops.apply_token_bitmask``), and the sampled token is fed back (``Grammar.advance``).
A matcher's state depends only on the sample's output tokens, so it survives
chunked prefill, preemption and recompute unchanged.

Why llguidance, not xgrammar (measured on the default model's 49152-token
vocabulary; the figures are in docs/structured.md): it has no dependencies
(xgrammar needs transformers at run time, triton and apache-tvm-ffi), it
compiles a schema in about a millisecond, and it refuses the JSON Schema
keywords it cannot enforce instead of ignoring them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engine.sampling_params import StructuredOutput, ThinkTokens
from engine.validation import InvalidRequestError

# Compiling a grammar (and its first mask) at most this long; llguidance's own
# fuel limits bound the work of each later token.
COMPILE_TIMEOUT_S = 5.0


def bitmask_words(vocab_size: int) -> int:
    """32-bit words in one row's allowed-token bitmask."""
    return (vocab_size + 31) // 32


def _regex_literal(text: str) -> str:
    special = set("\\.^$|?*+()[]{}/")
    return "".join("\\" + c if c in special else c for c in text)


# JSON on one line with ", " and ": ": with llguidance's default (any run of
# whitespace between tokens) the default model often wrote newlines and
# indentation until max_tokens instead of closing the object. A schema's own
# "x-guidance" options still apply on top of these.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def llguidance_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for ``spec``."""
    from llguidance import LLMatcher

    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "json":
        return LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(f"({_regex_literal(c)})" for c in spec.value))
    return LLMatcher.grammar_from_lark(_as_lark(spec.value))


def _as_lark(text: str) -> str:
    """A grammar in Lark syntax as it is; one in llama.cpp's GBNF converted to Lark by
    llguidance's converter (a grammar is Lark when it has a ``start:`` rule or an
    ``%llguidance`` line, else GBNF, whose start rule is ``root``)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # the converter's parse errors have no common type
        raise ValueError(f"neither a Lark grammar nor a GBNF one: {exc}") from None


@dataclass
class CompiledGrammar:
    """A checked grammar: build ``Grammar`` objects from it, one per sample."""

    kind: str
    grammar: str
    compile_seconds: float
    _first: Any  # the LLMatcher made while checking, handed to the first sample

    def matcher(self) -> Any:
        first, self._first = self._first, None
        return first


class GrammarError(RuntimeError):
    """A sample's matcher refused a token its own mask allowed: a fault of the grammar
    engine, not of the request. The engine fails that request and keeps serving."""


# Where a sample is with respect to a reasoning block (``ThinkTokens``): it may still
# open one (its first token), is inside one, has just closed one (blanks may
# follow), or is answering under the grammar (always, without ThinkTokens).
OPENING, THINKING, CLOSING, ANSWER = "opening", "thinking", "closing", "answer"


class Phase(NamedTuple):
    """A sample's place with respect to its reasoning block: ``name`` (OPENING, THINKING,
    CLOSING or ANSWER) and, inside the block, how many of the tokens that close it
    (``ThinkTokens.end_after``) have come so far."""

    name: str
    matched: int = 0


class Grammar:
    """One sample's matcher: which tokens may come next, fed each sampled token.

    ``eos_token_ids``: the tokens that end an output (the matcher's end of text).
    With ``think`` the grammar waits out a reasoning block first: every token but
    an end of text is allowed inside it, and ``blanks`` (tokens of whitespace
    only) right after it, before the answer the grammar holds for.
    """

    def __init__(self, matcher: Any, eos_token_ids: frozenset[int] = frozenset(),
                 think: ThinkTokens | None = None, blanks: frozenset[int] = frozenset(),
                 blank_mask: torch.Tensor | None = None) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.think = think
        self.blanks = blanks
        self.blank_mask = blank_mask  # ``blanks`` as a mask row
        self.phase = Phase(ANSWER if think is None else (THINKING if think.opens_in_prompt else OPENING))
        # Why computing this grammar's mask failed (``BitmaskFiller``), if it did: the
        # sample ends at its next token, with this error.
        self.fault: str | None = None

    def after(self, phase: Phase, token_id: int) -> tuple[Phase, bool]:
        """The phase after ``token_id`` in ``phase``, and whether the matcher consumes it."""
        think = self.think
        if phase.name == OPENING:
            assert think is not None
            return (Phase(THINKING), False) if token_id == think.start else (Phase(ANSWER), True)
        if phase.name == THINKING:
            assert think is not None
            return self._thinking(phase.matched, token_id, think), False
        if phase.name == CLOSING:
            return (phase, False) if token_id in self.blanks else (Phase(ANSWER), True)
        return phase, True

    @staticmethod
    def _thinking(matched: int, token_id: int, think: ThinkTokens) -> Phase:
        """Inside the block, after ``matched`` of ``think.end_after`` came: its first token
        starts them over (it occurs only there), the next one goes on, and once they have all
        come ``end`` closes the block whatever came between (harmony's header may hold more
        before its ``<|message|>``)."""
        after = think.end_after
        if matched == len(after) and token_id == think.end:
            return Phase(CLOSING)
        if after and token_id == after[0]:
            return Phase(THINKING, 1)
        if matched < len(after):
            return Phase(THINKING, matched + 1 if token_id == after[matched] else 0)
        return Phase(THINKING, matched)

    def advance(self, token_id: int) -> None:
        """Consume the sampled token (which the mask allowed); ``GrammarError`` if the
        matcher refuses it all the same (its matcher is then in error: the sample ends),
        or if its mask could not be computed."""
        if self.fault is not None:
            raise GrammarError(self.fault)
        phase, consumes = self.after(self.phase, token_id)
        if consumes and not self.matcher.consume_token(token_id):
            raise GrammarError(f"the grammar refused token {token_id}, which its own mask allowed: "
                               f"{_short(self.matcher.get_error())}")
        self.phase = phase

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` the grammar accepts in a row from its state now, up to
        (not including) an end-of-text token: proposals are consumed to compute the masks
        after them and then rolled back, and llguidance's matcher, rolled back over an
        end of text it consumed, rejects tokens it accepted before (a draft proposing
        ``}`` then EOS broke its request's grammar and, with it, the engine loop). Nothing
        after an end of text could be kept anyway; the next step samples it."""
        phase, i = self.phase, 0
        while phase.name != ANSWER and i < len(token_ids):
            token = token_ids[i]
            if token in self.eos_token_ids and phase.name in (THINKING, CLOSING):
                return i  # no end of text inside a reasoning block (nor right after it)
            after, consumes = self.after(phase, token)
            if consumes:
                break
            phase, i = after, i + 1
        rest = token_ids[i:]
        n = self.matcher.validate_tokens(rest) if rest else 0
        return i + next((k for k, t in enumerate(rest[:n]) if t in self.eos_token_ids), n)

    @property
    def forced(self) -> bool:
        """The grammar forces the next bytes (a key, a separator, a literal). Its mask then
        allows only the forced text's canonical tokens, not every token that fits."""
        return self.phase.name != THINKING and bool(self.matcher.compute_ff_bytes())

    def allows(self, token_id: int) -> bool:
        """Whether the mask would allow ``token_id`` next, without computing the mask;
        only where the next bytes are not ``forced`` (there the two agree: checked on
        every token of the vocabulary in tests/engine/test_structured.py)."""
        assert not self.forced, "a forced grammar's mask is narrower than validate_tokens"
        if self.phase.name == THINKING:
            return token_id not in self.eos_token_ids
        if self.phase.name == OPENING and token_id == self.think.start:
            return True
        if self.phase.name == CLOSING and token_id in self.blanks:
            return True
        return self.matcher.validate_tokens([token_id]) == 1

    @property
    def finished(self) -> bool:
        """The grammar accepts no more text: the output is complete."""
        return self.phase.name == ANSWER and self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles requests' ``StructuredOutput`` for one tokenizer (thread-safe).

    ``tokenizer_json`` is the ``tokenizers`` JSON of the model's tokenizer (or
    what makes it: 0.1-0.3 s for a 150-260k vocabulary, not spent at start-up),
    ``vocab_size`` the number of logits columns sampled, ``eos_token_ids``
    the tokens that end an output. The llguidance tokenizer (about a second
    to build for a 49k vocabulary) is built on first use.
    """

    def __init__(self, tokenizer_json: str | Callable[[], str], vocab_size: int, eos_token_ids: list[int],
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._eos_ids = frozenset(eos_token_ids)  # handed to every sample's Grammar
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._blanks: tuple[frozenset[int], torch.Tensor] | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvserve-grammar")

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                text = self._tokenizer_json if isinstance(self._tokenizer_json, str) else self._tokenizer_json()
                self._tokenizer = LLTokenizer(text, n_vocab=self.vocab_size,
                                              eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, spec: StructuredOutput, param: str = "structured") -> CompiledGrammar:
        """Check and build ``spec``'s grammar; ``InvalidRequestError`` naming what is wrong
        (its ``param`` is the ``SamplingParams`` field, ``structured``)."""
        from llguidance import LLMatcher

        t0 = time.perf_counter()
        try:
            grammar = llguidance_grammar(spec)
        except ValueError as exc:
            raise InvalidRequestError(f"invalid {spec.kind}: {exc}", param) from None
        tokenizer = self.tokenizer

        def build() -> Any:
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
            if not matcher.is_error():
                # The first mask does the lexer's up-front work: count it in the compile.
                mask = torch.empty(bitmask_words(self.vocab_size), dtype=torch.int32)
                matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            return matcher

        too_slow = InvalidRequestError(
            f"the {spec.kind} took longer than {self.timeout_s:g} s to compile; simplify it", param)
        started = time.perf_counter()
        future = self._pool.submit(build)
        try:
            matcher = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise too_slow from None
        # A build can end between the wait's deadline and its check: judge by the time it took,
        # so a grammar over the limit is refused every time, not only when the wait saw it.
        if time.perf_counter() - started > self.timeout_s:
            raise too_slow
        if matcher.is_error():
            raise InvalidRequestError(f"the {spec.kind} cannot be enforced: {_short(matcher.get_error())}", param)
        return CompiledGrammar(spec.kind, grammar, time.perf_counter() - t0, matcher)

    def grammar(self, compiled: CompiledGrammar, think: ThinkTokens | None = None) -> Grammar:
        """A fresh matcher for one sample of a compiled request (that waits out a
        reasoning block first, with ``think``)."""
        from llguidance import LLMatcher

        matcher = compiled.matcher()
        if matcher is None:
            matcher = LLMatcher(self.tokenizer, compiled.grammar, log_level=0)
        if think is None:
            return Grammar(matcher, self._eos_ids)
        blanks, blank_mask = self.blanks()
        return Grammar(matcher, self._eos_ids, think, blanks, blank_mask)

    def blanks(self) -> tuple[frozenset[int], torch.Tensor]:
        """The tokens of whitespace only (a reasoning block's closing blanks), as ids and
        as a mask row; worked out once, on first use."""
        tokenizer = self.tokenizer
        with self._lock:
            if self._blanks is None:
                ids = frozenset(t for t in range(min(tokenizer.vocab_size, self.vocab_size))
                                if t not in self._eos_ids and _is_blank(tokenizer.decode_bytes([t])))
                mask = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
                for t in ids:
                    mask[t // 32] |= _bit(t)
                self._blanks = (ids, mask)
            return self._blanks


def _is_blank(text: bytes) -> bool:
    return bool(text) and not text.strip(b" \t\r\n")


def _short(message: str, limit: int = 400) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


def _bit(token_id: int) -> int:
    """Token ``token_id``'s bit in its int32 mask word (bit 31 is the sign bit)."""
    bit = 1 << (token_id % 32)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


class BitmaskFiller:
    """Fills the allowed-token bitmasks of a step's constrained rows on a helper thread.

    ``start`` hands the rows to a long-lived worker thread and returns at once
    (llguidance releases the GIL while it computes each mask), so the masks are ready
    when the forward that runs meanwhile has finished; ``result`` waits for
    them. One step at a time: ``result`` before the next ``start``.
    """

    def __init__(self, vocab_size: int) -> None:
        self.words = bitmask_words(vocab_size)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._worker: threading.Thread | None = None
        self._mask: torch.Tensor | None = None
        self._error: BaseException | None = None

    def start(self, grammars: list[Grammar], proposals: list[list[int]] | None = None) -> None:
        """Start filling one mask per grammar; with ``proposals`` (per grammar, the
        tokens proposed to follow), also the mask after each proposed token, in order
        (the matcher consumes them and is rolled back: they may be rejected)."""
        assert self._mask is None, "the previous step's masks were not collected"
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="kvserve-masks", daemon=True)
            self._worker.start()
        proposals = proposals or [[] for _ in grammars]
        self._mask = torch.empty((sum(1 + len(p) for p in proposals), self.words), dtype=torch.int32)
        self._error = None
        self._done.clear()
        self._jobs.put(list(zip(grammars, proposals)))

    def _run(self) -> None:
        # NOTE: one matcher after the other on this thread, not llguidance's
        # LLExecutor: its worker pool kept spinning after each step's masks,
        # taking a core from the forward (64 constrained rows: 8.8 ms more
        # per step with it, 6.3 ms more without; both with the bitmask kernel).
        while True:
            jobs = self._jobs.get()
            try:
                row = 0
                for grammar, proposed in jobs:
                    self._fill(grammar, proposed, row)
                    row += 1 + len(proposed)
            except BaseException as exc:  # handed to result()
                self._error = exc
            self._done.set()

    def _fill(self, grammar: Grammar, proposed: list[int], row: int) -> None:
        """One grammar's rows, from ``row``. A grammar whose mask cannot be computed is
        a fault of the grammar engine: its rows allow every token and the grammar keeps
        the error (``Grammar.fault``), which fails its sample alone at its next token."""
        matcher, consumed, phase = grammar.matcher, 0, grammar.phase
        try:
            self._fill_row(grammar, phase, row)
            for i, token in enumerate(proposed, start=1):
                # The proposer kept only tokens the grammar accepts, and no end of
                # text (Grammar.valid_prefix): the rollback below stays exact.
                phase, consumes = grammar.after(phase, token)
                if consumes:
                    if not matcher.consume_token(token):
                        raise GrammarError(f"the grammar refused proposed token {token}, which it had "
                                           f"accepted: {_short(matcher.get_error())}")
                    consumed += 1
                self._fill_row(grammar, phase, row + i)
        except Exception as exc:
            grammar.fault = str(exc) if isinstance(exc, GrammarError) else f"computing its mask failed: {exc!r}"
            self._mask[row:row + 1 + len(proposed)] = -1  # every bit set: the sample ends at its next token
        finally:
            if consumed:
                matcher.rollback(consumed)

    def _fill_row(self, grammar: Grammar, phase: Phase, row: int) -> None:
        """The mask of ``grammar`` in ``phase`` (its matcher's state as it is now) into ``row``."""
        if phase.name == THINKING:  # anything but an end of text
            self._mask[row] = -1
            for t in grammar.eos_token_ids:
                self._mask[row, t // 32] &= ~_bit(t)
            return
        row_bytes = self.words * 4
        grammar.matcher.unsafe_compute_mask_ptr(self._mask.data_ptr() + row * row_bytes, row_bytes)
        if phase.name == OPENING:
            t = grammar.think.start
            self._mask[row, t // 32] |= _bit(t)
        elif phase.name == CLOSING and grammar.blank_mask is not None:
            self._mask[row] |= grammar.blank_mask

    def result(self) -> torch.Tensor:
        """The ``[rows, ceil(V/32)]`` int32 bitmasks (bit ``t % 32`` of word ``t // 32``: token t allowed)."""
        assert self._mask is not None, "start() first"
        self._done.wait()
        mask, self._mask = self._mask, None
        if self._error is not None:
            raise self._error
        return mask
