"""engine.output_processor without a model: the tests pick each step's tokens, the real
scheduler appends them, and the processor's deltas, ends and stats are checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from processor_builders import EOS, WordTokenizer, make_inputs, make_scheduler, tokens

from engine.config import SpeculativeConfig
from engine.lora_registry import LoRARegistry
from engine.output_processor import OutputProcessor, StepResult
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import PoolingParams, SamplingParams
from engine.speculative import Speculator
from engine.stats import StepStats
from engine.structured import GrammarError
from models.lora import LoRAAdapter

GREEDY = SamplingParams(temperature=0, max_tokens=8)


class ForgetfulProposer:
    """Proposes nothing; remembers which requests it was told to forget."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def propose(self, requests):
        return [[] for _ in requests]

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


class Harness:
    """The engine's step with the model's picks scripted: per sequence id, its next tokens."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.scheduler = make_scheduler(num_blocks=num_blocks)
        self.adapters = LoRARegistry(None, "base", None, {})
        self.inputs = make_inputs(adapters=self.adapters)
        self.proposer = ForgetfulProposer()
        speculator = Speculator(SpeculativeConfig(), 64, self.proposer)
        self.outputs = OutputProcessor(WordTokenizer(), frozenset({EOS}), self.scheduler, self.adapters, speculator)
        self.steps: list[StepStats] = []
        self.outputs.stat_loggers.append(type("Log", (), {"record": lambda _, stats: self.steps.append(stats)})())

    def add(self, request_id: str, prompt: str, params: SamplingParams = GREEDY,
            adapter: str | None = None) -> list[Request]:
        request = self.inputs.prepare(request_id, tokens(prompt), params, adapter=adapter)
        seqs = self.inputs.sequences(request)
        self.outputs.add(request, seqs)
        for seq in seqs:
            self.scheduler.add_request(seq)
        return seqs

    def step(self, picks: dict[str, list[int]] | None = None,
             hidden: dict[str, list[float]] | None = None) -> list[RequestOutput]:
        """One step: ``picks[id]`` the tokens a sampled sequence keeps (default: " nice"),
        ``hidden[id]`` a pooled one's last hidden state."""
        sched = self.scheduler.schedule()
        result = StepResult(StepStats(num_batched_tokens=sched.num_batched_tokens))
        for s in sched.scheduled:
            rid = s.request.request_id
            if s.sample:
                result.last_token_times[rid] = s.request.last_token_time
                result.token_ids[rid] = (picks or {}).get(rid, tokens(" nice"))
            if s.pool:
                result.pooled.append(s.request)
        if result.pooled:
            result.hidden = torch.tensor([hidden[r.request_id] for r in result.pooled])
        updated = self.scheduler.update_from_output(sched, result.token_ids)
        return self.outputs.process(result, updated)


def texts(outputs: list[RequestOutput]) -> dict[tuple[str, int], str]:
    return {(out.request_id, o.index): o.text for out in outputs for o in out.outputs}


def test_text_streams_as_deltas_and_an_eos_ends_it_without_text(assert_scheduler_empty):
    h = Harness()
    h.add("r", "Hello")
    [first] = h.step({"r": tokens(" world")})
    assert (first.outputs[0].text, first.outputs[0].token_ids, first.finished) == (" world", tokens(" world"), False)
    assert first.prompt_token_ids == tokens("Hello")
    [second] = h.step({"r": tokens("!")})
    assert second.outputs[0].text == "!"
    [last] = h.step({"r": [EOS]})
    out = last.outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason, last.finished) == ("", [EOS], "stop", None,
                                                                                           True)
    assert len(h.outputs) == 0 and "r" not in h.outputs
    assert_scheduler_empty(h.scheduler)


def test_a_stop_string_ends_the_request_and_cuts_the_proposals_kept_after_it(assert_scheduler_empty):
    h = Harness()
    [seq] = h.add("r", "Hello", dataclasses.replace(GREEDY, stop=["!"]))
    h.step({"r": tokens(" world")})
    seq.spec_token_ids = tokens("! Paris")  # both proposals accepted, then " is"
    [out] = h.step({"r": tokens("! Paris is")})
    o = out.outputs[0]
    assert (o.text, o.token_ids, o.finish_reason, o.stop_reason, out.finished) == ("", tokens("!"), "stop", "!", True)
    assert seq.output_token_ids == tokens(" world!")  # " Paris is" was never generated
    assert h.steps[-1].num_generation_tokens == 1
    assert_scheduler_empty(h.scheduler)


def test_text_that_may_start_a_stop_string_is_held_back_until_it_does_not():
    h = Harness()
    h.add("r", "Hello", dataclasses.replace(GREEDY, stop=[" world END"], max_tokens=3))
    assert texts(h.step({"r": tokens(" world")})) == {("r", 0): ""}
    assert texts(h.step({"r": tokens("!")})) == {("r", 0): " world!"}
    [last] = h.step({"r": tokens(" world")})  # the length limit: what was held back comes out
    assert (last.outputs[0].text, last.outputs[0].finish_reason) == (" world", "length")


def test_n_samples_finish_the_request_together_and_its_prompt_counts_once():
    h = Harness()
    h.add("r", "Hello world", dataclasses.replace(GREEDY, n=2, max_tokens=3))
    [out] = h.step({"r#0": [EOS], "r#1": tokens(" Paris")})
    assert [(o.index, o.finish_reason) for o in out.outputs] == [(0, "stop"), (1, None)]
    assert not out.finished and "r" in h.outputs
    [out] = h.step({"r#1": tokens(" is")})
    assert [(o.index, o.text) for o in out.outputs] == [(1, " is")] and not out.finished
    [out] = h.step({"r#1": tokens(" nice")})
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert sum(s.num_prompt_tokens for s in h.steps) == 2  # "Hello world": once, not per sample
    assert sum(s.num_generation_tokens for s in h.steps) == 4
    finished = [f for s in h.steps for f in s.finished]
    assert sorted((f.finish_reason, f.num_generation_tokens) for f in finished) == [("length", 3), ("stop", 1)]


def test_latencies_are_time_to_first_token_then_between_tokens():
    h = Harness()
    h.add("r", "Hello", dataclasses.replace(GREEDY, max_tokens=3))
    for _ in range(3):
        h.step()
    assert [(len(s.time_to_first_token), len(s.inter_token_latency)) for s in h.steps] == [(1, 0), (0, 1), (0, 1)]
    assert all(t >= 0 for s in h.steps for t in s.time_to_first_token + s.inter_token_latency)


def test_an_abort_answers_for_the_unfinished_samples_and_is_reported_with_the_next_step(assert_scheduler_empty):
    h = Harness()
    h.add("r", "Hello", dataclasses.replace(GREEDY, n=2))
    h.step({"r#0": [EOS], "r#1": tokens(" world")})
    aborted = h.outputs.abort("r")
    assert aborted.finished and [(o.index, o.finish_reason) for o in aborted.outputs] == [(1, "abort")]
    assert h.outputs.abort("r") is None and h.outputs.abort("never") is None
    assert_scheduler_empty(h.scheduler)
    assert h.step() == []
    assert sorted(f.finish_reason for f in h.steps[-1].finished) == ["abort", "stop"]
    assert h.proposer.forgotten == ["r#0", "r#1"]


def test_a_request_id_is_used_once_while_it_runs():
    h = Harness()
    h.add("r", "Hello")
    with pytest.raises(ValueError, match="request id 'r' is already in use"):
        h.outputs.add(h.inputs.prepare("r", tokens("Hello"), GREEDY), [])
    assert h.scheduler.num_waiting == 1 and len(h.outputs) == 1


def test_a_grammar_fault_fails_its_whole_request_and_nothing_else(assert_scheduler_empty):
    class Refusing:
        finished = False

        def advance(self, token_id: int) -> None:
            raise GrammarError("refused")

    h = Harness()
    bad = h.add("bad", "Hello", dataclasses.replace(GREEDY, n=2))
    h.add("good", "Hello")
    bad[1].grammar = Refusing()
    outputs = {out.request_id: out for out in h.step()}
    assert outputs["bad"].error == "structured output failed: refused"
    assert outputs["bad"].outputs == [] and outputs["bad"].finished
    assert outputs["good"].error is None and outputs["good"].outputs[0].text == " nice"
    assert list(h.outputs.requests) == ["good"]
    assert sorted(f.finish_reason for f in h.steps[-1].finished) == ["abort", "abort"]
    h.outputs.abort("good")
    assert_scheduler_empty(h.scheduler)


def test_an_embedding_is_its_last_hidden_state_cut_and_normalised(assert_scheduler_empty):
    h = Harness()
    h.add("e", "Hello world", SamplingParams(max_tokens=1, pooling=PoolingParams(dimensions=2)))
    h.add("raw", "Hello", SamplingParams(max_tokens=1, pooling=PoolingParams(normalize=False)))
    outputs = {out.request_id: out for out in h.step(hidden={"e": [3.0, 4.0, 12.0], "raw": [1.0, -2.0, 0.5]})}
    [e], [raw] = outputs["e"].outputs, outputs["raw"].outputs
    assert e.embedding == pytest.approx([0.6, 0.8]) and raw.embedding == [1.0, -2.0, 0.5]
    assert (e.finish_reason, outputs["e"].finished) == ("stop", True)
    assert h.steps[-1].num_prompt_tokens == 3 and len(h.steps[-1].finished) == 2
    assert_scheduler_empty(h.scheduler)


def test_gauges_are_the_state_after_the_step_and_counters_what_changed_in_it():
    h = Harness(num_blocks=4)  # 16 tokens in blocks of 4
    h.add("a", "Hello world", dataclasses.replace(GREEDY, max_tokens=2))
    h.add("b", "Hello world! Paris is nice", dataclasses.replace(GREEDY, max_tokens=2))
    h.step()
    assert (h.steps[-1].num_running, h.steps[-1].num_waiting) == (2, 0)
    assert (h.steps[-1].kv_blocks_total, h.steps[-1].kv_blocks_used) == (4, 3)
    h.step()
    assert (h.steps[-1].num_running, h.steps[-1].kv_blocks_used) == (0, 0)
    assert sum(s.prefix_cache_queries for s in h.steps) == len(tokens("Hello world")) + len(
        tokens("Hello world! Paris is nice"))


def test_a_running_adapter_is_counted_and_its_unloaded_weights_go_with_its_last_request():
    h = Harness()
    h.adapters.install(LoRAAdapter("sql", "/a/sql", 4, []), "/a/sql")
    h.add("r", "Hello", dataclasses.replace(GREEDY, max_tokens=2), adapter="sql")
    h.step()
    assert h.steps[-1].lora_running == {"sql": 1}
    h.adapters.remove("sql")
    assert list(h.adapters.weights) == ["sql@1"]
    h.step()
    assert h.adapters.weights == {}

