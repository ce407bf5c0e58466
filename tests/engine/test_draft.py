"""Speculative decoding with a draft model: the same answers, its own KV cache kept right.

A draft equal to the target must propose exactly what the target then picks
(every greedy proposal accepted: a check of the verification path and of the
draft's cache); a random draft with the target's vocabulary has most of its
proposals rejected, and the answers must still be the target's own. The
draft's cache must survive rejections: after them it proposes what a fresh
draft, computing everything again, proposes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.draft import DraftProposer
from engine.sampling_params import SamplingParams
from models.loader import load_model
from tests.engine.test_speculative import QUOTES, accepted, make_engine, run


# smollm2_loaded: the default model on its served path (tests/conftest.py)
SERVED_PATH = True

pytestmark = pytest.mark.slow


def draft_spec(**overrides) -> SpeculativeConfig:
    return SpeculativeConfig(**{"method": "draft", "draft_model": "smollm2", "max_batch": 8} | overrides)


@pytest.fixture(scope="module")
def prompts(smollm2_loaded) -> list[list[int]]:
    return [smollm2_loaded.tokenizer.encode(q) for q in QUOTES]


@pytest.fixture(scope="module")
def random_draft(smollm2_loaded, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's vocabulary (its tokenizer.json): a poor draft."""
    import transformers

    path: Path = tmp_path_factory.mktemp("draft")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=smollm2_loaded.config.vocab_size, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(smollm2_loaded.tokenizer.to_json())
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return load_model(str(path), "float32", "cpu")


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(smollm2_loaded, prompts):
    greedy = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)]
    plain = run(make_engine(smollm2_loaded), prompts, greedy)
    engine = make_engine(smollm2_loaded, speculative=draft_spec(), draft=smollm2_loaded)
    assert run(engine, prompts, greedy) == plain
    proposed, kept = accepted(engine)
    assert proposed > 40 and kept == proposed, (proposed, kept)
    proposer = engine.speculator.proposer
    assert proposer.num_free_blocks == engine.num_blocks  # every draft block back


def test_a_poor_draft_keeps_the_targets_answers(smollm2_loaded, prompts, random_draft):
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=30, stop=["fish"]),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30, logprobs=1),
              SamplingParams(temperature=0, max_tokens=20, logprobs=2)]
    batch = prompts + [prompts[0]]
    plain = run(make_engine(smollm2_loaded), batch, params)
    # min_acceptance 0: keep proposing whatever is rejected.
    engine = make_engine(smollm2_loaded, speculative=draft_spec(min_acceptance=0.0), draft=random_draft)
    assert run(engine, batch, params) == plain
    proposed, kept = accepted(engine)
    assert proposed > 100 and kept < proposed // 2, (proposed, kept)
    assert engine.speculator.proposer.num_free_blocks == engine.num_blocks


def test_the_draft_cache_after_rejections_proposes_what_a_fresh_draft_does(smollm2_loaded, prompts):
    """The proposer keeps what its cache holds of a sequence that went another way
    and recomputes the rest: the proposals equal those of a proposer that never
    saw the sequence before. In the engine a sequence parts from the draft's at
    its last token (the target's own pick after the proposals it kept); here it
    also parts a few tokens earlier, which only the common-prefix check handles."""
    kv_dtype = torch.float32
    kept = DraftProposer(smollm2_loaded, 64, 16, kv_dtype, num_tokens=4, vocab_size=49152, max_catch_up=512)
    tokens = list(prompts[0])
    rng = torch.Generator().manual_seed(0)
    for step in range(12):
        proposal = kept.propose([("a", tokens, 4)])[0]
        fresh = DraftProposer(smollm2_loaded, 64, 16, kv_dtype, num_tokens=4, vocab_size=49152, max_catch_up=512)
        assert proposal == fresh.propose([("a", tokens, 4)])[0], step
        # The target keeps a random part of the proposal, then a token of its own.
        n = int(torch.randint(0, len(proposal) + 1, (1,), generator=rng))
        tokens = tokens + proposal[:n] + [int(torch.randint(0, 49152, (1,), generator=rng))]
        if step % 3 == 2:  # a sequence that parts from the cached one 4 tokens before its end
            tokens = tokens[:-4] + torch.randint(0, 49152, (4,), generator=rng).tolist()
    kept.forget("a")
    assert kept.num_free_blocks == 64


def test_a_long_prompt_reaches_the_draft_over_several_steps(smollm2_loaded, prompts):
    """With a catch-up budget of 16 tokens a 100-token sequence is fed over 7 calls
    without proposals, then proposes what an unbounded draft does; a second
    request behind it waits for the budget."""
    kv_dtype = torch.float32
    tokens = (prompts[0] * 3)[:100]
    short = prompts[1][:10]
    bounded = DraftProposer(smollm2_loaded, 64, 16, kv_dtype, num_tokens=3, vocab_size=49152, max_catch_up=16)
    calls = 0
    while (got := bounded.propose([("long", tokens, 3), ("short", short, 3)]))[0] == []:
        calls += 1
        assert got[1] == [], calls  # the long one, first in line, takes the whole budget
    assert calls == 6  # 6 x 16 tokens, then the last 4 and the proposals
    free = DraftProposer(smollm2_loaded, 64, 16, kv_dtype, num_tokens=3, vocab_size=49152, max_catch_up=512)
    assert got == free.propose([("long", tokens, 3), ("short", short, 3)])
    assert len(got[0]) == 3 and len(got[1]) == 3


def test_aborts_and_preemption_give_the_draft_blocks_back(smollm2_loaded, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine = make_engine(smollm2_loaded, num_blocks=16, max_model_len=256, speculative=draft_spec(),
                         draft=smollm2_loaded)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    for _ in range(6):
        engine.step()
    engine.abort_request("r1")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.stats.num_blocks_used == 0
    assert engine.speculator.proposer.num_free_blocks == engine.num_blocks
    assert accepted(engine)[0] > 0


def test_a_draft_needs_the_targets_vocabulary(smollm2_loaded, tiny_draft_other_vocab):
    with pytest.raises(ValueError, match="another vocabulary"):
        make_engine(smollm2_loaded, speculative=draft_spec(), draft=tiny_draft_other_vocab)
    with pytest.raises(ValueError, match="needs one"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="goes with speculative 'draft'"):
        SpeculativeConfig(method="ngram", draft_model="smollm2")


@pytest.fixture(scope="module")
def tiny_draft_other_vocab(tmp_path_factory):
    """A tiny random checkpoint with a word-level vocabulary of 128 tokens."""
    from tests.models.conftest import save_tiny_tokenizer, tiny_hf_model

    path = tmp_path_factory.mktemp("other-vocab")
    tiny_hf_model().save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path)
    return load_model(str(path), "float32", "cpu")


def test_sampled_structured_answers_are_the_same_with_a_draft(smollm2_loaded):
    # A draft proposes the end of a JSON answer and then its end of text; the grammar's
    # masks after proposals must leave each sample's matcher as it was (before the fix, one
    # sample's matcher broke on such a proposal and took the engine loop down with it).
    from engine.sampling_params import StructuredOutput

    tok = smollm2_loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say a word."}]),
                        add_special_tokens=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    params = [SamplingParams(n=8, temperature=1.0, presence_penalty=2.0, frequency_penalty=0.5, min_tokens=10,
                             max_tokens=20, seed=0, structured=StructuredOutput("json", schema))]
    plain = run(make_engine(smollm2_loaded), [prompt], params)
    engine = make_engine(smollm2_loaded, speculative=draft_spec(), draft=smollm2_loaded)
    assert run(engine, [prompt], params) == plain
    assert sum(1 for tokens, text, reason, _ in plain if reason == "stop") >= 4  # answers that ended
    draft, kept = accepted(engine)
    assert kept > 0, (kept, draft)
