"""The replica guard: replicated tensors must hold the same bits on every replica after every optimizer step.

    detrace.guard(every=1)                       # in the training script, once, before training
    detrace run --guard 1 -- torchrun ...        # the same with no edit (DETRACE_GUARD=1)

A deterministic data-parallel run keeps its replicas bit-identical; a replica that differs was hit by a fault
(silent data corruption in a core or in memory, a bad link) or by a software bug. Every `every` global steps,
after the optimizer step, each rank digests its optimizer's parameters and state tensors on their device
(XXH3-64 on the CPU, the fp1 fingerprint on an accelerator: `_digests` says why) and the ranks exchange the
digests: one all-gather of 8 bytes per tensor over the default group (and, once, one of the tensors'
identities). This is the guard's own collective, made at the same step on every
rank, which is why the guard is opt-in.

Which tensors are replicas of which: the same qualified name (DDP's and torch.compile's prefixes looked
through) and the same shard. A plain tensor is the same shard everywhere, as torch.distributed.checkpoint also
assumes; a DTensor's shard is its coordinates on the mesh dimensions it is sharded over, so DDP replicas, the
replicate dimension of HSDP / FSDP2, parameters replicated across tensor-parallel ranks and expert shards
replicated across data-parallel ranks are compared, and FSDP shards are not.

On a mismatch the guard names the step, the tensor and the odd rank: by majority with three or more replicas,
both ranks with two. It writes a `guard` record into the trace (when one is recording) and, in the default
`stop` mode, ends the process with exit code 3 right after that optimizer step, before the training loop can
write its next checkpoint: a corrupted state never replaces a good checkpoint. `warn` reports and goes on.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import xxhash
from torch.optim.optimizer import register_optimizer_step_post_hook

from detrace._numbers import parse_count
from detrace.defects.faults import global_step
from detrace.errors import UsageError

ENV_GUARD = "DETRACE_GUARD"
GUARD_EXIT_CODE = 3
"""The exit code of a process the guard stops (1 and 2 are the CLI's answers; 3 says: a replica was corrupted)."""

Mode = Literal["stop", "warn"]


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """One replicated tensor whose replicas disagree after an optimizer step."""

    step: int
    """The global step after whose optimizer step the replicas differ."""
    tensor: str
    """Qualified name; optimizer state as `NAME[exp_avg]`; a shard as `NAME@coords`."""
    odd_ranks: tuple[int, ...]
    """The ranks outvoted by the majority; with two replicas (or a tie), every replica."""
    replicas: tuple[int, ...]
    """Every rank that holds this tensor."""

    def sentence(self) -> str:
        ranks = ", ".join(map(str, self.odd_ranks))
        who = "rank" if len(self.odd_ranks) == 1 else "ranks"
        how = "outvoted by the other replicas" if len(self.odd_ranks) < len(self.replicas) else "no majority"
        return (f"step {self.step}: the replicas of {self.tensor} differ after the optimizer step: {who} {ranks} "
                f"({how}, of {len(self.replicas)} replicas)")


def _key_hash(key: str) -> int:
    """A signed 64-bit identity of a tensor key, for the one-time exchange of identities."""
    from detrace.digest import fingerprint
    from detrace.digest.scheme import signed

    data = torch.frombuffer(bytearray(key.encode()), dtype=torch.uint8) if key else torch.zeros(0, dtype=torch.uint8)
    return signed(fingerprint(data).digest)


def _shard_of(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A tensor's local data and its shard coordinates ("" for a plain tensor or a fully replicated DTensor)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return tensor, ""
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    coords = mesh.get_coordinate() or []
    sharded = [f"{dim}:{coords[dim]}" for dim, p in enumerate(placements) if not p.is_replicate()]
    return tensor.to_local(), ",".join(sharded)  # type: ignore[attr-defined]


def _guarded(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[tuple[str, torch.Tensor]]:
    """(key, local tensor) for each parameter and each state tensor of `optimizer`, in the optimizer's order."""
    out: list[tuple[str, torch.Tensor]] = []
    for group in optimizer.param_groups:
        for i, param in enumerate(group["params"]):
            name = names.get(id(param), f"param{i}")
            for suffix, tensor in [("", param), *sorted(
                    (f"[{k}]", v) for k, v in optimizer.state.get(param, {}).items()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)]:
                local, shard = _shard_of(tensor)
                out.append((f"{name}{suffix}" + (f"@{shard}" if shard else ""), local))
    return out


def vote(keys: list[list[int]], digests: list[list[int]], labels: dict[int, str], step: int) -> list[Mismatch]:
    """The mismatches among per-rank (key hash, digest) lists: replicas share a key hash."""
    holders: dict[int, dict[int, int]] = {}
    for rank, (rank_keys, rank_digests) in enumerate(zip(keys, digests, strict=True)):
        for key, digest in zip(rank_keys, rank_digests, strict=True):
            holders.setdefault(key, {})[rank] = digest
    found = []
    for key, by_rank in holders.items():
        if len(by_rank) < 2 or len(set(by_rank.values())) == 1:
            continue
        counts = Counter(by_rank.values()).most_common()
        majority = counts[0][0] if len(counts) == 1 or counts[0][1] > counts[1][1] else None
        odd = tuple(sorted(r for r, d in by_rank.items() if majority is None or d != majority))
        found.append(Mismatch(step=step, tensor=labels.get(key, f"#{key:x}"), odd_ranks=odd,
                              replicas=tuple(sorted(by_rank))))
    return sorted(found, key=lambda m: m.tensor)


class Guard:
    """The replica guard (see the module docstring): `install()` it, `remove()` it."""

    def __init__(self, *, every: int, mode: Mode) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"the guard's every must be a positive integer, not {every!r}")
        if mode not in ("stop", "warn"):
            raise UsageError(f"the guard's mode must be 'stop' or 'warn', not {mode!r}")
        self.every = every
        self.mode: Mode = mode
        self.completed = 0
        self.mismatches: list[Mismatch] = []
        """Every mismatch found in this process (warn mode keeps going)."""
        self._layout: dict[int, tuple[list[list[int]], dict[int, str], int]] = {}
        """id(optimizer) -> (every rank's key hashes, key hash -> label, the longest list): exchanged once."""
        self._names: dict[int, str] | None = None
        self._remove: Callable[[], None] | None = None

    def install(self) -> Guard:
        """Check after every optimizer step from now on (a global optimizer hook)."""
        if self._remove is None:
            self._remove = register_optimizer_step_post_hook(self._after_step).remove
        return self

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The optimizer has updated its state: `step` now counts this step too.
        step = global_step(optimizer, self.completed + 1) - 1
        self.completed += 1
        if step % self.every or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        from detrace import record as tracing

        tracer: Any = tracing.active()
        if tracer is not None:
            with tracer.own():
                mismatches = self.check(optimizer, step)
        else:
            mismatches = self.check(optimizer, step)
        if tracer is not None:
            _record(tracer, step, mismatches)
        if not mismatches:
            return
        self.mismatches.extend(mismatches)
        for mismatch in mismatches:
            print(f"detrace guard: {mismatch.sentence()}", file=sys.stderr, flush=True)
        if self.mode == "stop":
            print(f"detrace guard: stopping with exit code {GUARD_EXIT_CODE} before another checkpoint is written",
                  file=sys.stderr, flush=True)
            from detrace._exit import leave

            leave(GUARD_EXIT_CODE)

    def check(self, optimizer: torch.optim.Optimizer, step: int) -> list[Mismatch]:
        """Digest this rank's replicated tensors and compare them with every other rank's (collective)."""
        from detrace.record.names import parameter_names

        if self._names is None:
            self._names = parameter_names()
        tensors = _guarded(optimizer, self._names)
        device = tensors[0][1].device if tensors and dist.get_backend() == "nccl" else torch.device("cpu")
        if id(optimizer) not in self._layout:
            self._layout[id(optimizer)] = self._exchange_keys([key for key, _ in tensors], device)
        keys, labels, width = self._layout[id(optimizer)]
        digests = _digests([t for _, t in tensors])
        gathered = _all_gather(digests, width, device)
        return vote(keys, [g[:len(k)] for g, k in zip(gathered, keys, strict=True)], labels, step)

    @staticmethod
    def _exchange_keys(keys: list[str], device: torch.device) -> tuple[list[list[int]], dict[int, str], int]:
        hashes = [_key_hash(key) for key in keys]
        counts = _all_gather([len(hashes)], 1, device)
        width = max(c[0] for c in counts)
        gathered = _all_gather(hashes, width, device)
        return ([g[:c[0]] for g, c in zip(gathered, counts, strict=True)],
                dict(zip(hashes, keys, strict=True)), width)


def _digests(tensors: list[torch.Tensor]) -> list[int]:
    """One digest per tensor (signed 64-bit, for the all-gather): XXH3-64 on the CPU, detrace-fp1 elsewhere.

    The guard compares replicas within one run, each on the same kind of device, so it needs no digest that
    means the same across devices and processes, which is what detrace-fp1 is for. On the CPU it takes XXH3-64 of
    the tensor's bytes (seeded with its dtype and shape): XXH3 reads at memory speed, while fp1's 64-bit
    multiplies make it compute-bound (about 6 GB/s per core with AVX2), twice as slow on the guard's hundreds of
    MB per step. On an accelerator fp1 runs on the device, where it is memory-bound, and one transfer reads back
    all the digests.
    """
    from detrace.digest import fingerprint_many
    from detrace.digest.inputs import dtype_name, logical_bytes, plain
    from detrace.digest.scheme import header, signed

    out: list[int] = [0] * len(tensors)
    elsewhere: list[int] = []
    for i, tensor in enumerate(tensors):
        t = plain(tensor)
        if t.device.type != "cpu":
            elsewhere.append(i)
            continue
        seed = header(dtype_name(t.dtype), tuple(t.shape))
        out[i] = signed(xxhash.xxh3_64_intdigest(logical_bytes(t).numpy().data, seed))
    for i, fp in zip(elsewhere, fingerprint_many([tensors[i] for i in elsewhere]), strict=True):
        out[i] = signed(fp.digest)
    return out


def _all_gather(values: list[int], width: int, device: torch.device) -> list[list[int]]:
    """Every rank's `values` (padded to `width` int64s): one all_gather over the default group."""
    local = torch.zeros(width, dtype=torch.int64, device=device)
    local[:len(values)] = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def _record(tracer: Any, step: int, mismatches: list[Mismatch]) -> None:
    """A `guard` record in the trace: the verdict of this step's check, on every rank alike."""

    if not tracer.on.get("semantic") and not tracer.on.get("metrics"):
        return
    extra = json.dumps({"mismatches": [{"tensor": m.tensor, "odd_ranks": list(m.odd_ranks)} for m in mismatches]})
    call = tracer.begin("metrics", "optimizer", "guard", extra=extra)
    call.step = step  # the guard runs after the step's clock moved on; its verdict is about this step
    tracer.emit_metric(call, float(len(mismatches)), "float64")


_guard: Guard | None = None


def guard(*, every: int = 1, mode: Mode = "stop") -> Guard:
    """Compare the replicas of every replicated tensor every `every` global steps (see the module docstring).

    Call it once, before training, in every rank. A second call replaces the first.
    """
    global _guard
    if _guard is not None:
        _guard.remove()
    _guard = Guard(every=every, mode=mode).install()
    return _guard


def parse_env(text: str) -> tuple[int, Mode]:
    """`N` or `N:warn` (DETRACE_GUARD, what `detrace run --guard` sets)."""
    every_text, _, mode = text.partition(":")
    every = parse_count(every_text)
    if every is None or every < 1 or mode not in ("", "stop", "warn"):
        raise UsageError(f"{ENV_GUARD}={text!r} must be N or N:warn with N a positive integer")
    return every, "warn" if mode == "warn" else "stop"


def arm_from_env() -> Guard | None:
    """Install the guard DETRACE_GUARD asks for (once); None when it is not set."""
    text = os.environ.get(ENV_GUARD)
    if not text or _guard is not None:
        return _guard
    every, mode = parse_env(text)
    return guard(every=every, mode=mode)
