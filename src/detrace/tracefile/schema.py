"""The record schema of a trace: one row per fingerprinted tensor or exact metric.

Identity of a record within a rank is (step, phase, module, name, occurrence, role, index); `seq` orders records
in the rank's execution order and is dense from 0. Records of one op/module/collective call share `event`
(the seq of the call's first record), so the diff can tell inputs from outputs of the same call.
"""

from __future__ import annotations

import pyarrow as pa

from detrace._numbers import parse_count

SCHEMA_VERSION = "detrace.trace/2"
"""Version 2 seals every record batch with a checksum and a running chain (tracefile.integrity); version 1 had
none, so its traces cannot be trusted bit for bit and are refused."""
_FORMAT = "detrace.trace/"

# Ordered: each rung includes the ones before it.
RUNGS = ("metrics", "semantic", "module", "op")
PHASES = ("forward", "backward", "optimizer", "collective", "p2p", "recompute", "data", "checkpoint", "bookkeeping",
          "evaluation", "final", "other")
"""`checkpoint`: anything recorded while a checkpoint is saved or loaded; `bookkeeping`: a collective a training
framework makes for itself (HF Trainer's logging gathers, Lightning's `self.log(sync_dist=True)`); `evaluation`:
what an evaluation of the trained model runs between two steps (detrace.record.rungs.batch); `final`: the state a
run ends with, recorded as its trace closes (one record per parameter of each trained model, by qualified name, role
"param", then the model's digest, role "model"; docs/tracing.md). The diff compares the four apart from the training,
by identity (detrace.analyze.apart)."""
ROLES = (
    "input",  # argument of a module/op/collective call
    "output",  # result of a call
    "mutated",  # tensor written in place by the call (recorded after the call)
    "grad_input",  # module backward: gradients w.r.t. the module's inputs
    "grad_output",  # module backward: gradients w.r.t. the module's outputs
    "grad",  # optimizer: a parameter's gradient going in
    "param",  # optimizer: a parameter coming out
    "state",  # optimizer: a state tensor coming out (exp_avg, ...)
    "buffer",  # optimizer: a module buffer (running statistics, counters, EMA copies) as the step ends
    "metric",  # an exact scalar (loss, grad norm, detrace.metric)
    "model",  # final state: one digest of a whole model's parameters (the fingerprint of their digests, in order)
    "saved",  # final state: a tensor of a checkpoint saved after the last optimizer step ("<file>:<key path>")
    "component",  # one component (data, scales) of a quantized tensor
)

# (name, type, nullable, doc)
FIELDS: tuple[tuple[str, pa.DataType, bool, str], ...] = (
    ("seq", pa.int64(), False, "per-rank sequence number, dense from 0, in execution order"),
    ("step", pa.int64(), False, "training step (optimizer steps completed before this record)"),
    ("rung", pa.string(), False, "metrics | semantic | module | op"),
    ("phase", pa.string(), False,
     "forward | backward | optimizer | collective | p2p | recompute | data | checkpoint | bookkeeping | evaluation "
     "| final | other"),
    ("module", pa.string(), True, "innermost nn.Module qualified name in scope, if any"),
    ("name", pa.string(), False, "op name (aten.mm.default), module name, collective (all_reduce) or metric"),
    ("occurrence", pa.int32(), False, "how many calls with this (phase, module, name) came before in this step"),
    ("event", pa.int64(), False, "seq of the first record of the call this record belongs to"),
    ("role", pa.string(), False, "input | output | mutated | grad_input | grad_output | grad | param | ..."),
    ("index", pa.int32(), False, "position of the tensor among the call's tensors of that role"),
    ("shape", pa.list_(pa.int64()), False, "tensor shape"),
    ("dtype", pa.string(), False, "torch dtype name without 'torch.'"),
    ("numel", pa.int64(), False, "number of elements"),
    ("digest", pa.uint64(), True, "fingerprint; null when not taken (tensor above --max-numel)"),
    ("chunks", pa.list_(pa.uint64()), True, "chunk-wise digests along dim 0, when recorded"),
    ("value", pa.float64(), True, "exact metric value (every float up to 64 bits converts exactly)"),
    ("collectives", pa.int64(), False, "collectives completed on this rank before this record (all groups)"),
    ("group", pa.string(), True, "collective/p2p records: ranks of the process group, e.g. '0,1'"),
    ("group_seq", pa.int64(), True, "collective/p2p records: index of the call within its group on this rank"),
    ("peer", pa.int32(), True, "p2p records: the peer rank"),
    ("extra", pa.string(), True, "JSON object with rung-specific facts (EXTRA_KEYS)"),
)

# Keys the tracer writes into `extra`. A `component` record follows the record of the quantized tensor it is a
# component of, within the same call (same `event`).
EXTRA_KEYS = {
    "matches_forward": "recompute records: whether the recomputed output has the original forward's bits",
    "functional": "collective records made through torch.distributed._functional_collectives (recorded at wait)",
    "component": "component records: the component's name (e.g. 'data', 'scales')",
    "of": "component records: the role of the quantized tensor it belongs to",
    "index": "component records: the index of the quantized tensor it belongs to",
    "state": "optimizer state records: the optimizer state keys (e.g. ['exp_avg', 'exp_avg_sq'])",
    "ddp_bucket": "DDP gradient all-reduce records: the index of the gradient bucket",
    "samples": "data records named samples: the dataset indices of the batch's samples, in order",
    "mismatches": "guard records: the replicated tensors whose replicas differ, with the odd ranks",
}

ARROW_SCHEMA = pa.schema([pa.field(name, typ, nullable=nullable) for name, typ, nullable, _ in FIELDS])
COLUMN_NAMES = tuple(name for name, *_ in FIELDS)


def format_refusal(source: object, version: object) -> str:
    """The sentence refusing a file of another trace format version than SCHEMA_VERSION."""
    number = version[len(_FORMAT):] if isinstance(version, str) and version.startswith(_FORMAT) else ""
    ours, theirs = int(SCHEMA_VERSION[len(_FORMAT):]), parse_count(number)
    if theirs is not None and theirs < ours:
        return (f"{source} was written by an older detrace in trace format {version}, which has no batch "
                f"checksums; this detrace reads only {SCHEMA_VERSION}: record the run again")
    if theirs is not None:
        return (f"{source} was written by a newer detrace in trace format {version}; this detrace reads only "
                f"{SCHEMA_VERSION}: upgrade detrace to read it")
    return f"{source} is not a detrace trace: its format is {version!r}, not {SCHEMA_VERSION}"


def rung_includes(rung: str, other: str) -> bool:
    """Whether recording at `rung` also records `other` (each rung includes the ones below it)."""
    return RUNGS.index(other) <= RUNGS.index(rung)
