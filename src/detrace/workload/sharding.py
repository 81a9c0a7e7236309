"""Parallel layouts of the reference model: DDP, FSDP2, tensor, expert and pipeline parallelism, and two
combinations, with real processes (gloo on CPU, NCCL on GPU) started by torchrun.

| layout  | mesh (dims)      | what is split                                  | how gradients meet            |
|---------|------------------|------------------------------------------------|-------------------------------|
| none    | -                | nothing                                        | -                             |
| ddp     | dp=W             | the data                                       | DistributedDataParallel       |
| fsdp    | dp=W             | the data; every parameter sharded on dim 0     | fully_shard (reduce-scatter)  |
| tp      | tp=W             | attention heads, MLP hidden (DTensor col/row)  | DTensor (all-reduce in layer) |
| ep      | ep=W             | the data; the experts (tokens via all_to_all)  | all-reduce of non-expert grads|
| pp      | pp=2             | the layers: 2 stages, 1F1B schedule, send/recv | none needed                   |
| dp-ep   | dp=W/2, ep=2     | data over dp x ep; experts over ep             | non-expert over all, experts over dp |
| pp-dp   | pp=2, dp=W/2     | layers over pp; data over dp                   | all-reduce over dp            |
| dp-invariant | dp=W (or 1) | the global batch's M microbatches, in blocks  | fixed tree (detrace.parallel.data) |
| tp-invariant | dp=W/T, tp=T | dp-invariant's; attention/MLP projections in chunks | fixed trees over dp and tp |
| tp-plain | dp=W/T, tp=T | as tp-invariant (the control)                  | fixed tree over dp, all-reduce over tp |
| fsdp-invariant | fsdp=W (or 1) | dp-invariant's; parameters sharded on dim 0 | fixed tree in the reduce-scatter |
| fsdp-plain | fsdp=W (or 1) | as fsdp-invariant (the control)            | fully_shard's accumulation, reduce-scatter |
| fsdp-invariant | dp=D, fsdp=W/D | as fsdp-invariant, D replicas (HSDP)   | the tree, completed over dp (fixed order) |
| fsdp-plain | dp=D, fsdp=W/D | as fsdp-invariant, D replicas (the control) | fully_shard's HSDP (all-reduce over dp) |
| fsdp-invariant | fsdp=W/T, tp=T | tp-invariant's chunks, sharded over fsdp | the tree in the reduce-scatter |
| pp-invariant | pp=P, dp=W/(PT), tp=T | layers over pp; dp-invariant's blocks; tp chunks | tree per stage, over dp |
| fsdp-invariant | pp=P, fsdp=W/P | layers over pp; stages sharded; blocks over fsdp | tree in reduce-scatter |
| fsdp-plain | pp=P, fsdp=W/P | as fsdp-invariant (the control)             | torch's stage on fully_shard  |
| pp-plain | pp=P, dp=W/P | as pp-invariant (the control)                 | autograd's running sum, tree over dp |
| ep-invariant | dp=W/E, ep=E | dp-invariant's over dp x ep; experts over ep | fixed trees (experts: per source) |
| ep-plain | dp=W/E, ep=E   | as ep-invariant (the control)                  | experts: autograd over all sources |
| ep-invariant | ep=W/T, tp=T | ep-invariant's; tp-invariant's chunks over tp | fixed trees over ep (chunks too) |
| ep-fsdp-invariant | fsdp=W/E, ep=E | ep-invariant's; the rest sharded over all | tree in the reduce-scatter; experts |
| ep-invariant | pp=P, ep=W/P | layers over pp; blocks and experts over ep | tree per stage, over ep; experts |
| ep-plain | pp=P, ep=W/P | as ep-invariant on pp x ep (the control)     | autograd's sum, tree over ep; all-to-all |

Where gradients are averaged by hand (`_average_gradients`) they are flattened in parameter order into one
buffer and all-reduced once: plain data parallelism, written out because DDP cannot express "these
parameters over this group, those over that one", and it does not compose with a pipeline schedule's
separate backward.

Every metric the trainer prints is reduced here the same way in every layout (`ParallelModel.metrics`):
each rank contributes the share it owns, the shares are all-gathered and summed in rank order, so the
printed bits do not depend on a collective's internal reduction order and are the same on every rank.

dp-invariant is the exception: its gradients and metrics are sums over the M microbatches in one fixed tree
(`detrace.parallel.data.invariant_backward`), the same bits at every world size W (a power of two dividing M, 1
included, with or without torchrun); every rank reads the whole global batch and computes its block of it.
tp-invariant adds tensor parallelism whose bits do not depend on T either (`detrace.parallel.tensor`): the
same bits on every DP x TP mesh; its metrics and `final params` line gather per-parameter values over tp by
global name (`by_global_name`).

The expert-parallel machinery (the all-to-all, ep-invariant's fixed-order experts) is in
`detrace.workload.expert_parallel`, the pipeline's (a stage cut out of the model, pp-invariant's bookkeeping) in
`detrace.workload.pipeline_parallel`; `ParallelModel` here puts them together.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from detrace._compat import initialize_pipeline_stage, reducing_pipeline_stage
from detrace.errors import UsageError
from detrace.parallel.data import InvariantDataParallel, _digests, invariant_backward, owned_microbatches
from detrace.parallel.fsdp import FixedOrderReduceScatter, check_complete, shard_invariantly
from detrace.parallel.tensor import ColumnParallelLinear, RowParallelLinear, by_global_name, sum_of_parts
from detrace.workload.expert_parallel import _ExpertParallel, _is_expert, _shard_experts
from detrace.workload.layouts import INVARIANT, Layout
from detrace.workload.model import MLP, Attention, HybridLM, ModelConfig, lm_losses, local_tensor, whole_tensor
from detrace.workload.pipeline_parallel import PP_MICROBATCHES, SCHEDULES, _InvariantPipeline, _pipeline_stage

TP_CHUNK = 16
"""Features per chunk of the tp layouts' projections: fixed by the model, never by the TP size or the device
(each projection's chunks must divide by T; a column chunk holds whole heads when n_heads divides by T)."""


def _average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Average the gradients of `params` over `group`, in place: one flat buffer, one all-reduce. A DTensor
    gradient contributes its local shard (its replicas over `group` hold the same rows)."""
    if not params:
        return
    for p in params:
        if p.grad is None:  # every rank must contribute the same buffer layout
            p.grad = torch.zeros_like(p)
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(mean.view_as(g))


# ----------------------------------------------------------------------------------------------------------
# tensor parallelism


def _tensor_parallel(model: HybridLM, layout: Layout) -> None:
    """Column-shard wq/wk/wv and w1/w3, row-shard wo and w2 (Megatron-style; no sequence parallelism).
    SSM, MoE, norms, embedding and head stay replicated: their inputs and gradients are the same on
    every tp rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

    cfg = model.cfg
    tp = layout.size("tp")
    if cfg.quant != "none":
        raise UsageError("fake-quantized linears are not supported under tensor parallelism")
    if cfg.n_heads % tp or cfg.ffn_hidden % tp:
        raise UsageError(f"n_heads {cfg.n_heads} and ffn_hidden {cfg.ffn_hidden} must divide by tp {tp}")
    col, row = ColwiseParallel(), RowwiseParallel()
    plan: dict[str, ParallelStyle] = {}
    for name, _ in model.named_modules():
        if name.endswith(".attn"):
            plan.update({f"{name}.wq": col, f"{name}.wk": col, f"{name}.wv": col, f"{name}.wo": row})
        elif name.endswith(".mlp"):
            plan.update({f"{name}.w1": col, f"{name}.w3": col, f"{name}.w2": row})
    assert layout.mesh is not None
    parallelize_module(model, layout.mesh["tp"], plan)


def _chunked_tensor_parallel(model: HybridLM, layout: Layout, mode: str) -> None:
    """tp-invariant (mode "invariant") and tp-plain ("plain"): the same split as `_tensor_parallel`, with
    detrace.parallel.tensor's chunked layers; every other module stays replicated."""
    cfg, tp = model.cfg, layout.size("tp")
    if cfg.quant != "none":
        raise UsageError("fake-quantized linears are not supported under tensor parallelism")
    if cfg.n_heads % tp:
        raise UsageError(f"n_heads {cfg.n_heads} must divide by tp {tp}")
    group = layout.group("tp") if layout.mesh is not None else None
    for module in list(model.modules()):
        columns, rows = (("wq", "wk", "wv"), ("wo",)) if isinstance(module, Attention) else \
            (("w1", "w3"), ("w2",)) if isinstance(module, MLP) else ((), ())
        for name, cls in [(c, ColumnParallelLinear) for c in columns] + [(r, RowParallelLinear) for r in rows]:
            setattr(module, name, cls(getattr(module, name).weight, chunk=TP_CHUNK, group=group, mode=mode))


# ----------------------------------------------------------------------------------------------------------
class ParallelModel:
    """The reference model placed on a layout, with the trainer's per-step operations:
    `forward_backward` (gradients synchronised), `metrics` (reduced over the world)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, *, seed: int, batch_size: int, seq_len: int,
                 microbatches: int | None = None, schedule: str = "1f1b") -> None:
        self.cfg, self.layout = cfg, layout
        # Same initial weights on every rank: each shards what it was given.
        torch.manual_seed(seed)
        self.raw = HybridLM(cfg).to(layout.device)
        self._lm: list[torch.Tensor] = []
        self._mtp: list[torch.Tensor] = []
        self.module: nn.Module = self.raw
        self.schedule: Any = None  # a torch.distributed.pipelining schedule, under --parallel pp
        kind = layout.kind
        self.invariant: InvariantDataParallel | None = None
        self._invariant_sums: torch.Tensor | None = None
        self._tp_group = layout.group("tp") if layout.size("tp") > 1 else None
        self._fsdp: tuple[int, dist.ProcessGroup | None] | None = None  # (M, group) of the fsdp layouts
        self._comms: list[FixedOrderReduceScatter] = []  # fsdp-invariant's reduce-scatters
        self._pipeline: _InvariantPipeline | None = None
        self._ep: _ExpertParallel | None = None
        if kind in INVARIANT and (microbatches is None or batch_size % microbatches):
            raise UsageError(f"--parallel {kind} needs --microbatches M dividing the batch size {batch_size}")
        if layout.size("ep") > 1 and cfg.quant == "nvfp4" and kind != "ep-plain":
            # NVFP4's per-tensor scale is the amax over one call of the experts, and an ep rank's call holds only
            # its own experts' rows: other scales, other bits than one process
            raise UsageError("--quant nvfp4 does not keep one process's bits under expert parallelism: its "
                             "per-tensor scale is taken over every row of one call of the experts, and an ep rank "
                             "calls only its own experts (use --quant mxfp8, whose scales are per 32-value block, "
                             "or none)")
        if layout.size("ep") > 1:
            _shard_experts(self.raw, layout)
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # DDP rebuilds its gradient buckets once, after the first step, in the order gradients became
            # ready; a resumed process would run its first step with the initial layout and all-reduce other
            # buffers than the run that never stopped (`detrace check-resume` sees the bucket shapes differ).
            # With find_unused_parameters the Reducer never rebuilds: one layout for the whole run.
            self.module = DistributedDataParallel(self.raw, find_unused_parameters=True)
        elif kind == "fsdp" or (kind.startswith("fsdp-") and layout.mesh is not None):
            from torch.distributed.fsdp import fully_shard

            assert layout.mesh is not None
            mesh = layout.mesh
            if layout.size("tp") > 1:  # fsdp x tp: the invariant chunked projections, each rank's chunks sharded
                _chunked_tensor_parallel(self.raw, layout, "invariant")
            # fsdp x tp, and dp x fsdp invariant (its replicas complete the tree themselves): sharded over the fsdp
            # dimension only; dp x fsdp plain: fully_shard's HSDP on the whole mesh (reduce-scatter, then all-reduce)
            if layout.size("tp") > 1 or (layout.size("dp") > 1 and kind == "fsdp-invariant"):
                mesh = layout.mesh["fsdp"]
            if layout.size("pp") > 1:  # pp x fsdp: each stage's layers, sharded over its fsdp ranks
                assert microbatches is not None
                self._pipeline = _InvariantPipeline(self.raw, microbatches, layout)  # the whole model's names first
                _pipeline_stage(self.raw, layout.coord("pp"), layout.size("pp"))
                mesh = layout.mesh["fsdp"]
            for layer in self.raw.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(self.raw, mesh=mesh)
        elif kind == "tp":
            _tensor_parallel(self.raw, layout)
        elif kind in ("tp-invariant", "tp-plain") or (kind in ("pp-invariant", "ep-invariant")
                                                       and layout.size("tp") > 1):
            _chunked_tensor_parallel(self.raw, layout, "plain" if kind == "tp-plain" else "invariant")
        if kind in INVARIANT:
            assert microbatches is not None
            if layout.mesh is not None and (kind in ("pp-invariant", "pp-plain")
                                            or (kind.startswith("ep-") and layout.size("pp") > 1)):
                # pp x ep: its stages as pp-invariant's, each stage's experts split over its ep ranks
                self._pipeline = _InvariantPipeline(self.raw, microbatches, layout)
            if self._pipeline is not None:
                blocks = self._pipeline.blocks
                if layout.size("fsdp") > 1:  # the tree over the global microbatches in each stage's reduce-scatter
                    # (fsdp-plain, the control: torch's stage, fully_shard's accumulation and one reduce-scatter)
                    self._shard_fsdp(microbatches, invariant=kind == "fsdp-invariant")
                self._build_pipeline(batch_size // blocks, seq_len, microbatches=microbatches // blocks,
                                     schedule=schedule)
            elif kind.startswith("fsdp-"):
                # the data blocks are over dp x fsdp (world rank d F + f, dp x fsdp the whole mesh), or over fsdp
                group = None if layout.mesh is None else dist.group.WORLD if layout.size("dp") > 1 \
                    else layout.group("fsdp")
                self._fsdp = microbatches, group
                self._shard_fsdp(microbatches, invariant=kind == "fsdp-invariant")
            elif kind.startswith("ep-"):
                self._ep = _ExpertParallel(self.raw, microbatches, layout, invariant=kind != "ep-plain")
            else:
                dp = layout.group("dp") if layout.mesh is not None else None
                self.invariant = InvariantDataParallel(self.raw, microbatches=microbatches, group=dp)
        if layout.size("pp") > 1 and self.schedule is None:
            self._build_pipeline(batch_size, seq_len)
        self._chunked = any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in self.raw.modules())
        """The projections are detrace.parallel.tensor's chunks (by global name in the metrics and fingerprint)."""
        # parameter lists for the hand-written gradient averages
        named = list(self.raw.named_parameters())
        self._experts = [p for n, p in named if _is_expert(n)]
        self._dense = [p for n, p in named if not _is_expert(n)]

    def _shard_fsdp(self, microbatches: int, *, invariant: bool) -> None:
        """fsdp-invariant: fully_shard's reduce-scatter as the fixed tree over the global microbatches
        (`detrace.parallel.fsdp`); fsdp-plain: its own, summing (the loss is already scaled by the global batch)."""
        from torch.distributed.fsdp import FSDPModule

        if self.layout.mesh is None:  # one process: nothing is sharded, the tree is invariant_backward's
            return
        if invariant:
            dp, replicas = self.layout.size("dp"), self.layout.group("dp") if self.layout.size("dp") > 1 else None
            self._comms = shard_invariantly(self.raw, microbatches=microbatches // (dp * self.layout.size("fsdp")),
                                            replicas=replicas)
        else:
            for module in self.raw.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)

    def _build_pipeline(self, batch_size: int, seq_len: int, *, microbatches: int = PP_MICROBATCHES,
                        schedule: str = "1f1b") -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if batch_size % microbatches:
            raise UsageError(f"batch size {batch_size} must divide into {microbatches} pipeline microbatches")
        if schedule not in SCHEDULES:
            raise UsageError(f"pipeline schedule {schedule!r} must be one of {', '.join(SCHEDULES)}")
        layout = self.layout
        stage, stages = layout.coord("pp"), layout.size("pp")
        if layout.size("fsdp") == 1:  # pp x fsdp: the stage was cut before fully_shard
            _pipeline_stage(self.raw, stage, stages)
        # Example microbatches for the stage's input and output, so the stage does not infer shapes with
        # an extra forward (which would run the MoE layers once more than the schedule does).
        mb, cfg, dev = batch_size // microbatches, self.cfg, layout.device
        hidden = torch.empty(mb, seq_len, cfg.dim, device=dev, requires_grad=True)  # grads flow back
        tokens = torch.zeros(mb, seq_len, dtype=torch.long, device=dev)
        logits = torch.empty(mb, seq_len, *((2,) if cfg.mtp else ()), cfg.vocab_size, device=dev)
        invariant = self._pipeline is not None
        where: dict[str, Any] = {"submodule": self.raw, "stage_index": stage, "num_stages": stages, "device": dev,
                                 "input_args": tokens if stage == 0 else hidden,
                                 "output_args": logits if stage == stages - 1 else hidden, "group": layout.group("pp")}
        # pp x fsdp: every microbatch's backward reduce-scatters (the tree's leaves, in microbatch order), each onto
        # cleared sharded gradients: fully_shard assigns the last one's output (the tree) instead of adding it to the
        # zeros the earlier ones output (+0 + -0 would lose a zero's sign)
        self.schedule = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(
            reducing_pipeline_stage(self._clear_gradients, **where) if self._comms else PipelineStage(**where),
            n_microbatches=microbatches,
            loss_fn=self._pipeline.loss if self._pipeline is not None else self._loss,
            # pp-invariant: the loss is divided by M and the gradients summed in the tree, never scaled after
            scale_grads=not invariant,
        )
        if self._pipeline is not None:  # pp x fsdp: the tree is the reduce-scatter's
            self._pipeline.attach(self.raw, self.cfg, tree=self.layout.kind in ("pp-invariant", "ep-invariant"))
        # Set up before training, not at the first step: a resumed process's first step makes the calls of a run
        # that never stopped (`detrace check-resume`).
        target = torch.zeros(mb, seq_len, dtype=torch.long, device=dev) if stage == stages - 1 else None
        initialize_pipeline_stage(self.schedule, (tokens,) if stage == 0 else (), {}, target)

    def _clear_gradients(self) -> None:
        for p in self.raw.parameters():
            p.grad = None

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lm, mtp = lm_losses(logits, targets)
        self._lm.append(lm.detach())
        self._mtp.append(mtp.detach())
        return lm + self.cfg.mtp_loss_coef * mtp

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """One step's forward and backward on this rank's batch; afterwards every gradient is final."""
        self._lm, self._mtp = [], []
        if self._pipeline is not None:
            # this data-parallel (or fsdp) rank's block of the global batch: its microbatches [d n, (d + 1) n)
            blocks, block = self._pipeline.blocks, self._pipeline.block
            inputs, targets = inputs.chunk(blocks)[block], targets.chunk(blocks)[block]
            with self._pipeline.step():
                if self.layout.coord("pp") == 0:
                    self.schedule.step(inputs)
                elif self.layout.coord("pp") == self.layout.size("pp") - 1:
                    self.schedule.step(target=targets, losses=[])
                else:
                    self.schedule.step()
            check_complete(self._comms)
            return
        if self.invariant is not None or self._fsdp is not None or self._ep is not None:
            self._invariant_step(inputs, targets)
            return
        if self.schedule is not None:
            if self.layout.coord("pp") == 0:
                self.schedule.step(inputs)
            else:
                self.schedule.step(target=targets, losses=[])
        else:
            logits = self.module(inputs)
            loss = self._loss(logits, targets)
            loss.backward()
        layout = self.layout
        if layout.size("ep") > 1:
            # Dense parameters saw only this rank's batch: average over every rank. A local expert's
            # gradient already sums the contributions of every ep rank's batch (their tokens came to it):
            # divide by ep, then average over its dp replicas, to get the same mean as plain data parallel.
            _average_gradients(self._dense, dist.group.WORLD)
            for p in self._experts:
                if p.grad is not None:
                    p.grad /= layout.size("ep")
            if layout.size("dp") > 1:
                _average_gradients(self._experts, layout.group("dp"))
        elif layout.kind == "pp-dp":
            _average_gradients(self._experts + self._dense, layout.group("dp"))

    def _invariant_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """dp-invariant: the global batch [B, ...] as M microbatches of B / M rows, summed in the fixed tree (the
        fsdp layouts: the tree, or fully_shard's accumulation, in their reduce-scatter)."""
        cfg = self.cfg
        if self._fsdp is not None:
            M, group = self._fsdp
        elif self._ep is not None:
            M, group = self._ep.microbatches, self._ep.group
        else:
            assert self.invariant is not None
            M, group = self.invariant.microbatches, None
        xs, ys = inputs.chunk(M), targets.chunk(M)
        last = owned_microbatches(M, group)[-1]
        plain_fsdp = self.layout.kind == "fsdp-plain" and self.layout.mesh is not None

        def loss_of(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if plain_fsdp:  # fully_shard's gradient accumulation: one reduce-scatter after the last microbatch
                # mypy, ignored below: fully_shard made the model an FSDPModule, which its static type does not say
                self.raw.set_requires_gradient_sync(i == last)  # type: ignore[operator]
            # Every microbatch holds B / M sequences of T tokens: dividing its mean loss by M is dividing its sum
            # by the global token count, a constant (never a per-rank count).
            lm, mtp = lm_losses(self.raw(xs[i]), ys[i])
            aux = sum((moe.pop_aux_loss() for moe in self.raw.moe_layers()), torch.zeros(()))
            logged = torch.stack([lm.detach(), mtp.detach(), aux.to(lm.device)]) / M
            return (lm + cfg.mtp_loss_coef * mtp) / M, logged

        if self._fsdp is not None:
            _, sums = invariant_backward(self.raw, loss_of, microbatches=M, group=group, sharded=group is not None)
            check_complete(self._comms)
        elif self._ep is not None:
            sums = self._ep.backward(loss_of)
        else:
            assert self.invariant is not None
            _, sums = self.invariant.backward(loss_of)
        self._invariant_sums = sums

    def fingerprint(self) -> tuple[str, dict[str, str]]:
        """The `final params` line's fingerprint of every parameter of the whole model in name order (the
        fingerprint of the vector of their fingerprints): the same at every W, and under tp at every T; and on the
        fsdp layouts each parameter's fingerprint by name (the `final param` lines: each rank holds shards, which
        the tracer records, so these name the parameter that differs). A pipeline's stages each give their own
        parameters' entries (under tp, a chunk's from the tp rank that holds it, a replica's from tp rank 0).
        Collective: every rank calls it."""
        from detrace.digest import fingerprint

        named = list(self.raw.named_parameters())
        whole = [whole_tensor(p.detach()) for _, p in named]  # fsdp: gathered, an exact copy
        digests = dict(zip((n for n, _ in named), _digests(whole).unbind(), strict=True))
        if self._pipeline is not None:  # the whole model's vector as `by_global_name`'s (by sorted name), each entry
            # from the one rank of the stage's tp group that gives it, summed over tp, then over pp (x + 0 is x)
            index = {n: i for i, n in enumerate(sorted(self._pipeline.names))}
            replicas_here = self._tp_group is None or dist.get_rank(self._tp_group) == 0
            vector = torch.zeros(len(index), dtype=torch.int64, device=self.layout.device)
            for name, digest in digests.items():
                if name in self._pipeline.chunked or replicas_here:
                    vector[index[name]] = digest
            for dim in ("tp", "pp"):
                if self.layout.size(dim) > 1:
                    vector = sum_of_parts(vector, self.layout.group(dim))
            digests = dict(zip(index, vector.unbind(), strict=True))
        each = {n: f"{int(d) & (1 << 64) - 1:016x}" for n, d in digests.items()} \
            if self.layout.kind.startswith(("fsdp-", "ep-")) and self._tp_group is None else {}
        if self._pipeline is not None:
            return fingerprint(torch.stack(list(digests.values()))).hex, each
        return fingerprint(by_global_name(self.raw, digests, dtype=torch.int64, group=self._tp_group)).hex, each

    def _owned(self, name: str, param: torch.Tensor) -> bool:
        """Whether this rank counts `param`'s local gradient in the global norm: a parameter is split over
        pp (each stage its own), over ep if it is an expert, over its DTensor mesh dims; on every other mesh
        dimension it is a replica, and only coordinate 0 counts it."""
        from torch.distributed.tensor import DTensor

        split = {"pp"} | ({"ep"} if _is_expert(name) else set())
        if isinstance(param, DTensor):
            split |= set(param.device_mesh.mesh_dim_names or ())
        return all(self.layout.coord(d) == 0 for d in self.layout.sizes if d not in split)

    def metrics(self) -> dict[str, torch.Tensor]:
        """loss, lm, mtp, aux, grad_norm of this step over the whole world (float32 scalars, same on all ranks).

        loss = lm + mtp_coef * mtp + aux_coef * aux, the objective the gradients are of.
        """
        layout, cfg = self.layout, self.cfg
        if self._pipeline is not None:
            self._invariant_sums, sq = self._pipeline.sums()
            lm, mtp, aux = self._invariant_sums.unbind()
            loss = lm + cfg.mtp_loss_coef * mtp + cfg.aux_loss_coef * aux
            return {"loss": loss, "lm": lm, "mtp": mtp, "aux": aux, "grad_norm": sq.sqrt()}
        if self._invariant_sums is not None:
            # Every rank holds every gradient (of its chunks, under tp) and the tree's sums: the same bits at every W.
            lm, mtp, aux = self._invariant_sums.unbind()
            if not self._chunked:  # fsdp: each gradient gathered (exact), summed as at one rank
                sq = torch.zeros((), device=layout.device)
                for p in self.raw.parameters():
                    if p.grad is not None:
                        sq += whole_tensor(p.grad).float().square().sum()
            else:  # one squared norm per parameter of the whole model, by global name, summed in that order (T = 1
                # too: the chunked layers' runs print the same norm at every T)
                squares = {n: whole_tensor(p.grad).float().square().sum()
                           for n, p in self.raw.named_parameters() if p.grad is not None}
                sq = by_global_name(self.raw, squares, dtype=torch.float32, group=self._tp_group).sum()
            loss = lm + cfg.mtp_loss_coef * mtp + cfg.aux_loss_coef * aux
            return {"loss": loss, "lm": lm, "mtp": mtp, "aux": aux, "grad_norm": sq.sqrt()}
        has_loss = bool(self._lm) and layout.coord("tp") == 0
        per_stream = 1.0 / layout.data_streams
        share = torch.zeros(4, device=layout.device)  # lm, mtp, aux, squared grad norm
        if has_loss:
            share[0] = torch.stack(self._lm).mean() * per_stream
            share[1] = torch.stack(self._mtp).mean() * per_stream
        if layout.coord("tp") == 0:
            micro = PP_MICROBATCHES if self.schedule is not None else 1
            for moe in self.raw.moe_layers():
                share[2] += moe.pop_aux_loss().to(layout.device) / micro * per_stream
        else:
            for moe in self.raw.moe_layers():
                moe.pop_aux_loss()
        for name, p in self.raw.named_parameters():
            if p.grad is not None and self._owned(name, p):
                share[3] += local_tensor(p.grad).float().square().sum()
        if layout.world > 1:
            gathered = [torch.empty_like(share) for _ in range(layout.world)]
            dist.all_gather(gathered, share)
            total = torch.zeros_like(share)
            for s in gathered:  # rank order: the sum's bits do not depend on the collective's algorithm
                total += s
        else:
            total = share
        lm, mtp, aux, sq = total.unbind()
        loss = lm + cfg.mtp_loss_coef * mtp + cfg.aux_loss_coef * aux
        return {"loss": loss, "lm": lm, "mtp": mtp, "aux": aux, "grad_norm": sq.sqrt()}
