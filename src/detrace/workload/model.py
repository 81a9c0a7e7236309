"""The reference model: a small hybrid state-space / attention / mixture-of-experts language model.

It is shaped like the large hybrid Mamba-Transformer MoE models whose training made bitwise determinism
matter, small enough to train on two CPU cores. Read it top to bottom:

    tokens [B, T]
      -> embedding                                  [B, T, D]
      -> layers.<i>: one residual block per layer, of the kind named by `ModelConfig.pattern`:
           M  ssm   a Mamba-style selective scan (plain PyTorch, sequential over T)
           A  attn  causal self-attention with rotary positions
           E  moe   top-k routed experts: router, token dispatch, experts, weighted combine, aux loss
           F  mlp   a dense SwiGLU feed-forward
      -> norm -> output (LM head)                   [B, T, V]   predicts token t+1
      -> mtp -> norm -> output                      [B, T, V]   multi-token prediction: token t+2

Options that change *how* the same math is computed (and so which kernels run):

- `recompute`: every layer under `torch.utils.checkpoint` (non-reentrant): its forward runs again in backward.
- `quant`: "mxfp8" or "nvfp4" fake-quantizes both operands of every block linear and expert matmul along the
  reduction dimension with `detrace.ops.formats.fake_quantize`, with a straight-through gradient.
- `dispatch`: how MoE tokens reach their experts and come back.
    "index": the common hand-written way: gather `x[token]`, combine with `index_add_`. The backward of the
             gather is `aten.index_put` with accumulate=True over repeated indices (each token goes to top_k
             experts), whose CPU kernel splits the work across threads: with 2+ threads its bits change
             from run to run unless `torch.use_deterministic_algorithms(True)`. Each expert takes its tokens
             in priority order (descending router weight), so a token's copies sit at unrelated places in
             the two threads' halves and their additions interleave differently nearly every step.
    "fixed": `detrace.ops`: a private slot per (token, choice) and a sum in choice order, in forward and
             backward (`permute`, `combine`), and the experts as grouped GEMMs (`grouped_mm`).

Module names are stable across every parallel layout (layers live in a ModuleDict keyed by index, so a
pipeline stage that drops layers keeps the others' names): `layers.1.moe` is the same module everywhere.

The MoE aux loss is attached to the block's output with `_AuxLoss` (as Megatron-LM does) instead of being
returned: its gradient enters the backward at the layer itself, which keeps the model's output a plain
tensor under pipeline parallelism, where the stage that holds a MoE layer is not the stage that holds the loss.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from detrace.errors import UsageError

KINDS = {"M": "ssm", "A": "attn", "E": "moe", "F": "mlp"}
QUANT_FORMATS = ("none", "mxfp8", "nvfp4")
DISPATCHES = ("index", "fixed")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes and options of the reference model. Every field is checked in `__post_init__`."""

    vocab_size: int = 256
    """Number of token ids (the synthetic stream uses all of them)."""
    dim: int = 64
    """Width D of the residual stream."""
    pattern: str = "MEAF"
    """One character per layer: M ssm, A attention, E MoE, F dense MLP (see the module docstring)."""
    n_heads: int = 4
    """Attention heads; `dim` must divide by it (and by the tensor-parallel degree times it)."""
    ssm_state: int = 16
    """State size N of the selective scan, per channel."""
    ssm_expand: int = 2
    """The scan runs over `ssm_expand * dim` channels."""
    ssm_conv: int = 4
    """Width of the causal depthwise convolution before the scan."""
    ffn_hidden: int = 128
    """Hidden width of the dense MLP and of each expert."""
    n_experts: int = 8
    """Routed experts per MoE layer (the expert-parallel degree must divide it)."""
    top_k: int = 4
    """Experts per token. Every token index repeats top_k times in the dispatch; with 3 or more copies the
    sum in the accumulating backward of the "index" dispatch depends on the order of its additions (with 2,
    a + b == b + a exactly, and it would not)."""
    router_jitter: float = 0.01
    """In training, multiply the router's input by noise from U(1 - j, 1 + j) (Switch Transformer's router
    jitter). It draws from the global torch RNG every step, so a resume that forgot the RNG state shows."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer form) in the objective."""
    mtp: bool = True
    """Add the multi-token-prediction head (predicts token t+2) and its loss."""
    mtp_loss_coef: float = 0.3
    """Weight of the MTP loss in the objective."""
    recompute: bool = False
    """Run every layer under activation checkpointing (forward recomputed in backward)."""
    quant: str = "none"
    """Fake-quantized linears: "none", "mxfp8" or "nvfp4"."""
    dispatch: str = "index"
    """MoE token dispatch/combine: "index" (advanced indexing, nondeterministic backward on CPU with 2+
    threads) or "fixed" (detrace.ops' fixed-order permute/combine and grouped GEMMs)."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers."""

    def __post_init__(self) -> None:
        if not self.pattern or set(self.pattern) - set(KINDS):
            raise UsageError(f"pattern {self.pattern!r} must be a non-empty string of the letters M, A, E, F")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise UsageError(f"dim {self.dim} must divide into {self.n_heads} heads of even size")
        if not 0 <= self.router_jitter < 1:
            raise UsageError(f"router_jitter {self.router_jitter} must be in [0, 1)")
        if not 1 <= self.top_k <= self.n_experts:
            raise UsageError(f"top_k {self.top_k} must be between 1 and n_experts {self.n_experts}")
        if self.quant not in QUANT_FORMATS:
            raise UsageError(f"quant {self.quant!r} must be one of {', '.join(QUANT_FORMATS)}")
        if self.dispatch not in DISPATCHES:
            raise UsageError(f"dispatch {self.dispatch!r} must be one of {', '.join(DISPATCHES)}")
        if min(self.vocab_size, self.dim, self.ssm_state, self.ssm_conv, self.ffn_hidden) < 1:
            raise UsageError("vocab_size, dim, ssm_state, ssm_conv and ffn_hidden must be positive")


# `tiny` trains a step in well under a second on 2 CPU cores, yet routes 8 x 32 x 4 = 1024 token copies per
# MoE layer, enough for the CPU accumulate kernel to split its work across 2 threads (tests prove both).
# `small` is for benchmarks.
PRESETS: dict[str, dict[str, object]] = {
    "tiny": {"model": ModelConfig(), "batch_size": 8, "seq_len": 32},
    "small": {
        "model": ModelConfig(dim=256, pattern="MEAEMEAF", n_heads=8, ffn_hidden=512, n_experts=16, top_k=4),
        "batch_size": 16,
        "seq_len": 128,
    },
}


# ----------------------------------------------------------------------------------------------------------
# fake quantization with a straight-through gradient


class _FakeQuantize(torch.autograd.Function):
    """Quantize-dequantize in forward; pass the gradient through unchanged (straight-through estimator).

    A custom Function rather than `x + (q - x).detach()`: that expression rounds twice and does not give
    back q's bits exactly.
    """

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, fmt: str) -> torch.Tensor:
        from detrace.ops.formats import fake_quantize  # imported late: only quantized configs need it

        return fake_quantize(x, fmt)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def qmatmul(x: torch.Tensor, weight: torch.Tensor, quant: str) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T -> [..., out], both operands fake-quantized along `in` when asked."""
    if quant != "none":
        x, weight = _FakeQuantize.apply(x, quant), _FakeQuantize.apply(weight, quant)
    return F.linear(x, weight)


class Linear(nn.Linear):
    """A bias-free linear layer that honours the model's `quant` option."""

    def __init__(self, in_features: int, out_features: int, quant: str) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.quant = quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return qmatmul(x, self.weight, self.quant)


# ----------------------------------------------------------------------------------------------------------
# M: Mamba-style selective state-space mixer


class SSM(nn.Module):
    """Selective scan (Mamba-1 form) in plain PyTorch: input-dependent dt, B, C; a sequential scan over T."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inner, n = cfg.ssm_expand * cfg.dim, cfg.ssm_state
        self.dt_rank = math.ceil(cfg.dim / 16)
        self.in_proj = Linear(cfg.dim, 2 * inner, cfg.quant)  # -> x, z (gate)
        self.conv = nn.Conv1d(inner, inner, cfg.ssm_conv, groups=inner, padding=cfg.ssm_conv - 1)
        self.x_proj = nn.Linear(inner, self.dt_rank + 2 * n, bias=False)  # -> dt (low rank), B, C
        self.dt_proj = nn.Linear(self.dt_rank, inner)
        # A = -exp(A_log) < 0 so the state decays; the S4D-real initialisation A[:, n] = -(n + 1).
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = Linear(inner, cfg.dim, cfg.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        u, z = self.in_proj(x).chunk(2, dim=-1)  # [B, T, I] each
        u = F.silu(self.conv(u.transpose(1, 2))[..., :T].transpose(1, 2))  # causal conv, [B, T, I]
        dt, Bm, Cm = self.x_proj(u).split([self.dt_rank, self.A_log.shape[1], self.A_log.shape[1]], dim=-1)
        dt = F.softplus(self.dt_proj(dt))  # [B, T, I]
        A = -torch.exp(self.A_log)  # [I, N]
        decay = torch.exp(dt.unsqueeze(-1) * A)  # [B, T, I, N]
        drive = (dt * u).unsqueeze(-1) * Bm.unsqueeze(2)  # [B, T, I, N]
        h = torch.zeros_like(decay[:, 0])  # [B, I, N]
        ys = []
        # unbind, not decay[:, t]: its backward stacks the T slices' grads once, where T selects would each
        # fill a zero gradient of the whole [B, T, I, N] tensor (quadratic in T)
        steps = zip(decay.unbind(1), drive.unbind(1), Cm.unbind(1), strict=True)
        for decay_t, drive_t, C_t in steps:  # h_t = exp(dt A) h_{t-1} + dt B u ;  y_t = C h_t
            h = decay_t * h + drive_t
            ys.append((h * C_t.unsqueeze(1)).sum(-1))  # [B, I]
        y = torch.stack(ys, dim=1) + u * self.D  # [B, T, I]
        return self.out_proj(y * F.silu(z))  # [B, T, D]


# ----------------------------------------------------------------------------------------------------------
# A: causal self-attention with rotary positions


def rotary_table(head_dim: int, max_len: int, theta: float) -> torch.Tensor:
    """cos/sin of the rotary angles, [max_len, head_dim // 2, 2]."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [B, T, H, hd] by the angles of positions 0..T-1."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # [B, T, H, hd/2] each
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]  # [T, 1, hd/2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    """Multi-head causal self-attention. Under tensor parallelism wq/wk/wv are column-sharded and wo
    row-sharded, so each rank holds n_heads / tp heads: forward reads the local head count from the shapes."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = Linear(cfg.dim, cfg.dim, cfg.quant)
        self.wk = Linear(cfg.dim, cfg.dim, cfg.quant)
        self.wv = Linear(cfg.dim, cfg.dim, cfg.quant)
        self.wo = Linear(cfg.dim, cfg.dim, cfg.quant)
        self.rotary: torch.Tensor  # [max_seq_len, head_dim // 2, 2]: a buffer, not saved
        self.register_buffer("rotary", rotary_table(self.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))  # [B, T, H, hd]
        q, k = apply_rotary(q, self.rotary), apply_rotary(k, self.rotary)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [B, H, T, hd]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # [B, T, D]


# ----------------------------------------------------------------------------------------------------------
# F: dense SwiGLU MLP


class MLP(nn.Module):
    """SwiGLU feed-forward. Under tensor parallelism w1/w3 are column-sharded and w2 row-sharded."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_hidden, cfg.quant)
        self.w3 = Linear(cfg.dim, cfg.ffn_hidden, cfg.quant)
        self.w2 = Linear(cfg.ffn_hidden, cfg.dim, cfg.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ----------------------------------------------------------------------------------------------------------
# E: mixture of experts


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (what this rank holds and computes with); any other tensor itself."""
    # Looked up, not imported: DTensor's module costs half a second to import (a third of a rank's start-up besides
    # torch's), and no tensor is a DTensor before a layout that makes them has imported it
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (gathered over its mesh: an exact copy); any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _swiglu(gate: torch.Tensor, up: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """silu(gate) * up over rows sorted by expert. On CPU one expert's rows at a time: a CPU elementwise kernel
    computes the elements at the end of its range (or of a thread's share) with a scalar exp whose bits differ from
    the vectorized one's, so over the whole tensor an element's bits would depend on the other experts' rows
    (which expert parallelism sends elsewhere). CUDA kernels compute every element alike: one call."""
    if gate.device.type != "cpu":
        return F.silu(gate) * up
    return torch.cat([F.silu(g) * u for g, u in zip(gate.split(counts), up.split(counts), strict=True)])


class Experts(nn.Module):
    """`n` SwiGLU experts stored as stacked weights [n, out, in], so expert parallelism can split dim 0
    (it makes them DTensors sharded on dim 0: this module then holds and runs only its local experts)."""

    def __init__(self, n: int, dim: int, hidden: int, quant: str, *, grouped: bool = False) -> None:
        super().__init__()
        self.quant = quant
        self.grouped = grouped  # run as three `detrace.ops.grouped_mm` (the "fixed" dispatch)
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=w.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor, counts: list[int],
                weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [sum(counts), D] sorted by expert, counts[e] rows for local expert e -> [sum(counts), D].

        `weights`: (w1, w3, w2) to compute with instead of the local parameters: the same shapes, or [S, n_local,
        out, in] with counts over S * n_local groups (set-major), the invariant expert parallelism's views of them,
        one set per source rank, whose gradients stay apart."""
        if weights is None:
            weights = local_tensor(self.w1), local_tensor(self.w3), local_tensor(self.w2)  # [n_local, out, in]
        w1, w3, w2 = weights
        if self.grouped:
            from detrace.ops import grouped_mm

            if self.quant != "none":  # both operands quantized along `in`, as qmatmul does
                x, w1, w3, w2 = (_FakeQuantize.apply(t, self.quant) for t in (x, w1, w3, w2))
            h = _swiglu(grouped_mm(x, w1, counts), grouped_mm(x, w3, counts), counts)
            if self.quant != "none":
                h = _FakeQuantize.apply(h, self.quant)
            return grouped_mm(h, w2, counts)
        from detrace.ops.grouped import group_weight

        outs = []
        for e, xe in enumerate(x.split(counts)):  # a fixed loop over experts: no cross-expert reduction
            h = F.silu(qmatmul(xe, group_weight(w1, e), self.quant)) * qmatmul(xe, group_weight(w3, e), self.quant)
            outs.append(qmatmul(h, group_weight(w2, e), self.quant))
        return torch.cat(outs)


class _AuxLoss(torch.autograd.Function):
    """Identity on `x` whose backward also sends gradient `coef` into `aux` (Megatron's MoEAuxLossAutoScaler).

    This trains the load-balancing loss without threading it through every layer's return value.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, aux: torch.Tensor, coef: float):
        ctx.save_for_backward(aux)
        ctx.coef = coef  # type: ignore[attr-defined]  # FunctionCtx carries custom attributes; the stubs declare none
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor):
        # mypy, ignored below: saved_tensors exists at run time; FunctionCtx's stubs lack it
        (aux,) = ctx.saved_tensors  # type: ignore[attr-defined]
        # mypy, ignored below: coef was set in forward; FunctionCtx's stubs lack it
        return grad, torch.full_like(aux, ctx.coef), None  # type: ignore[attr-defined]


# The expert-parallel hook: (routed [R, D] sorted by expert, counts [E], local experts) -> [R, D].
ExpertExchange = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]


class MoE(nn.Module):
    """Top-k routed experts with a Switch-style load-balancing loss.

    Expert parallelism replaces `exchange` (identity here) by an all-to-all that sends each expert's
    tokens to the rank that holds it and brings the results back; see `detrace.workload.expert_parallel`.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.ffn_hidden, cfg.quant, grouped=cfg.dispatch == "fixed")
        self.exchange: ExpertExchange | None = None
        # Sum of this layer's aux losses since the last `pop_aux_loss()` (microbatches add up). For logging
        # only: the gradient goes through `_AuxLoss`.
        self.aux_total = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        k, E = self.cfg.top_k, self.cfg.n_experts
        x = x.reshape(B * T, D)  # [N, D]
        jitter = self.cfg.router_jitter
        if self.training and jitter > 0:
            noise = torch.empty_like(x).uniform_(1 - jitter, 1 + jitter)  # recompute replays the RNG state
            probs = F.softmax(self.router(x * noise), dim=-1)  # [N, E]
        else:
            probs = F.softmax(self.router(x), dim=-1)  # [N, E]
        weights, experts = probs.topk(k, dim=-1)  # [N, k] each
        weights = weights / weights.sum(-1, keepdim=True)

        if self.cfg.dispatch == "fixed":
            return self._fixed(x, probs, weights, experts).view(B, T, D)
        # Sort the N*k (token, expert) pairs by expert, each expert's tokens by descending router weight (the
        # priority order of batch-prioritized routing, which drops the last tokens when an expert is over
        # capacity). Two stable sorts make the order exact: by weight, then by expert.
        by_weight = weights.flatten().argsort(descending=True, stable=True)  # [N*k]
        order = by_weight[experts.flatten()[by_weight].argsort(stable=True)]  # [N*k]
        tokens = order // k  # [N*k] source token of each sorted row; every token appears k times
        counts = torch.bincount(experts.flatten(), minlength=E)  # [E]

        routed = x[tokens]  # [N*k, D]  backward: aten.index_put(accumulate=True), order-dependent
        if self.exchange is None:
            out = self.experts(routed, counts.tolist())
        else:
            out = self.exchange(routed, counts, self.experts)
        out = out * weights.flatten()[order].unsqueeze(-1)  # [N*k, D]
        # combine: each token sums its k weighted expert outputs, [N*k, D] -> [N, D]
        y = torch.zeros_like(x).index_add_(0, tokens, out)
        return self._aux(y, probs, counts).view(B, T, D)

    def _fixed(
        self, x: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The "fixed" dispatch: detrace.ops' private slot per (token, choice) and fixed-order sums, in forward
        and backward; the experts as grouped GEMMs."""
        from detrace.ops import combine, permute, route

        routing = route(experts, self.cfg.n_experts)  # stable sort by expert: token order within an expert
        routed = permute(x, routing)  # [N*k, D]  backward: each token's k rows summed in choice order
        if self.exchange is None:
            out = self.experts(routed, routing.counts.tolist())
        else:
            out = self.exchange(routed, routing.counts, self.experts)
        y = combine(out, routing, weights)  # [N, D]  each token's k weighted rows summed in choice order
        return self._aux(y, probs, routing.counts)

    def _aux(self, y: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`y` carrying the load-balancing loss's gradient (and the loss added to the logged total)."""
        E, k = self.cfg.n_experts, self.cfg.top_k
        # Switch load balancing: E * sum_e (fraction of routed copies to e) * (mean router probability of e)
        aux = E * (counts.to(probs.dtype) / (probs.shape[0] * k) * probs.mean(0)).sum()
        if not _recomputing:
            self.aux_total = self.aux_total + aux.detach()
        if torch.is_grad_enabled():
            y = _AuxLoss.apply(y, aux, self.cfg.aux_loss_coef)
        return y

    def pop_aux_loss(self) -> torch.Tensor:
        """This layer's aux loss summed over the forwards since the last call, and reset it."""
        total, self.aux_total = self.aux_total, torch.zeros(())
        return total


# ----------------------------------------------------------------------------------------------------------
# the stack


# True while torch.utils.checkpoint re-runs a forward in backward, so that layer-side logging (the aux loss
# total) does not count the recomputed forward twice.
_recomputing = False


@contextlib.contextmanager
def _recompute_context() -> Iterator[None]:
    global _recomputing
    _recomputing = True
    try:
        yield
    finally:
        _recomputing = False


class Block(nn.Module):
    """Pre-norm residual block around one mixer; the mixer's attribute name is its kind (ssm/attn/moe/mlp)."""

    def __init__(self, kind: str, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.RMSNorm(cfg.dim)
        mixer = {"ssm": SSM, "attn": Attention, "moe": MoE, "mlp": MLP}[kind](cfg)
        self.add_module(kind, mixer)
        self.recompute = cfg.recompute

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + getattr(self, self.kind)(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(
                self._forward,
                x,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _recompute_context()),
            )
        return self._forward(x)


class MTPHead(nn.Module):
    """Multi-token prediction: one more dense block on the final hidden state, read by the shared LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.block = Block("mlp", cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h)


class HybridLM(nn.Module):
    """The whole model. A pipeline stage is this module with the layers and ends it does not own set to
    None / deleted (see `parallel.pipeline_stage`); forward then maps hidden states to hidden states."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embedding: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(KINDS[c], cfg) for i, c in enumerate(cfg.pattern)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp: MTPHead | None = MTPHead(cfg) if cfg.mtp else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (or hidden [B, T, D] on a later pipeline stage) ->
        logits [B, T, V], or [B, T, 2, V] with the MTP head (index 0: next token, 1: the one after),
        or hidden [B, T, D] on a stage without the head."""
        h = self.embedding(x) if self.embedding is not None else x  # [B, T, D]
        for layer in self.layers.values():
            h = layer(h)
        if self.output is None or self.norm is None:
            return h
        logits = self.output(self.norm(h))  # [B, T, V]
        if self.mtp is None:
            return logits
        # One tensor rather than a tuple, so a pipeline schedule can hand it to the loss function as is.
        return torch.stack([logits, self.output(self.norm(self.mtp(h)))], dim=2)  # [B, T, 2, V]

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]


def lm_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token loss, MTP loss) from logits [B, T, V] or [B, T, 2, V] and targets [B, T + 1].

    targets[:, t] is the token after input t; targets[:, t + 1] the one after that (for the MTP head).
    The MTP loss is zero without the MTP head.
    """
    T = targets.shape[1] - 1
    if logits.dim() == 3:
        return F.cross_entropy(logits.flatten(0, 1), targets[:, :T].flatten()), logits.new_zeros(())
    lm = F.cross_entropy(logits[:, :, 0].flatten(0, 1), targets[:, :T].flatten())
    mtp = F.cross_entropy(logits[:, :, 1].flatten(0, 1), targets[:, 1:].flatten())
    return lm, mtp


def objective(cfg: ModelConfig, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trained loss without the aux loss (which enters through `_AuxLoss`): lm + mtp_coef * mtp."""
    lm, mtp = lm_losses(logits, targets)
    return lm + cfg.mtp_loss_coef * mtp
