"""Same bits on any layout (public): `data`, the data-parallel sum in one fixed binary tree over microbatches,
whatever the number of ranks (`InvariantDataParallel`, `invariant_backward`); `tensor`, linear layers whose
tensor-parallel sums are fixed trees over model-sized chunks, whatever the TP size (`ColumnParallelLinear`,
`RowParallelLinear`); `fsdp`, fully_shard's reduce-scatter as the same tree over microbatches, whatever the number
of shards (`shard_invariantly`); `pipeline`, a pipeline stage's gradients as that tree, whatever the schedule and
the number of stages (`TreeGradients`, `SeededForwards`); `expert`, expert parallelism whose experts run each
source rank's tokens apart and sum their weight gradients in that tree, whatever the number of expert-parallel ranks
(`FixedOrderExperts`); `layout`, layouts by name (`Layout.parse("fsdp2xtp2")`). Drop-in replacements for
torch's APIs, with torch's signatures: `shard`, `fully_shard`; `plan`, `parallelize_module`, `ColwiseParallel`,
`RowwiseParallel`, `SequenceParallel`; `schedule`, `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`,
`ScheduleLoopedBFS`, `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble` (and torch's `PipelineStage`);
`expert_parallel`, `ExpertParallel` (torchtitan's style for an all-to-all MoE).
See docs/topology.md."""

from detrace.parallel.data import InvariantDataParallel, invariant_backward, owned_microbatches, parameters_fingerprint
from detrace.parallel.expert import FixedOrderExperts
from detrace.parallel.fsdp import FixedOrderReduceScatter, shard_invariantly
from detrace.parallel.layout import Layout
from detrace.parallel.pipeline import SeededForwards, TreeGradients
from detrace.parallel.shard import fully_shard
from detrace.parallel.tensor import ColumnParallelLinear, RowParallelLinear, by_global_name

__all__ = [
    "ColumnParallelLinear",
    "FixedOrderExperts",
    "FixedOrderReduceScatter",
    "InvariantDataParallel",
    "Layout",
    "RowParallelLinear",
    "SeededForwards",
    "TreeGradients",
    "by_global_name",
    "fully_shard",
    "invariant_backward",
    "owned_microbatches",
    "parameters_fingerprint",
    "shard_invariantly",
]

_PLAN = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "parallelize_module")
"""detrace.parallel.plan's drop-ins, imported on first use: torch.distributed.tensor.parallel costs a second of a
rank's start-up, and every traced process imports detrace.parallel."""
_SCHEDULE = ("PipelineStage", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
             "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble")
"""detrace.parallel.schedule's drop-ins (torch's PipelineStage re-exported), imported on first use as the plan's."""
_EXPERT = ("ExpertParallel",)
"""detrace.parallel.expert_parallel's drop-in (torchtitan's style), imported on first use as the plan's."""
__all__ += _PLAN + _SCHEDULE + _EXPERT


def __getattr__(name: str) -> object:
    if name in _PLAN:
        from detrace.parallel import plan

        return getattr(plan, name)
    if name in _EXPERT:
        from detrace.parallel import expert_parallel

        return getattr(expert_parallel, name)
    if name in _SCHEDULE:
        from detrace.parallel import schedule

        return getattr(schedule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
