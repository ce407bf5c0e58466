"""Structured outputs in the engine, on the real default model: what the grammar accepts comes back.

Every constrained answer is parsed (``json`` + ``jsonschema``, ``re.fullmatch``)
against what was asked; a grammar llguidance cannot enforce is refused when
the request is checked, naming the problem; the matcher follows a request
through preemption, ``n > 1`` and the length limit.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.sampling_params import SamplingParams, StructuredOutput, ThinkTokens
from engine.structured import BitmaskFiller
from engine.validation import InvalidRequestError


# smollm2_loaded: the default model on its served path (tests/conftest.py)
SERVED_PATH = True

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False},
        "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "email", "tags", "address", "score"],
    "additionalProperties": False,
}
LARK = """
start: "The answer is " answer "."
answer: "yes" | "no" | NUMBER
NUMBER: /[0-9]{1,3}/
"""
# The same grammar in llama.cpp's GBNF.
GBNF = r"""
root   ::= "The answer is " answer "."
answer ::= "yes" | "no" | [0-9] [0-9]? [0-9]?
"""


def make_engine(loaded, num_blocks: int = 64, **overrides) -> LLMEngine:
    budget = num_blocks * kv_bytes_per_block(loaded.config, loaded.dtype, BLOCK_SIZE)
    settings = dict(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                    max_model_len=256, kv_cache_dtype="float32")
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded=loaded)


@pytest.fixture(scope="module")
def engine(smollm2_loaded) -> LLMEngine:
    return make_engine(smollm2_loaded)


def chat(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def generate(engine: LLMEngine, prompt: list[int], spec: StructuredOutput, **params):
    settings = dict(temperature=0, max_tokens=120) | params
    return engine.generate([prompt], SamplingParams(structured=spec, **settings), use_tqdm=False)[0]


def test_json_schema_answers_validate_against_the_schema(engine):
    texts = ("Describe a person as JSON.", "Make up a user record for Ada, a mathematician.",
             "Give me a JSON profile of a guest who lives in Paris.")
    params = SamplingParams(temperature=0, max_tokens=120, structured=StructuredOutput("json", PERSON))
    for (out,) in engine.generate([chat(engine, t) for t in texts], params, use_tqdm=False):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_json_object_answers_are_json_objects(engine):
    (out,) = generate(engine, chat(engine, "Reply with a tiny JSON object."),
                      StructuredOutput("json", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                "required": ["ok"], "additionalProperties": False}))
    assert isinstance(json.loads(out.text), dict)
    # Any object: the grammar closes it; the answer parses as one even when cut short is not the case.
    (out,) = generate(engine, chat(engine, "Say hi in JSON."), StructuredOutput("json_object"), max_tokens=200)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and out.text.lstrip().startswith("{")


def test_regex_choice_and_grammar(engine):
    prompt = chat(engine, "Is the sky blue? Answer.")
    (out,) = generate(engine, prompt, StructuredOutput("regex", r"(yes|no), [a-z ]{1,20}\."))
    assert re.fullmatch(r"(yes|no), [a-z ]{1,20}\.", out.text) and out.finish_reason == "stop"
    (out,) = generate(engine, prompt, StructuredOutput("choice", ["Yes, it is", "No", "Maybe (sometimes)"]))
    assert out.text in ("Yes, it is", "No", "Maybe (sometimes)") and out.finish_reason == "stop"
    (out,) = generate(engine, prompt, StructuredOutput("grammar", LARK))
    assert re.fullmatch(r"The answer is (yes|no|[0-9]{1,3})\.", out.text), out.text
    (out,) = generate(engine, prompt, StructuredOutput("grammar", GBNF))  # llama.cpp's syntax
    assert re.fullmatch(r"The answer is (yes|no|[0-9]{1,3})\.", out.text), out.text


def test_what_cannot_be_enforced_is_refused_naming_it(engine):
    prompt = chat(engine, "Hi")
    cases = [
        (StructuredOutput("json", {"type": "string", "not": {"const": "a"}}), "not"),
        (StructuredOutput("json", {"type": "strin"}), "strin"),
        (StructuredOutput("regex", "(unclosed"), "regex"),
        (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
        (StructuredOutput("grammar", 'root ::= answer'), "answer"),  # GBNF naming a rule it lacks
        (StructuredOutput("grammar", 'root ::= "unclosed'), "GBNF"),
    ]
    for spec, named in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(named)):
            engine.prepare("refused", prompt, SamplingParams(structured=spec))
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput("json", "{not json")
    assert not engine.has_unfinished_requests()


def test_a_cut_off_answer_ends_with_length(engine):
    (out,) = generate(engine, chat(engine, "Describe a person as JSON."), StructuredOutput("json", PERSON),
                      max_tokens=5)
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_the_grammar_ends_the_answer_even_with_ignore_eos(engine):
    (out,) = generate(engine, chat(engine, "Yes or no?"), StructuredOutput("choice", ["yes", "no"]),
                      ignore_eos=True, max_tokens=50)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_every_sample_of_n_follows_its_own_grammar(engine):
    outs = generate(engine, chat(engine, "Describe a person as JSON."), StructuredOutput("json", PERSON),
                    n=3, temperature=1.0, seed=7)
    assert len(outs) == 3
    for out in outs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), PERSON)
        else:
            assert out.finish_reason == "length"
    assert len({o.text for o in outs}) > 1, "three seeded samples should differ"


def test_constrained_answers_survive_preemption_and_do_not_depend_on_the_batch(smollm2_loaded, engine):
    prompts = [chat(engine, t) for t in ("Describe a person as JSON.", "A user record for Bob, please.",
                                          "JSON for a guest named Eve.", "Profile of an admin in Rome.")]
    spec = StructuredOutput("json", PERSON)
    alone = [generate(engine, p, spec)[0] for p in prompts]
    # 16 blocks (one max_model_len sequence) for four answers of 5-7 blocks each: some are
    # preempted and recomputed.
    small = make_engine(smollm2_loaded, num_blocks=16)
    together = small.generate(prompts, SamplingParams(temperature=0, max_tokens=120, structured=spec),
                              use_tqdm=False)
    assert small.scheduler.num_preemptions_total > 0
    for a, (t,) in zip(alone, together):
        assert t.token_ids == a.token_ids
        jsonschema.validate(json.loads(t.text), PERSON)
    assert small.kv_cache.stats.num_blocks_used == 0 or small.config.enable_prefix_caching
    assert not small.has_unfinished_requests()


def test_compilation_has_a_time_and_a_size_limit(engine):
    from engine.structured import GrammarCompiler

    hurried = GrammarCompiler(engine.tokenizer.to_json(), engine.vocab_size, sorted(engine.eos_token_ids),
                              timeout_s=0.0)
    with pytest.raises(InvalidRequestError, match="longer than 0 s to compile") as err:
        hurried.compile(StructuredOutput("json", PERSON), "response_format")
    assert err.value.param == "response_format"
    huge = {"enum": [f"value-{i}" for i in range(8000)]}
    with pytest.raises(ValueError, match="longer than 65536 bytes"):
        StructuredOutput("json", huge)


def test_greedy_rows_masked_only_where_the_pick_is_refused_give_the_masked_answer(
        smollm2_loaded, engine, monkeypatch):
    import engine.llm_engine as llm_engine
    from engine.structured import BitmaskFiller

    prompts = [chat(engine, t) for t in ("Describe a person as JSON.", "JSON for a guest named Eve.")]
    spec = StructuredOutput("json", PERSON)
    settings = [dict(), dict(repetition_penalty=1.3, logit_bias={90: 5.0}), dict(min_tokens=60)]
    masked_rows = []
    start = BitmaskFiller.start
    monkeypatch.setattr(BitmaskFiller, "start",
                        lambda self, g, p=None: (masked_rows.append(len(g)), start(self, g, p))[1])

    def run() -> list[list[int]]:
        # The six requests (each prompt with each setting) in one batch: rows with
        # different penalties and biases are masked, or not, side by side.
        work = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=80, structured=spec, **extra))
                for i, (extra, p) in enumerate((e, p) for e in settings for p in prompts)}
        for rid, (p, params) in work.items():
            engine.add_request(rid, p, params)
        tokens: dict[str, list[int]] = {rid: [] for rid in work}
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None
                tokens[out.request_id] += [t for o in out.outputs for t in o.token_ids]
        return list(tokens.values())

    checked = run()
    lazy_masks = sum(masked_rows)
    monkeypatch.setattr(llm_engine, "picks_argmax", lambda params: False)  # every row masked first
    masked_rows.clear()
    assert run() == checked
    tokens = sum(len(t) for t in checked)
    assert sum(masked_rows) == tokens  # masked first: one mask per token
    assert 0 < lazy_masks < tokens, (lazy_masks, tokens)  # checked: fewer masks


def test_where_the_grammar_leaves_a_choice_its_mask_is_what_validation_allows(engine):
    from engine.structured import bitmask_words

    text = ('{"name": "Ada", "age": 36, "role": "admin", "email": "ada@math.org", "tags": ["x", "y"], '
            '"address": {"city": "London"}, "score": null}')
    grammar = engine.grammars.grammar(engine.grammars.compile(StructuredOutput("json", PERSON)))
    mask = torch.empty(bitmask_words(engine.vocab_size), dtype=torch.int32)
    free = forced = 0
    for token in engine.tokenizer.encode(text, add_special_tokens=False):
        grammar.matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        words = mask.tolist()
        if grammar.forced:
            forced += 1
        else:
            free += 1
            refused = [t for t in range(engine.vocab_size)
                       if bool((words[t // 32] >> (t % 32)) & 1) != grammar.allows(t)]
            assert not refused, (engine.tokenizer.decode(refused[:5]), free)
        grammar.advance(token)
    assert free > 5 and forced > 5


def test_proposals_stop_before_an_end_of_text_so_their_masks_leave_the_grammar_as_it_was(engine):
    # The masks after proposed tokens are computed by consuming them and rolling back;
    # llguidance rolled back over a consumed end of text leaves a matcher that rejects what
    # it accepted before, so proposals stop before one (the next step samples it).
    from engine.structured import BitmaskFiller, bitmask_words

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    compiled = engine.grammars.compile(StructuredOutput("json", schema))
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    grammar, fresh = engine.grammars.grammar(compiled), engine.grammars.grammar(compiled)
    for token in encode('{"name": "Ada", "n'):
        grammar.advance(token)
        fresh.advance(token)
    eos = sorted(engine.eos_token_ids)[0]
    proposal = encode('": 1}') + [eos, 42]
    assert grammar.valid_prefix(proposal) == len(proposal) - 2  # the JSON, not its end of text
    assert grammar.valid_prefix([eos]) == 0 and grammar.valid_prefix(encode('": 1')) == len(encode('": 1'))
    filler = BitmaskFiller(engine.vocab_size)
    filler.start([grammar], [proposal[:grammar.valid_prefix(proposal)]])
    masks = filler.result()
    assert masks.shape == (len(proposal) - 1, bitmask_words(engine.vocab_size))

    def mask(g):
        out = torch.empty(bitmask_words(engine.vocab_size), dtype=torch.int32)
        g.matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        return out

    assert torch.equal(mask(grammar), mask(fresh)) and torch.equal(masks[0], mask(fresh))
    for token in proposal[:-2]:
        grammar.advance(token)  # raised after the rollback over an end of text
    assert grammar.finished


def test_a_grammar_fault_fails_its_own_request_and_nothing_else(smollm2_loaded, monkeypatch):
    # A matcher that refuses a token its mask allowed is a fault of the grammar engine (one
    # broke under speculation, see above); it must cost that request only, not the engine.
    from engine.structured import Grammar, GrammarError

    engine = make_engine(smollm2_loaded)
    spec = StructuredOutput("json", PERSON)
    prompts = {"bad": chat(engine, "Describe a person as JSON."), "good": chat(engine, "JSON for a guest named Eve.")}
    params = SamplingParams(temperature=0, max_tokens=40, structured=spec)
    [[alone]] = engine.generate([prompts["good"]], params, use_tqdm=False)
    for rid in ("bad", "good"):
        engine.add_request(rid, prompts[rid], dataclasses.replace(params, n=2) if rid == "bad" else params)
    doomed = engine.outputs.requests["bad"].seqs[1].grammar
    real, seen = Grammar.advance, []

    def advance(self: Grammar, token_id: int) -> None:
        if self is doomed and len(seen) == 5:
            raise GrammarError("simulated refusal")
        seen.extend([token_id] if self is doomed else [])
        real(self, token_id)

    monkeypatch.setattr(Grammar, "advance", advance)
    assert_only_bad_fails(engine, prompts["good"], params, alone.token_ids, "simulated refusal")


def assert_only_bad_fails(engine, good_prompt: list[int], params: SamplingParams, alone: list[int],
                          error: str) -> None:
    """Run requests "bad" and "good" to the end: "bad" fails with ``error``, "good" gets the
    tokens it gets ``alone``, nothing is left running, and the engine serves on."""
    finals: dict[str, object] = {}
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += [t for o in out.outputs for t in o.token_ids] if out.request_id == "good" else []
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].error and error in finals["bad"].error
    assert finals["good"].error is None and tokens == alone
    assert engine.kv_cache.stats.num_blocks_used == 0 or engine.config.enable_prefix_caching
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    again = engine.generate([good_prompt], params, use_tqdm=False)
    assert again[0][0].token_ids == alone


class _FailingMatcher:
    """A matcher whose mask or proposal consumption fails on cue; the rest is the real one's."""

    def __init__(self, real, fail_mask_after: int | None = None, refuse_token: int | None = None) -> None:
        self._real, self.masks, self.fail_mask_after, self.refuse_token = real, 0, fail_mask_after, refuse_token
        self.rolled_back = 0

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.masks += 1
        if self.fail_mask_after is not None and self.masks > self.fail_mask_after:
            raise ValueError("simulated mask failure")
        self._real.unsafe_compute_mask_ptr(ptr, size)

    def consume_token(self, token: int) -> bool:
        return token != self.refuse_token and self._real.consume_token(token)

    def rollback(self, n: int) -> None:
        self.rolled_back += n
        self._real.rollback(n)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def test_a_proposal_the_matcher_refuses_faults_its_grammar_alone(engine):
    from engine.structured import BitmaskFiller, GrammarError

    compiled = engine.grammars.compile(StructuredOutput("json", PERSON))
    encode = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    good, bad = engine.grammars.grammar(compiled), engine.grammars.grammar(compiled)
    proposal = encode('{"name": "Ada"')
    bad.matcher = _FailingMatcher(bad.matcher, refuse_token=proposal[2])
    filler = BitmaskFiller(engine.vocab_size)
    filler.start([good, bad], [proposal, proposal])
    masks = filler.result()
    rows = 1 + len(proposal)
    assert good.fault is None and bad.fault and "refused proposed token" in bad.fault
    # The faulted grammar's rows allow everything; the other's are its own masks.
    assert (masks[rows:] == -1).all() and not (masks[:rows] == -1).all()
    assert bad.matcher.rolled_back == 2  # what it had consumed, no more
    with pytest.raises(GrammarError, match="refused proposed token"):
        bad.advance(proposal[0])
    good.advance(proposal[0])


def test_a_mask_that_cannot_be_computed_fails_its_own_request_and_nothing_else(smollm2_loaded):
    engine = make_engine(smollm2_loaded)
    spec = StructuredOutput("json", PERSON)
    prompts = {"bad": chat(engine, "Describe a person as JSON."), "good": chat(engine, "JSON for a guest named Eve.")}
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=40, structured=spec)
    [[alone]] = engine.generate([prompts["good"]], params, use_tqdm=False)
    for rid in ("bad", "good"):
        engine.add_request(rid, prompts[rid], params)
    doomed = engine.outputs.requests["bad"].seqs[0].grammar
    doomed.matcher = _FailingMatcher(doomed.matcher, fail_mask_after=4)
    assert_only_bad_fails(engine, prompts["good"], params, alone.token_ids, "simulated mask failure")


# --- a reasoning block before the constrained answer (ThinkTokens) ---------------------

START, END = 1510, 2294  # " think", " done": single SmolLM2 tokens standing in for <think>, </think>
NEWLINE, EOS = 198, 2
DIGITS = StructuredOutput("regex", "[0-9]{3}")


def test_the_grammar_waits_out_a_block_the_prompt_opened(engine):
    prompt = chat(engine, "Pick a number.")
    # R1 style: the answer starts inside the block, where the grammar does not hold yet...
    closed = generate(engine, prompt, DIGITS, think=ThinkTokens(START, END, opens_in_prompt=True),
                      logit_bias={END: 100.0}, max_tokens=10)
    out = closed[0]
    assert out.token_ids[0] == END and out.finish_reason == "stop"
    # (blanks may come first: this model writes two newlines after the block)
    assert re.fullmatch("[ \n]*[0-9]{3}", engine.tokenizer.decode(out.token_ids[1:])), out.text
    # ...and without ThinkTokens the same bias cannot reach past the grammar.
    plain = generate(engine, prompt, DIGITS, logit_bias={END: 100.0}, max_tokens=10)[0]
    assert END not in plain.token_ids and re.fullmatch("[0-9]{3}", plain.text)


def test_inside_the_block_anything_but_an_end_of_text_and_blanks_after_it(engine):
    prompt = chat(engine, "Pick a number.")
    think = ThinkTokens(START, END, opens_in_prompt=True)
    # An end of text cannot end the answer inside the block, however likely.
    out = generate(engine, prompt, DIGITS, think=think, logit_bias={EOS: 100.0}, max_tokens=6)[0]
    assert EOS not in out.token_ids and out.finish_reason == "length" and len(out.token_ids) == 6
    # Right after the block, blanks may come before the answer (Qwen3 writes "</think>\n\n").
    out = generate(engine, prompt, DIGITS, think=think, logit_bias={END: 100.0, NEWLINE: 50.0},
                   max_tokens=6)[0]
    assert out.token_ids[:3] == [END, NEWLINE, NEWLINE]


def test_a_model_that_may_think_opens_the_block_or_answers_at_once(engine):
    prompt = chat(engine, "Pick a number.")
    think = ThinkTokens(START, END)
    # Qwen3 style: without the opening token first, the grammar holds from the first token...
    out = generate(engine, prompt, DIGITS, think=think, max_tokens=10)[0]
    assert re.fullmatch("[0-9]{3}", out.text) and out.finish_reason == "stop"
    # ...and after it, the block is free text (here: the same token again and again).
    out = generate(engine, prompt, DIGITS, think=think, logit_bias={START: 100.0}, max_tokens=5)[0]
    assert out.token_ids == [START] * 5 and out.finish_reason == "length"


def test_proposals_and_masks_follow_the_block(engine):
    # Speculative proposals are checked, and their masks computed, phase by phase.
    compiled = engine.grammars.compile(DIGITS)
    one, two = engine.tokenizer.encode("1", add_special_tokens=False)[0], \
        engine.tokenizer.encode("2", add_special_tokens=False)[0]
    grammar = engine.grammars.grammar(compiled, ThinkTokens(START, END, opens_in_prompt=True))
    assert grammar.valid_prefix([START, 7, END, NEWLINE, one, two, NEWLINE]) == 6
    assert grammar.valid_prefix([7, EOS, END]) == 1  # no end of text inside the block
    filler = BitmaskFiller(engine.vocab_size)
    filler.start([grammar], [[END, NEWLINE, one]])
    masks = filler.result()

    def allowed(row: int, token: int) -> bool:
        return bool((int(masks[row, token // 32]) >> (token % 32)) & 1)

    assert allowed(0, START) and allowed(0, 7) and not allowed(0, EOS)  # inside: anything but EOS
    assert allowed(1, NEWLINE) and allowed(1, one) and not allowed(1, 7)  # closed: blanks or the answer
    assert allowed(3, two) and not allowed(3, NEWLINE)  # answering: the grammar alone
    # The fill left the grammar as it was: still inside the block, its matcher at the start.
    assert grammar.phase.name == "thinking" and grammar.matcher.validate_tokens([one, two, one, two]) == 3


def test_a_block_closed_by_a_run_of_tokens_waits_for_the_whole_run(engine):
    # gpt-oss's harmony: the grammar holds from the final channel's body, after
    # <|channel|> final <|message|> (stand-ins here), whatever header tokens come between;
    # the same tokens in another order, or the run broken off, leave the block open.
    channel, final, message, other = START, 2362, END, 7
    think = ThinkTokens(channel, message, opens_in_prompt=True, end_after=(channel, final))
    assert think.token_ids == [channel, channel, final, message]
    with pytest.raises(ValueError, match="first of end_after"):
        ThinkTokens(channel, message, end_after=(channel, final, channel))
    one = engine.tokenizer.encode("1", add_special_tokens=False)[0]
    compiled = engine.grammars.compile(DIGITS)

    def phases(tokens: list[int]) -> list[tuple[str, int]]:
        grammar, seen = engine.grammars.grammar(compiled, think), []
        for t in tokens:
            grammar.advance(t)
            seen.append(tuple(grammar.phase))
        return seen

    assert phases([message, channel, other, final, message, channel, final, other, message, one]) == [
        ("thinking", 0), ("thinking", 1), ("thinking", 0), ("thinking", 0), ("thinking", 0),
        ("thinking", 1), ("thinking", 2), ("thinking", 2), ("closing", 0), ("answer", 0)]
    assert phases([channel, channel, final, message]) == [  # the run's first token starts it over
        ("thinking", 1), ("thinking", 1), ("thinking", 2), ("closing", 0)]
    grammar = engine.grammars.grammar(compiled, think)
    assert grammar.valid_prefix([channel, final, message, one, 7]) == 4
    assert grammar.valid_prefix([channel, final, one]) == 3  # still inside: anything goes
    filler = BitmaskFiller(engine.vocab_size)
    filler.start([grammar], [[channel, final, message]])
    masks = filler.result()
    allowed = [bool((int(masks[row, one // 32]) >> (one % 32)) & 1) for row in range(4)]
    bad = [bool((int(masks[row, other // 32]) >> (other % 32)) & 1) for row in range(4)]
    assert allowed == [True] * 4 and bad == [True, True, True, False]  # the grammar from the body on
    assert grammar.phase == ("thinking", 0)
