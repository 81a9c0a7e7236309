"""A "detrace" experts implementation for transformers' MoE models (`ExpertsInterface`).

After `register()`, a model whose config has `_experts_implementation = "detrace"` runs its experts through
`detrace.ops`: the tokens are permuted by a stable sort on the expert id, each expert's GEMMs are
`grouped_mm`, and the k outputs of a token are combined in choice order (`combine`). Forward and backward
are deterministic without torch's global switch, and compute the same function as HF's "eager" experts (to
float rounding: the sum of a token's k outputs runs in another order).
"""

from __future__ import annotations

from typing import Any

import torch

from detrace.errors import UsageError
from detrace.ops.grouped import grouped_mm
from detrace.ops.moe import combine, permute, route

NAME = "detrace"


def experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward of transformers' interface: hidden [N, D], top_k_index and top_k_weights [N, k]
    -> [N, D]. `self` is the experts module of a transformers model (duck-typed: its class varies by model)."""
    if getattr(self, "_is_expert_parallel", False):
        raise UsageError('the "detrace" experts implementation does not run expert-parallel models')
    routing = route(top_k_index, self.num_experts)
    counts = routing.counts.tolist()
    transposed = getattr(self, "is_transposed", False)

    def linear(x: torch.Tensor, name: str) -> torch.Tensor:
        weight = getattr(self, name)
        out = grouped_mm(x, weight.transpose(1, 2) if transposed else weight, counts)
        if getattr(self, "has_bias", False):
            bias = getattr(self, f"{name}_bias")
            out = out + bias.repeat_interleave(routing.counts, dim=0, output_size=x.shape[0])
        return out

    x = permute(hidden_states, routing)
    if getattr(self, "has_gate", True):
        h = self._apply_gate(linear(x, "gate_up_proj"))
    else:
        h = self.act_fn(linear(x, "up_proj"))
    out = linear(h, "down_proj")
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    return combine(out, routing, top_k_weights.to(out.dtype)).to(hidden_states.dtype)


def register() -> None:
    """Register "detrace" in `transformers.integrations.moe.ExpertsInterface` (idempotent)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as exc:
        raise UsageError("detrace.ops.hf_experts.register() needs transformers with MoE experts interfaces (>= 5)"
                         ) from exc
    ExpertsInterface.register(NAME, experts_forward)
