"""LoRA on a mixture's routed experts: the two forms PEFT saves it in, read into one update
per expert and projection, and the view through which an expert's forward adds the updates
of its rows' adapters (``ExpertRows``).

PEFT writes an expert's update in one of two forms:

* per expert module (transformers 4's experts, each an MLP of linear layers; Mixtral's
  w1 / w3 / w2): ``layers.L.mlp.experts.E.gate_proj.lora_A.weight`` ``[r, H]`` and its
  ``lora_B`` ``[I, r]``, as a dense MLP's;
* on the stacked parameters (``target_parameters``; transformers 5 stacks a layer's experts
  as ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``, and PEFT
  0.22 targets them for an MoE's gate/up/down): per parameter ``lora_A`` ``[r E, in]``
  (expert e's rows ``e r .. e r + r - 1``) and ``lora_B`` ``[out, r E]`` (expert e's columns
  every E-th from e: PEFT's ``ParamWrapper`` views it ``[out, r, E]``). A second parameter of
  the module nests its wrapper (``experts.base_layer.lora_A``), so the shapes tell which is
  which: gate_up's A reads H inputs and its B writes 2I rows, down's A reads I and its B H.

Either way expert e's projection gains ``s B_e A_e`` (``s = alpha / r``, or ``/ sqrt(r)``
with rsLoRA), as a dense projection does. gpt-oss stacks its experts for ``x @ W`` with gate
and up interleaved: its gate_up B rows are put in the model's order (gate rows, then up).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from models.config import ModelConfig

# An expert's LoRA tensor: layer, then (per module) the expert and its module, or (on the
# stacked parameters) the wrappers' nesting, or Qwen2-MoE's shared expert's module; A or B.
EXPERT_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:experts(?:\.(\d+)\.(\w+)"
                           r"|((?:\.base_layer)*))|shared_expert\.(\w+))\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# The expert id under which an adapter's updates of the shared expert are kept.
SHARED = -1
# An expert module's projection -> (the model's fused projection, place in it).
_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}

# (layer, expert) -> fused projection -> (A [r, in], B [out, r], the scale in B), float32.
ExpertPairs = dict[tuple[int, int], dict[str, tuple[torch.Tensor, torch.Tensor]]]


# An MoE block's tensors in a llama.cpp GGUF adapter (``convert_lora_to_gguf.py`` stacks the
# experts' A and B as the base model's experts: ``[E, r, in]`` and ``[E, out, r]``, as its
# ``build_lora_mm_id`` reads them) -> the expert module's projection under PEFT's names.
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_SHARED = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj", "ffn_down_shexp": "down_proj"}
# ... and the routers, named so that the adapter's reading refuses them as a router's.
_GGUF_ROUTERS = {"ffn_gate_inp": "gate", "ffn_gate_inp_shexp": "shared_expert_gate"}


def gguf_expert_tensors(name: str, tensor: str, layer: int, kind: str, ab: str, w: torch.Tensor,
                        config: ModelConfig) -> list[tuple[str, torch.Tensor]] | None:
    """GGUF adapter tensor ``tensor`` (``blk.{layer}.{kind}.weight.lora_{ab}``, values ``w``)
    under PEFT's per-module names, one an expert for a stacked one; None where ``kind`` is not
    an MoE block's. Raises ``ValueError`` naming the tensor where it cannot fit the model."""
    prefix = f"model.layers.{layer}.mlp"
    suffix = f"lora_{ab.upper()}.weight"
    if kind in _GGUF_ROUTERS:
        return [(f"{prefix}.{_GGUF_ROUTERS[kind]}.{suffix}", w)]
    if kind in _GGUF_SHARED:
        return [(f"{prefix}.shared_expert.{_GGUF_SHARED[kind]}.{suffix}", w)]
    if kind == "ffn_gate_up_exps":
        raise ValueError(f"LoRA adapter {name!r}: tensor {tensor!r} updates fused gate_up experts, which kvserve "
                         "reads from ffn_gate_exps / ffn_up_exps / ffn_down_exps only")
    if kind not in _GGUF_EXPERTS:
        return None
    experts = config.moe.num_experts if config.moe is not None else 0
    if w.dim() != 3 or w.shape[0] != experts:
        raise ValueError(f"LoRA adapter {name!r}: tensor {tensor!r} has shape {tuple(w.shape)}; this model's "
                         f"{experts} experts take [{experts}, r, in] (lora_a) and [{experts}, out, r] (lora_b)")
    return [(f"{prefix}.experts.{e}.{_GGUF_EXPERTS[kind]}.{suffix}", w[e]) for e in range(experts)]


class _Update(Protocol):
    def delta(self, x: torch.Tensor) -> torch.Tensor: ...


def read_expert_updates(name: str, tensors: list[tuple[str, re.Match[str], torch.Tensor]], config: ModelConfig,
                        scale: Callable[[str, int], float]) -> tuple[ExpertPairs, int]:
    """The updates of ``tensors`` (each with its ``EXPERT_TENSOR`` match), per expert, and
    the largest rank of a module among them; ``scale(module, r)``: the adapter's scale of a
    module of rank r. Raises ``ValueError`` naming the tensor or projection whose shape does
    not fit the model."""
    moe = config.moe
    assert moe is not None
    found: dict[tuple, dict[str, torch.Tensor]] = {}  # (layer, expert, module) or (layer, nesting) -> A, B
    module_of: dict[tuple, str] = {}  # -> its module's name (alpha_pattern's key)
    for key, m, tensor in tensors:
        layer = int(m.group(1))
        if layer >= config.num_hidden_layers or not moe.is_sparse(layer):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} updates experts of layer {layer}, "
                             "which has none")
        if m.group(2) is not None and (m.group(3) not in _PARTS or int(m.group(2)) >= moe.num_experts):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} updates no projection of the model's "
                             f"{moe.num_experts} experts")
        if m.group(5) is not None and (m.group(5) not in _PARTS or not moe.shared_expert_size):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} updates no projection of a shared expert")
        where = ((layer, int(m.group(2)), m.group(3)) if m.group(2) is not None
                 else (layer, SHARED, m.group(5)) if m.group(5) is not None else (layer, m.group(4)))
        found.setdefault(where, {})[m.group(6)] = tensor
        module_of[where] = key[:m.start(6) - len(".lora_")].removeprefix("base_model.model.").replace(
            ".base_layer", "")
    for where, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module_of[where]} has lora_{''.join(ab)} "
                             f"without lora_{'B' if 'A' in ab else 'A'}")
    pairs: ExpertPairs = {}
    rank = _per_module(name, {w: ab for w, ab in found.items() if len(w) == 3}, config, module_of, scale, pairs)
    rank = max(rank, _stacked(name, {w: ab for w, ab in found.items() if len(w) == 2}, config, module_of, scale,
                              pairs))
    return pairs, rank


def pair_rank(name: str, where: str, a: torch.Tensor, b: torch.Tensor, out_features: int, in_features: int) -> int:
    """The rank of a projection's ``lora_A`` ``a`` and ``lora_B`` ``b``, or ``ValueError``
    naming ``where`` when they do not fit its ``[out_features, in_features]`` weight."""
    r = a.shape[0] if a.dim() == 2 else 0
    if r < 1 or b.dim() != 2 or a.shape[1] != in_features or tuple(b.shape) != (out_features, r):
        raise ValueError(f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)}, expected ({r}, {in_features}) and ({out_features}, {r}) for this model")
    return r


def _per_module(name: str, found: dict[tuple, dict[str, torch.Tensor]], config: ModelConfig,
                module_of: dict[tuple, str], scale: Callable[[str, int], float], pairs: ExpertPairs) -> int:
    """Updates of experts' modules (``(layer, expert, module)`` -> A, B) into ``pairs``, gate
    and up stacked as a dense MLP's; returns their largest rank."""
    h = config.hidden_size
    parts: dict[tuple[int, int], dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]] = {}
    rank = 0
    for (layer, expert, module), ab in sorted(found.items()):
        fused, idx = _PARTS[module]
        a, b = ab["A"], ab["B"]
        i = config.moe.shared_expert_size if expert == SHARED else config.moe.expert_size
        shape = (i, h) if fused == "gate_up_proj" else (h, i)  # (out, in): a gate's or an up's, or down's
        where = f"layer {layer} {'shared expert' if expert == SHARED else f'expert {expert}'} {module}"
        r = pair_rank(name, where, a, b, *shape)
        rank = max(rank, r)
        both = parts.setdefault((layer, expert), {}).setdefault(fused, [None, None] if fused == "gate_up_proj"
                                                                       else [None])
        both[idx] = (a, b * scale(module_of[(layer, expert, module)], r))
    for (layer, expert), by_proj in parts.items():
        for fused, both in by_proj.items():
            size = next(p[1].shape[0] for p in both if p is not None)  # (a gate's and an up's rows alike)
            pairs.setdefault((layer, expert), {})[fused] = stack_parts(both, [size] * len(both))
    return rank


def _stacked(name: str, found: dict[tuple, dict[str, torch.Tensor]], config: ModelConfig,
             module_of: dict[tuple, str], scale: Callable[[str, int], float], pairs: ExpertPairs) -> int:
    """Updates of the stacked parameters (``(layer, nesting)`` -> A, B) into ``pairs``, one
    per expert; returns their largest rank."""
    h, i, experts = config.hidden_size, config.moe.expert_size, config.moe.num_experts
    rank = 0
    for (layer, nesting), ab in sorted(found.items()):
        a, b = ab["A"], ab["B"]
        kind = {(h, 2 * i): "gate_up_proj", (i, h): "down_proj"}.get(
            (a.shape[-1], b.shape[0]) if a.dim() == b.dim() == 2 else None)
        if kind is None or a.shape[0] % experts or b.shape[1] != a.shape[0] or a.shape[0] == 0:
            raise ValueError(f"LoRA adapter {name!r}: {module_of[(layer, nesting)]} has lora_A {tuple(a.shape)} "
                             f"and lora_B {tuple(b.shape)}; this model's {experts} experts take ({experts} r, "
                             f"{h}) and ({2 * i}, {experts} r) for gate_up_proj, ({experts} r, {i}) and "
                             f"({h}, {experts} r) for down_proj")
        r = a.shape[0] // experts
        # (PEFT matches alpha_pattern against the module's name and the parameter's)
        rank, s = max(rank, r), scale(f"{module_of[(layer, nesting)]}.{kind}", r)
        for e, (a_e, b_e) in enumerate(zip(a.view(experts, r, -1), b.view(b.shape[0], r, experts).unbind(2))):
            if kind == "gate_up_proj" and config.architecture == "GptOssForCausalLM":  # (gate, up interleaved)
                b_e = torch.cat([b_e[0::2], b_e[1::2]])
            if kind in pairs.get((layer, e), {}):
                raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s experts' {kind} is updated twice")
            pairs.setdefault((layer, e), {})[kind] = (a_e.clone(), b_e * s)
    return rank


def stack_parts(parts: list[tuple[torch.Tensor, torch.Tensor] | None], sizes: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One update ``(A, B)`` of a fused projection from its parts' ``(A, B)`` (None: not
    targeted) of ``sizes`` rows each: the A matrices one above the other, B block-diagonal,
    parts absent left zero."""
    a = torch.cat([p[0] for p in parts if p is not None])
    b = torch.zeros(sum(sizes), a.shape[0])
    row = col = 0
    for size, part in zip(sizes, parts):
        if part is not None:
            r = part[0].shape[0]
            b[row:row + size, col:col + r] = part[1]
            col += r
        row += size
    return a, b


class ExpertStack(NamedTuple):
    """An adapter's updates of one projection of a layer's routed experts, as
    ``ops.lora_expert_rows`` takes them: ``a [E, r, in]`` and ``bt [E, r, out]`` (B
    transposed, the scale in it; a smaller rank padded with zeros), float32, and which
    experts it updates (``has [E]``)."""

    a: torch.Tensor
    bt: torch.Tensor
    has: torch.Tensor


def stack_experts(pairs: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]], experts: int
                  ) -> dict[str, ExpertStack]:
    """A layer's routed experts' ``(A, B)`` pairs (expert -> projection -> pair) stacked per
    projection."""
    stacks = {}
    for proj in ("gate_up_proj", "down_proj"):
        mine = {e: by_proj[proj] for e, by_proj in pairs.items() if proj in by_proj and e != SHARED}
        if not mine:
            continue
        r = max(a.shape[0] for a, _ in mine.values())
        a0, b0 = next(iter(mine.values()))
        a, bt = torch.zeros(experts, r, a0.shape[1]), torch.zeros(experts, r, b0.shape[0])
        for e, (a_e, b_e) in mine.items():
            a[e, :a_e.shape[0]], bt[e, :a_e.shape[0]] = a_e, b_e.T
        has = torch.zeros(experts, dtype=torch.bool)
        has[list(mine)] = True
        stacks[proj] = ExpertStack(a, bt, has)
    return stacks


class ExpertUpdates(Mapping[int, dict[str, _Update]]):
    """An adapter's updates of one layer's experts, ``expert -> projection -> update``
    (``SHARED``: the shared expert's, made when read). A routed expert's are made from the
    kernels' stacks (``ExpertStack``) the first time its own call asks for them (``[e]``,
    ``get``): where the kernels hold the experts they never do, so the adapter's experts are
    held once. ``ranks``: each ``(expert, projection)``'s own rank (a stack pads to the
    largest); ``make(a, b)``: an update of ``A``, ``B`` (``models.lora.LoRAUpdate``)."""

    def __init__(self, stacks: dict[str, ExpertStack], ranks: dict[tuple[int, str], int],
                 shared: dict[str, _Update], make: Callable[[torch.Tensor, torch.Tensor], _Update]) -> None:
        self._stacks, self._ranks, self._make = stacks, ranks, make
        self._made: dict[int, dict[str, _Update]] = {SHARED: shared} if shared else {}
        self._ids = sorted({e for e, _ in ranks} | set(self._made))

    def __getitem__(self, expert: int) -> dict[str, _Update]:
        if expert not in self._made:
            if expert not in self._ids:
                raise KeyError(expert)
            self._made[expert] = {proj: self._make(stack.a[expert, :r], stack.bt[expert, :r].T)
                                  for proj, stack in self._stacks.items()
                                  if (r := self._ranks.get((expert, proj))) is not None}
        return self._made[expert]

    def __contains__(self, expert: object) -> bool:
        return expert in self._ids  # (without making its updates)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def made(self) -> list[int]:
        """The experts whose updates are made so far (the shared expert's from the start)."""
        return sorted(self._made)


@dataclass(frozen=True)
class ExpertLoRA:
    """``LayerLoRA.experts``'s value: a step's adapters' updates of one layer's experts."""

    updates: list[Mapping[int, dict[str, _Update]]]  # per adapter: expert id -> projection -> update
    stacks: list[dict[str, ExpertStack]]  # per adapter: its routed experts' updates stacked
    owner: torch.Tensor  # per row of the step: its adapter's index in these lists (-1: none)

    def kernel_args(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The routed experts' updates as ``ops.moe_experts`` takes them: six tensors an
        adapter (gate_up's ``a``, ``bt``, ``has``, then down's; empty where it leaves one
        alone) and ``owner``."""
        tensors = []
        for stacks in self.stacks:
            for proj in ("gate_up_proj", "down_proj"):
                stack = stacks.get(proj)
                tensors += [*stack] if stack is not None else [_NONE, _NONE, _NONE]
        return tensors, self.owner


_NONE = torch.empty(0)


def expert_rows(lora: ExpertLoRA | None, expert: int, rows: torch.Tensor | None = None) -> ExpertRows | None:
    """The view through which ``expert`` (``SHARED``: the shared expert) adds its rows'
    updates, its rows being the step's ``rows`` (None: all of them); None where no adapter
    updates it."""
    if lora is None or not any(expert in by_expert for by_expert in lora.updates):
        return None
    owner = lora.owner if rows is None else lora.owner.index_select(0, rows)
    return ExpertRows([by_expert.get(expert, {}) for by_expert in lora.updates], owner)


class ExpertRows:
    """The adapters' updates of one expert for the rows it runs: ``add(proj, x, y)`` as
    ``models.lora.LayerLoRA.add`` (``models.llama.MLP.forward`` calls it). ``updates``: per
    adapter, its updates of this expert's projections; ``owner``: per row, the index of its
    adapter in ``updates`` (-1: none)."""

    def __init__(self, updates: list[dict[str, _Update]], owner: torch.Tensor) -> None:
        self.updates, self.owner = updates, owner

    def add(self, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each row's adapter's update of ``proj`` on its row of ``x``, in place."""
        for g, by_proj in enumerate(self.updates):
            update = by_proj.get(proj)
            if update is None:
                continue
            rows = (self.owner == g).nonzero().squeeze(1)
            if rows.numel():
                # (an add a row: y's row plus its update, as LoRABatch.add's y[rows] += delta)
                y.index_add_(0, rows, update.delta(x.index_select(0, rows)))
        return y
