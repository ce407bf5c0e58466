"""engine.input_processor on a word tokenizer: what a request becomes before it enters the engine."""

from __future__ import annotations

import dataclasses

import pytest
from processor_builders import EOS, WORDS, make_inputs, tokens

from engine import input_processor
from engine.config import EngineConfig
from engine.input_processor import default_max_tokens, sampling_defaults, sampling_overrides
from engine.lora_registry import LoRARegistry
from engine.sampling_params import SamplingParams
from engine.validation import InvalidRequestError
from models.config import ModelConfig
from models.lora import LoRAAdapter

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def model_config(**fields) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=len(WORDS), hidden_size=8, intermediate_size=16,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       max_position_embeddings=32, **fields)


# --- the default sampling ---------------------------------------------------------------------


def test_the_operators_sampling_overrides_the_models_and_max_new_tokens_is_a_length():
    model = model_config(sampling_defaults={"temperature": 0.6, "top_p": 0.9}, max_new_tokens=7)
    config = EngineConfig(override_generation_config={"temperature": 0.1, "max_new_tokens": 3})
    assert sampling_overrides(config) == {"temperature": 0.1}
    assert sampling_defaults(config, model) == {"temperature": 0.1, "top_p": 0.9}
    assert default_max_tokens(config, model) == 3
    assert default_max_tokens(EngineConfig(), model) == 7
    assert sampling_defaults(EngineConfig(generation_config="vllm"), model) == {}


# --- prepare ----------------------------------------------------------------------------------


def test_prepare_resolves_the_length_group_and_arrival():
    processor = make_inputs(max_model_len=32, default_length=5)
    prompt = tokens("Hello world!")
    request = processor.prepare("r", prompt, dataclasses.replace(GREEDY, max_tokens=None), arrival_time=12.5)
    assert (request.request_id, request.prompt_token_ids, request.max_tokens) == ("r", prompt, 5)
    assert (request.group, request.arrival_time) == ("r", 12.5)
    assert request.prompt_token_ids is not prompt  # the caller's list stays the caller's
    grouped = processor.prepare("r2", prompt, GREEDY, group="api-1")
    assert (grouped.group, grouped.max_tokens) == ("api-1", 4)
    assert (grouped.adapter, grouped.lora, grouped.grammar, grouped.dry_breakers) == (None, None, None, {})


def test_prepare_refuses_what_can_never_run():
    processor = make_inputs(max_model_len=4)
    with pytest.raises(InvalidRequestError) as err:
        processor.prepare("r", tokens("Hello world! Paris"), GREEDY)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as err:
        processor.prepare("r", [len(WORDS)], GREEDY)
    assert err.value.param == "prompt"


def test_bad_words_are_their_tokens_alone_and_after_a_space():
    processor = make_inputs()
    params = dataclasses.replace(GREEDY, bad_words=["Paris", " world", " Paris is", "Paris"])
    request = processor.prepare("r", tokens("Hello"), params)
    paris, space_paris, world, is_ = (WORDS.index(w) for w in ("Paris", " Paris", " world", " is"))
    # A word that starts with a space is there once; a repeated word once too.
    assert request.bad_words_token_ids == ((paris,), (space_paris,), (world,), (space_paris, is_))


def test_bad_words_that_do_not_tokenize_fail_the_request():
    with pytest.raises(ValueError, match="no token spells"):
        make_inputs().prepare("r", tokens("Hello"), dataclasses.replace(GREEDY, bad_words=["Rome"]))


def test_dry_breakers_are_the_vocabularys_tokens_found_once_per_set():
    processor = make_inputs()
    params = dataclasses.replace(GREEDY, dry_multiplier=0.8, dry_sequence_breakers=["\n", " x!"])
    first = processor.prepare("a", tokens("Hello"), params).dry_breakers
    newline, both, x, bang = WORDS.index("\n"), WORDS.index("x\ny"), WORDS.index(" x"), WORDS.index("!")
    # A token holding a breaker is a breaker alone; " x" is the head of " x!", whose tail is "!".
    assert first == {newline: ((),), both: ((),), x: ((bang,),)}
    assert processor.prepare("b", tokens("Hello"), params).dry_breakers is first  # no second scan


def test_only_the_latest_dry_breaker_sets_are_kept(monkeypatch):
    monkeypatch.setattr(input_processor, "DRY_BREAKER_SETS_KEPT", 2)
    processor = make_inputs()
    sets = [("\n",), ("!",), (" x!",)]
    found = [processor.dry_breakers(s) for s in sets]
    assert processor.dry_breakers(sets[2]) is found[2]
    assert processor.dry_breakers(sets[1]) is found[1]
    again = processor.dry_breakers(sets[0])  # the oldest went: found anew, equal
    assert again == found[0] and again is not found[0]


# --- adapters ---------------------------------------------------------------------------------


def test_a_request_runs_its_adapters_key_and_holds_its_weights():
    weights: dict[str, LoRAAdapter] = {}
    adapters = LoRARegistry(None, "base", None, weights)
    sql = LoRAAdapter("sql", "/adapters/sql", 4, [])
    adapters.install(sql, "/adapters/sql")
    processor = make_inputs(adapters=adapters)
    request = processor.prepare("r", tokens("Hello"), GREEDY, adapter="sql")
    assert (request.adapter, request.lora) == ("sql@1", sql)
    adapters.remove("sql")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'sql'") as err:
        processor.prepare("r2", tokens("Hello"), GREEDY, adapter="sql")
    assert err.value.param == "adapter"


# --- sequences --------------------------------------------------------------------------------


def test_n_samples_get_their_own_ids_and_share_the_requests_settings():
    processor = make_inputs()
    params = dataclasses.replace(GREEDY, n=3, seed=7, bad_words=["Paris"])
    request = processor.prepare("r", tokens("Hello world"), params, group="g")
    seqs = processor.sequences(request)
    assert [s.request_id for s in seqs] == ["r#0", "r#1", "r#2"]
    assert [s.sample_index for s in seqs] == [0, 1, 2]
    for seq in seqs:
        assert (seq.prompt_token_ids, seq.max_tokens, seq.group, seq.eos_token_ids) == (
            tokens("Hello world"), 4, "g", frozenset({EOS}))
        assert seq.bad_words_token_ids == request.bad_words_token_ids
        assert seq.prompt_token_ids is not request.prompt_token_ids  # each sample grows its own
    # Each sample draws from its own stream of the seed.
    assert seqs[0].generator.initial_seed() == 7 and seqs[2].generator.initial_seed() == 9
    [alone] = processor.sequences(processor.prepare("s", tokens("Hello"), GREEDY))
    assert alone.request_id == "s"
