"""The sampler settings: one table of every sampling knob a request may turn.

Each ``SamplerSetting`` is a field of ``SamplingParams`` (its default and the rule its
values keep), an optional field of the OpenAI-style request bodies (``server.protocol``:
None there means the default), a field of llama.cpp's ``/completion`` under llama.cpp's
name and default (``server.serving_llamacpp``, which also reports them back in its
``generation_settings``), and a key of ``--override-generation-config``
(``engine.config``). A new knob is one row here and its use in ``engine/sampler.py``.

Not here: what is not a knob of the sampling distribution (``n``, ``seed``, stop
conditions, lengths, logprobs, structured outputs) and llama.cpp's ``samplers`` chain,
which orders the knobs rather than being one (``SamplingParams.samplers``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# llama.cpp's DRY defaults: the strings that end a repeat (a newline, a colon, a quote, an asterisk).
DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")

_SAME = object()  # llama.cpp's default is kvserve's


@dataclass(frozen=True)
class SamplerSetting:
    """One sampling knob.

    ``kind`` is ``float``, ``int``, ``bool`` or ``strings`` (a list of texts); ``rule``
    says in words which values ``ok`` accepts (a ``ValueError`` reads "NAME must be
    RULE, got VALUE"). ``llamacpp`` is llama.cpp's name for it on ``/completion`` (None:
    llama.cpp's request has no such field) and ``llamacpp_default`` its default there.
    """

    name: str
    kind: str
    default: Any
    rule: str = ""
    ok: Callable[[Any], bool] | None = None
    llamacpp: str | None = ""  # "": the same name
    llamacpp_default: Any = _SAME

    @property
    def annotation(self) -> Any:
        """The Python type of its values (what the request bodies declare)."""
        return {"float": float, "int": int, "bool": bool, "strings": list[str]}[self.kind]

    @property
    def llamacpp_name(self) -> str | None:
        """Its name in llama.cpp's ``/completion`` body (None: not one of its fields)."""
        return self.name if self.llamacpp == "" else self.llamacpp

    @property
    def llamacpp_value(self) -> Any:
        """Its default on llama.cpp's ``/completion``."""
        value = self.default if self.llamacpp_default is _SAME else self.llamacpp_default
        return list(value) if isinstance(value, tuple) else value

    def check(self, value: Any) -> None:
        """Raise ``ValueError`` for a value this setting does not take (a float must be finite)."""
        if self.kind == "float" and not math.isfinite(value):
            raise ValueError(f"{self.name} must be a finite number, got {value}")
        if self.ok is not None and value is not None and not self.ok(value):
            raise ValueError(f"{self.name} must be {self.rule}, got {value!r}")



def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low


_PROBABILITY = ("in [0, 1]", lambda v: 0 <= v <= 1)
_OPEN_PROBABILITY = ("in (0, 1]", lambda v: 0 < v <= 1)
_PENALTY = ("in [-2, 2]", lambda v: -2 <= v <= 2)
_WINDOW = ("-1 (all) or >= 0", _at_least(-1))

# In SamplingParams' order. The comments in SamplingParams say what each does.
SETTINGS: tuple[SamplerSetting, ...] = (
    SamplerSetting("temperature", "float", 1.0, ">= 0", _at_least(0), llamacpp_default=0.8),
    SamplerSetting("top_p", "float", 1.0, *_OPEN_PROBABILITY, llamacpp_default=0.95),
    # (-1 also turns it off: SamplingParams makes it 0 before the check)
    SamplerSetting("top_k", "int", 0, "-1 (disabled) or >= 1", _at_least(0), llamacpp_default=40),
    SamplerSetting("min_p", "float", 0.0, *_PROBABILITY, llamacpp_default=0.05),
    SamplerSetting("repetition_penalty", "float", 1.0, "> 0", lambda v: v > 0, llamacpp="repeat_penalty"),
    SamplerSetting("presence_penalty", "float", 0.0, *_PENALTY),
    SamplerSetting("frequency_penalty", "float", 0.0, *_PENALTY),
    SamplerSetting("repeat_last_n", "int", None, *_WINDOW, llamacpp_default=64),
    SamplerSetting("typical_p", "float", 1.0, *_OPEN_PROBABILITY),
    SamplerSetting("temperature_last", "bool", False, llamacpp=None),  # llama.cpp's is always so
    SamplerSetting("dynatemp_range", "float", 0.0, ">= 0", _at_least(0)),
    SamplerSetting("dynatemp_exponent", "float", 1.0, "> 0", lambda v: v > 0),
    SamplerSetting("top_n_sigma", "float", -1.0),
    SamplerSetting("xtc_probability", "float", 0.0, *_PROBABILITY),
    SamplerSetting("xtc_threshold", "float", 0.1, *_PROBABILITY),
    SamplerSetting("dry_multiplier", "float", 0.0, ">= 0", _at_least(0)),
    SamplerSetting("dry_base", "float", 1.75, ">= 1", _at_least(1)),
    SamplerSetting("dry_allowed_length", "int", 2, ">= 1", _at_least(1)),
    SamplerSetting("dry_penalty_last_n", "int", -1, *_WINDOW),
    SamplerSetting("dry_sequence_breakers", "strings", DRY_SEQUENCE_BREAKERS),
    SamplerSetting("mirostat", "int", 0, "0 (off), 1 or 2",
                   lambda v: v in (0, 1, 2) and not isinstance(v, bool)),
    SamplerSetting("mirostat_tau", "float", 5.0, ">= 0", _at_least(0)),
    SamplerSetting("mirostat_eta", "float", 0.1, ">= 0", _at_least(0)),
)

BY_NAME = {s.name: s for s in SETTINGS}
# The settings llama.cpp's /completion takes, by their llama.cpp names.
LLAMACPP_SETTINGS = {s.llamacpp_name: s for s in SETTINGS if s.llamacpp_name is not None}


def type_error(kind: str, value: Any) -> str | None:
    """What is wrong with ``value``'s type for a setting of ``kind``, for a configuration
    read from JSON (``--override-generation-config``); None when it fits."""
    if kind == "strings":
        ok, kind_text = isinstance(value, list) and all(isinstance(v, str) for v in value), "a list of strings"
    elif kind == "bool":
        ok, kind_text = isinstance(value, bool), "true or false"
    elif kind == "int":
        ok, kind_text = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:
        ok, kind_text = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    return None if ok else kind_text


def default(name: str) -> Any:
    """A setting's default (``SamplingParams``' field default)."""
    return BY_NAME[name].default
