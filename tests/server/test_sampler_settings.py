"""engine.sampler_settings: one table feeds SamplingParams, the request bodies,
llama.cpp's /completion (fields, defaults, generation_settings) and
--override-generation-config; each place carries every setting, under the table's
name, default and rule."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import GENERATION_CONFIG_KEYS, EngineConfig
from engine.sampler_settings import BY_NAME, LLAMACPP_SETTINGS, SETTINGS
from engine.sampling_params import SamplingParams
from server.protocol import CompletionRequest
from server.protocol_chat import ChatCompletionRequest
from server.serving_llamacpp import LLAMACPP_DEFAULTS, LlamaCppCompletionRequest

# A value each setting refuses (None: it has no rule), and the text its message holds.
BAD = {"temperature": -0.5, "top_p": 0.0, "top_k": -2, "min_p": 1.5, "repetition_penalty": 0.0,
       "presence_penalty": 2.5, "frequency_penalty": -3.0, "repeat_last_n": -2, "typical_p": 0.0,
       "temperature_last": None, "dynatemp_range": -1.0, "dynatemp_exponent": 0.0, "top_n_sigma": None,
       "xtc_probability": 1.5, "xtc_threshold": -0.1, "dry_multiplier": -1.0, "dry_base": 0.5,
       "dry_allowed_length": 0, "dry_penalty_last_n": -2, "dry_sequence_breakers": None, "mirostat": 3,
       "mirostat_tau": -1.0, "mirostat_eta": -0.1}


def test_every_setting_is_a_sampling_params_field_with_the_tables_default() -> None:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams()
    assert set(BAD) == set(BY_NAME)
    for s in SETTINGS:
        assert s.name in fields
        expected = list(s.default) if isinstance(s.default, tuple) else s.default
        assert getattr(params, s.name) == expected, s.name


@pytest.mark.parametrize("name", [n for n, v in BAD.items() if v is not None])
def test_each_rule_refuses_its_bad_value_by_name(name: str) -> None:
    with pytest.raises(ValueError) as refused:
        SamplingParams(**{name: BAD[name]})
    assert str(refused.value) == f"{name} must be {BY_NAME[name].rule}, got {BAD[name]!r}"


@pytest.mark.parametrize("name", [s.name for s in SETTINGS if s.kind == "float"])
def test_a_float_setting_must_be_finite(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: float("nan")})


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_the_openai_bodies_take_every_setting_as_an_optional_field(model: type) -> None:
    for s in SETTINGS:
        assert s.name in model.model_fields and model.model_fields[s.name].default is None, s.name


def test_a_setting_sent_reaches_the_engine() -> None:
    sent = {"temperature": 0.3, "top_k": 7, "repetition_penalty": 1.2, "dry_multiplier": 0.8,
            "dry_sequence_breakers": ["\n"], "mirostat": 2, "temperature_last": True, "repeat_last_n": 32}
    params = CompletionRequest(prompt="x", **sent).sampling_params()
    for name, value in sent.items():
        assert getattr(params, name) == value, name


def test_llamacpp_takes_each_setting_by_its_name_and_default_and_reports_it_back() -> None:
    assert LLAMACPP_SETTINGS["repeat_penalty"].name == "repetition_penalty"
    assert "temperature_last" not in LLAMACPP_SETTINGS  # llama.cpp always divides last
    body = LlamaCppCompletionRequest(prompt="x", repeat_penalty=1.3, top_k=5, dry_base=2.0)
    for name, s in LLAMACPP_SETTINGS.items():
        assert LlamaCppCompletionRequest.model_fields[name].default == s.llamacpp_value == LLAMACPP_DEFAULTS[name]
    assert (LLAMACPP_DEFAULTS["temperature"], LLAMACPP_DEFAULTS["top_k"], LLAMACPP_DEFAULTS["repeat_last_n"]) == (0.8, 40, 64)
    completion = body.as_completion([[1, 2]], tok=None)  # type: ignore[arg-type]
    params = completion.sampling_params()
    assert (params.repetition_penalty, params.top_k, params.dry_base, params.temperature) == (1.3, 5, 2.0, 0.8)
    settings = body.generation_settings(params, 2048, "m")
    for name, s in LLAMACPP_SETTINGS.items():
        assert settings[name] == getattr(params, s.name), name


def test_override_generation_config_takes_every_setting_and_checks_its_type() -> None:
    assert set(BY_NAME) <= set(GENERATION_CONFIG_KEYS)
    config = EngineConfig(model="m", override_generation_config={"dry_allowed_length": 3, "xtc_threshold": 0.2,
                                                                  "temperature_last": True})
    assert config.override_generation_config["dry_allowed_length"] == 3
    for name, value, kind in [("dry_allowed_length", 2.5, "an integer"), ("temperature_last", 1, "true or false"),
                              ("dry_sequence_breakers", "x", "a list of strings"), ("top_p", "0.5", "a number")]:
        with pytest.raises(ValueError, match=f"override_generation_config's {name} must be {kind}"):
            EngineConfig(model="m", override_generation_config={name: value})
