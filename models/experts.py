"""A mixture's experts over a step's tokens: each token's chosen experts run on its row,
their outputs scaled by its router weights and added (``mix_experts``).

Two ways to run them, the same bits for every row:

* ``FusedExperts``: where a layer's experts are plain MLPs (SiLU: ``models.llama.MLP``; Gemma's
  GELU-tanh: ``models.gemma.GemmaMLP``; gpt-oss's clamped SwiGLU with biases: a class with
  ``plain_form``) whose projections keep a GGUF file's codes on the
  int8-activation GEMMs (``w4a8`` on an MoE file), the kernels
  hold each projection's experts as one weight (``ops.a8_experts``) and a step's gate_up
  and down projections are one call each over every chosen expert's rows (llama.cpp's
  ``mul_mat_id``);
* ``_grouped``: any other expert module, one call per chosen expert over its rows.

A row's result does not depend on the other rows of a GEMM (``models.quant``,
``ops.gguf_a8_experts``), and a token's outputs are added in an order its own choice fixes,
so a token's output does not depend on which tokens share its experts or its step. In
float32 one kernel scales and adds them (``ops.mix_expert_rows``: torch's products and adds,
the same bits), reading each slot's row where its expert's rows left it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from models import ops
from models.gemma import GemmaMLP
from models.gguf_linear import NativeA8Linear
from models.llama import MLP
from models.lora_experts import expert_rows

if TYPE_CHECKING:
    from models.lora_experts import ExpertLoRA

# The expert modules whose forward is down(activate(gate_up(x))), nothing else.
_PLAIN_MLPS = (MLP, GemmaMLP)


class FusedExperts:
    """A layer's experts' gate_up and down projections held by the kernels as one weight each
    (``ops.a8_experts``): made by ``of`` where every expert can be, once the projections are
    final (``models.moe_loader.build_native_moe``, ``models.gguf_native.build_model``)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        # (a bound method where the activation has settings: gpt-oss's clamped SwiGLU)
        self.activate = experts[0].activate
        gate_ups = [e.gate_up_proj for e in experts]
        downs = [e.down_proj for e in experts]
        self.experts = len(experts)
        self.gate_up_features, self.down_features = gate_ups[0].out_features, downs[0].out_features
        # (with each expert's biases, gpt-oss's: the kernel adds a row's expert's after its product)
        self.gate_up = _weights(gate_ups)
        self.down = _weights(downs)
        # The activation as ``ops.moe_experts`` runs it (then it, and the fused MoE layer, runs
        # the experts whole), or None: SiLU's, gpt-oss's clamped SwiGLU or Gemma's GELU-tanh
        # (``kernel_activation``).
        silu = type(experts[0]).activate is MLP.activate
        self.activation = (ops.ExpertActivation(ops.ExpertActivation.SILU_GLU) if silu
                           else getattr(experts[0], "kernel_activation", lambda: None)())

    @classmethod
    def of(cls, experts: nn.ModuleList) -> FusedExperts | None:
        """The experts held as one weight a projection, or None where one cannot be (not all
        plain MLPs of one kind, of a file's codes in the formats ``ops.a8_experts`` takes, alike)."""
        if not all(_fusable(e) and type(e) is type(experts[0]) for e in experts):
            return None
        for kind in ("gate_up_proj", "down_proj"):
            first = getattr(experts[0], kind)
            if any(getattr(e, kind).formats != first.formats or (getattr(e, kind).bias is None) != (first.bias is None)
                   for e in experts):
                return None
        return cls(experts)

    def __call__(self, x: torch.Tensor, chosen: torch.Tensor, lora: ExpertLoRA | None = None
                 ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Every (token, choice) slot's expert output (``chosen [T, k]``, each row ascending) as
        rows ``[T * k, H]`` in expert order, the tokens routed to each expert, and each slot's
        row (None: the rows are in slot order already); ``lora``: the step's adapters' updates
        of the experts, added to each projection's float32 products (``_add_lora``)."""
        t, k = chosen.shape
        if t == 1:  # (the slots are in expert order already, one row each)
            ids, order, rows = chosen[0].tolist(), None, x.float().expand(k, -1)
            counts = [1] * k
            routed = [0] * self.experts
            for e in ids:
                routed[e] = 1
        else:
            order, routed = _slots_by_expert(chosen, self.experts)
            ids = [e for e, n in enumerate(routed) if n]
            counts = [routed[e] for e in ids]
            rows = x.float().index_select(0, order // k)
        # (NativeA8Linear.forward's bias add, in the kernel, and dtype conversion over its float32 products)
        both = ops.gguf_a8_experts(rows, self.gate_up, ids, counts, self.gate_up_features)
        if lora is not None:
            slot_expert = torch.tensor(ids).repeat_interleave(torch.tensor(counts))
            slot_owner = lora.owner.index_select(0, order // k) if order is not None else lora.owner.expand(k)
            _add_lora(both, rows, lora, "gate_up_proj", slot_expert, slot_owner)
        h = self.activate(both.to(x.dtype))
        out = ops.gguf_a8_experts(h.float(), self.down, ids, counts, self.down_features)
        if lora is not None:
            _add_lora(out, h.float(), lora, "down_proj", slot_expert, slot_owner)
        out = out.to(x.dtype)
        if order is None:
            return out, routed, None
        # (slot order[i] is row i; an un-permuting index_copy_ of every row took 3-9 ms a
        # layer of a 256-token prompt on the OLMoE shape)
        rows = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
        return out, routed, rows


def _add_lora(y: torch.Tensor, x: torch.Tensor, lora: ExpertLoRA, proj: str, slot_expert: torch.Tensor,
              slot_owner: torch.Tensor) -> None:
    """Each adapter's updates of ``proj`` on its slots' rows of ``y`` (float32, in place), the
    rows' inputs ``x``: one ``ops.lora_expert_rows`` call an adapter, a row's update computed
    from that row alone."""
    for g, stacks in enumerate(lora.stacks):
        stack = stacks.get(proj)
        if stack is not None:
            mine = torch.where((slot_owner == g) & stack.has[slot_expert], slot_expert, -1)
            ops.lora_expert_rows(y, x, mine, stack.a, stack.bt)


def _fusable(expert: nn.Module) -> bool:
    # (a class with plain_form declares that form with biases; the plain MLPs have none)
    plain_form = getattr(type(expert), "plain_form", False)
    return ((type(expert) in _PLAIN_MLPS or plain_form) and expert.tp is None
            and all(isinstance(p, NativeA8Linear) and (p.bias is None or plain_form)
                    for p in (expert.gate_up_proj, expert.down_proj)))


def _weights(projections: list[NativeA8Linear]) -> object:
    parts = [t for p in projections for t in p.fused_args[:-1]]
    first = projections[0]
    # (each expert's bias a row, gpt-oss's; the kernel adds a row's as ``y + bias`` adds it)
    biases = None if first.bias is None else torch.stack([p.bias.detach() for p in projections])
    return ops.a8_experts(parts, first.formats, len(projections), first.in_features, first.out_features, biases)


def mix_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                fused: FusedExperts | None = None, lora: ExpertLoRA | None = None) -> tuple[torch.Tensor, list[int]]:
    """Each token's chosen experts (``chosen [T, k]``) run on its row of ``x``, their outputs
    scaled by ``weights [T, k]`` (float32) and added: ``(y [T, H], tokens per expert)``;
    ``fused``: the experts as ``FusedExperts`` holds them, where it can; ``lora``: the step's
    adapters' updates of the experts (``LayerLoRA.experts``), added to the held experts'
    float32 products by the kernels (``ops.lora_expert_rows``), else in each expert's own call
    (``_grouped``); either way a row's result is its own, whatever else the step holds."""
    t, k = chosen.shape
    if lora is not None and not ops.kernels_enabled(x.device):
        fused = None  # (each expert its own call, the updates through ExpertRows)
    # NOTE: a token's k outputs are added in ascending expert id, from its first: an order
    # its own choice fixes (not the batch's), and transformers' index_add_ order. Its choices
    # are put in that order first, so its slots below hold their outputs in it (sorting the
    # outputs afterwards, a gather of every slot's row, took a third of a decode step's
    # Python time on the OLMoE shape).
    chosen, by_id = chosen.sort(dim=1)
    weights = weights.gather(1, by_id)
    whole = fused is not None and fused.activation is not None
    if whole and x.dtype == torch.float32 and ops.kernels_enabled(x.device):
        # (the calls below in one: the same bits, a tenth of an OLMoE step's Python less)
        y, routed = ops.moe_experts(x, fused.gate_up, fused.down, weights, chosen, fused.activation,
                                    lora.kernel_args() if lora is not None else None)
        return y, routed.tolist()
    out, counts, rows = fused(x, chosen, lora) if fused is not None else (*_grouped(experts, x, chosen, lora), None)
    if out.dtype == torch.float32 and ops.kernels_enabled(out.device):
        # (one kernel: the same products and adds as below, each slot's row read in place)
        return ops.mix_expert_rows(out, rows, weights), counts
    out = out if rows is None else out.index_select(0, rows)
    parts = (out.view(t, k, -1) * weights.to(x.dtype).unsqueeze(-1)).unbind(1)
    if k == 1:
        return parts[0], counts
    # (added in place after the first sum: the bits of y = y + part, a third less time at k = 8)
    y = parts[0] + parts[1]
    for part in parts[2:]:
        y += part
    return y, counts


def _grouped(experts: nn.ModuleList, x: torch.Tensor, chosen: torch.Tensor, lora: ExpertLoRA | None = None
             ) -> tuple[torch.Tensor, list[int]]:
    """Every (token, choice) slot's expert output ``[T * k, H]``: the step's slots grouped by
    expert, each expert run once on its rows; ``lora``: ``LayerLoRA.experts``'s updates and
    each token's adapter, added to an expert's projections on its rows (``ExpertRows``)."""
    t, k = chosen.shape
    order, counts = _slots_by_expert(chosen, len(experts))
    tokens = order // k
    out = x.new_empty(t * k, x.shape[1])
    start = 0
    for e, n in enumerate(counts):
        if n:
            own = tokens[start:start + n]
            view = expert_rows(lora, e, own)
            rows = experts[e](x.index_select(0, own)) if view is None else experts[e](x.index_select(0, own), view)
            out.index_copy_(0, order[start:start + n], rows)
            start += n
    return out, counts


def _slots_by_expert(chosen: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """The step's (token, choice) slots (``chosen [T, k]`` flattened) in expert order, a stable
    sort, and how many each expert has."""
    flat = chosen.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=experts).tolist()
