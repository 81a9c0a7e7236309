"""The audit inside CMD's processes: armed by `detrace audit` (DETRACE_AUDIT, next to the tracer's
DETRACE_TRACE) in every process the tracer arms, it watches the audited steps and writes
`<run>/audit/rank-<r>.json` when they are over (or at exit, for a shorter run).

The tracer keeps the place: step, phase, rank, and the module scope where it records the module rung (which
`detrace audit` asks for over the audited steps). The probe adds:
- a dispatch mode that judges every call of a catalogued ATen op (`catalog.BY_OP`) as it happens, with its
  indices (only those ops cost anything);
- a wrapper of Inductor's output-code loading that scans each loaded module's kernels for atomics
  (`kernels.scan`) and notes where the module first runs;
- a watch on DataLoader fetchers' collate_fn (a random draw in it is reported; from a worker, through a file);
- once the steps are over: the settings (`detrace.recipe.doctor`), the process group's NCCL settings, the live DDP
  wrappers and DataLoaders (`judge`).
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detrace import record as tracing
from detrace._compat import (
    TorchDispatchMode,
    current_dispatch_mode,
    dataset_fetchers,
    inductor_config,
    inductor_imported,
    op_schema,
    pop_mode,
    push_mode,
    wrap_output_code,
)
from detrace._numbers import parse_count
from detrace.investigate.audit import judge
from detrace.investigate.audit.catalog import BY_OP
from detrace.investigate.audit.kernels import KernelScan, scan
from detrace.investigate.audit.records import AUDIT_DIR, ENV_AUDIT, SCHEMA, Fixer, Hazard, rank_file
from detrace.investigate.audit.seeding import SeedWatch
from detrace.record.patch import replace as patch
from detrace.record.rungs.module import owner
from detrace.record.session import Tracer
from detrace.state.buckets import pinned
from detrace.tracefile.writer import write_json_atomic

Undo = Callable[[], None]


@dataclass
class _Seen:
    """One kind of hazard seen in calls: the first call's place, and how often it recurred."""

    hazard: Hazard
    count: int = 1


def _arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name (defaults filled in)."""
    values = {}
    for position, argument in enumerate(op_schema(func).arguments):
        if position < len(args):
            values[argument.name] = args[position]
        elif argument.name in kwargs:
            values[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def _device(args: tuple) -> str:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


_FIXES: dict[Fixer, str] = {
    "deterministic": "detrace.deterministic(seed) (torch.use_deterministic_algorithms) runs a deterministic kernel",
    "kernels": ("detrace.deterministic(seed) (torch.use_deterministic_algorithms) runs a deterministic kernel; "
                'kernels="detrace" routes it to detrace.ops\' faster one'),
    "code": ("torch has no deterministic kernel for this call (under torch.use_deterministic_algorithms it "
             "raises): write it another way (distinct indices, or a sort then a segment sum)"),
}


class _OpProbe(TorchDispatchMode):
    """Judges every call of a catalogued op (others pass straight through)."""

    def __init__(self, probe: AuditProbe) -> None:
        super().__init__()
        self.probe = probe

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo compiles as it would without the mode; the compiled code's ATen fallbacks still reach it.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        entry = BY_OP.get(func.overloadpacket.__name__) if func.namespace == "aten" else None
        if entry is not None and self.probe.watching:
            verdict = judge.judge_op(entry, device=_device(args), arguments=_arguments(func, args, kwargs),
                                     deterministic=torch.are_deterministic_algorithms_enabled(),
                                     threads=torch.get_num_threads())
            if verdict is not None:
                certainty, why, fixed_by = verdict
                self.probe.saw(Hazard(kind="op", certainty=certainty, subject=str(func), what=why,
                                      fix=_FIXES[fixed_by], fixed_by=fixed_by, source=entry.source,
                                      **self.probe.place()))
        return func(*args, **kwargs)


class _WatchedCollate:
    """A collate_fn that reports a draw from a global RNG (torch's, random's, numpy's) made while it runs."""

    def __init__(self, collate: Callable[..., Any], report: Callable[[str], None]) -> None:
        self.collate = collate
        self.report = report
        self.name = getattr(collate, "__qualname__", type(collate).__name__)

    def __call__(self, batch: Any) -> Any:
        before = _global_rng_states()
        out = self.collate(batch)
        if _global_rng_states() != before:
            self.report(self.name)
        return out


def _global_rng_states() -> tuple[bytes, object, bytes, int]:
    """torch's default CPU generator, random's and numpy's global RNG, as comparable values."""
    _, keys, position, *_ = np.random.get_state(legacy=True)
    return bytes(torch.random.get_rng_state().numpy()), random.getstate(), np.asarray(keys).tobytes(), int(position)


class AuditProbe:
    """The audit of one process (see the module docstring)."""

    def __init__(self, tracer: Tracer, steps: int) -> None:
        self.tracer = tracer
        self.steps = steps
        self.seen: dict[tuple[Any, ...], _Seen] = {}
        self.kernels: list[tuple[KernelScan, dict[str, Any]]] = []
        self.collate_draws: set[str] = set()
        self.worker_drew = False
        """A fetch in this DataLoader worker changed a global RNG (told to the parent once)."""
        self.threads_set = False
        """CMD called torch.set_num_threads."""
        self.seeds = SeedWatch()
        self.started = False
        self.written = False
        self.inductor = False
        self.compiled = False
        """Inductor loaded compiled code in this process."""
        self.pid = os.getpid()
        """The process that armed it: a forked child (a DataLoader worker) writes no report of its own."""
        self.mode = _OpProbe(self)
        self.undo: list[Undo] = []

    @property
    def watching(self) -> bool:
        """In an audited step (global steps 0 to steps - 1) of a traced rank, outside the tracer's own code."""
        tracer = self.tracer
        return tracer.enabled and tracer.clock.step < self.steps and not tracer.busy

    def place(self) -> dict[str, Any]:
        tracer = self.tracer
        # In the backward the module is the one whose forward created the running node (the scope stack follows
        # the modules' tensor hooks, not the nodes: code in the root's own forward would be named after the last
        # submodule whose backward began).
        return {"step": tracer.clock.step, "phase": tracer.phase, "module": owner(tracer.phase, tracer.scope)}

    def saw(self, hazard: Hazard) -> None:
        key = hazard.key()
        if key in self.seen:
            self.seen[key].count += 1
        else:
            self.seen[key] = _Seen(hazard)

    # -- compiled code ------------------------------------------------------------------------------------------

    def loaded(self, module: Any) -> None:
        """An output code module was loaded: scan its kernels; note where it first runs."""
        self.compiled = True
        path = getattr(module, "__file__", None)
        try:
            found = scan(Path(path).read_text()) if path else []
        except OSError:
            return
        if not found or getattr(module, "_detrace_audited", False):
            return
        module._detrace_audited = True
        generated = {"deterministic": torch.are_deterministic_algorithms_enabled(),
                     "inductor_deterministic": _inductor_deterministic(), "code": str(path), "ran": None}
        for kernel in found:
            self.kernels.append((kernel, generated))
        call = getattr(module, "call", None)
        if callable(call):
            def first_call(*args: Any, **kwargs: Any) -> Any:
                if generated["ran"] is None:
                    generated["ran"] = {**self.place(), "threads": torch.get_num_threads()}
                return call(*args, **kwargs)

            module.call = first_call

    def patch_inductor(self) -> None:
        if self.inductor:
            return
        self.inductor = True
        self.undo.append(wrap_output_code(self.loaded))

    # -- data ---------------------------------------------------------------------------------------------------

    def collate_drew(self, name: str) -> None:
        if torch.utils.data.get_worker_info() is None:
            self.collate_draws.add(name)
            return
        # In a worker: the parent never sees this object again; a file tells it.
        self._tell_parent("collate", {"collate_fn": name})

    def _tell_parent(self, what: str, data: dict[str, Any]) -> None:
        folder = Path(self.tracer.config.out) / AUDIT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / f"{what}-{os.getpid()}.json", data)

    def patch_fetchers(self) -> None:
        for fetcher in dataset_fetchers():
            fetch = fetcher.fetch  # type: ignore[attr-defined]  # each has fetch (pinned in tests/unit/test_compat.py)

            def watched_fetch(self_: Any, index: Any, _fetch: Callable[..., Any] = fetch) -> Any:
                if not isinstance(self_.collate_fn, _WatchedCollate):
                    self_.collate_fn = _WatchedCollate(self_.collate_fn, self.collate_drew)
                worker = torch.utils.data.get_worker_info()
                before = _global_rng_states() if worker is not None and not self.worker_drew else None
                batch = _fetch(self_, index)
                if before is not None and _global_rng_states() != before:
                    self.worker_drew = True  # once per worker: the parent needs to know that one did
                    self._tell_parent("draws", {"worker": worker.id})  # type: ignore[union-attr]
                return batch

            self.undo.append(patch(fetcher, "fetch", watched_fetch))

    def patch_threads(self) -> None:
        """Training in `threading.Thread`s: the dispatch mode is per thread, so each thread started while the
        probe watches takes it at its first call (threading.setprofile's hook, removed at once)."""
        def enter(frame: Any, event: str, arg: Any) -> None:
            sys.setprofile(None)
            if self.watching and not self.written:
                push_mode(self.mode)

        threading.setprofile(enter)
        self.undo.append(lambda: threading.setprofile(None))  # None clears it
        original = torch.set_num_threads

        def set_num_threads(threads: int) -> None:
            self.threads_set = True
            original(threads)

        self.undo.append(patch(torch, "set_num_threads", set_num_threads))

    # -- the end of the audited steps -----------------------------------------------------------------------------

    def switch(self) -> None:
        """Tracer listener (called when the rungs recording change): the report is written once the audited
        steps are over, while the program's objects are alive. `detrace audit` records the module rung over
        exactly those steps, so this is called at their end; under a tracer whose windows do not end there
        (`detrace locate`'s first run), the report is written at exit."""
        if not self.started:
            self.started = True
            push_mode(self.mode)
        over = self.tracer.clock.step >= self.steps or not self.tracer.enabled
        if over and not self.written and os.getpid() == self.pid:
            self.remove_mode()
            self.write()

    def remove_mode(self) -> None:
        if current_dispatch_mode() is self.mode:
            pop_mode()

    def hazards(self) -> list[Hazard]:
        """Everything this process saw, and what it holds now."""
        from detrace.recipe.doctor import audit

        rank, world_size, backend = _process_group(self.tracer)
        ranks = (rank,)
        found = [replace(seen.hazard, count=seen.count, ranks=ranks) for seen in self.seen.values()]
        found += self._kernel_hazards(ranks)
        # doctor's "torch.compile in use" only sees that Dynamo is imported (torch.optim imports it): here it
        # counts only when Inductor loaded compiled code; OMP_NUM_THREADS unset is no risk once CMD set the count.
        found += judge.settings_hazards(f for f in audit() if (f.name != "torch.compile" or self.compiled)
                                        and (f.name != "OMP_NUM_THREADS" or not self.threads_set))
        found += self.seeds.hazards()
        found += judge.communication_hazards(os.environ, backend, world_size, rank)
        found += judge.parallel_hazards(_live(_ddp_type()), world_size, rank, pinned)
        folder = Path(self.tracer.config.out) / AUDIT_DIR
        draws = set(self.collate_draws)
        for path in folder.glob("collate-*.json"):
            draws.add(json.loads(path.read_text())["collate_fn"])
        found += judge.data_hazards(_live(torch.utils.data.DataLoader), draws,
                                    torch_unseeded=self.seeds.torch_unseeded,
                                    workers_draw=any(folder.glob("draws-*.json")))
        return [replace(h, ranks=ranks) if not h.ranks else h for h in found]

    def _kernel_hazards(self, ranks: tuple[int, ...]) -> list[Hazard]:
        hazards = []
        for kernel, generated in self.kernels:
            ran = generated["ran"]
            threads = ran["threads"] if ran else torch.get_num_threads()
            races = ran is not None and (kernel.device != "cpu" or threads > 1)
            what = (f"{kernel.backend} kernel adds with {', '.join(kernel.atomics)}"
                    + (" (a split reduction combining partial sums with atomics)" if kernel.split_reduction else "")
                    + f": the order of the adds, and the result's last bits, change from run to run; lowered "
                      f"from {', '.join(kernel.aten) or 'ops its name does not give'}; generated while "
                      f"torch.use_deterministic_algorithms was {'on' if generated['deterministic'] else 'off'} "
                      f"and Inductor's deterministic mode {'on' if generated['inductor_deterministic'] else 'off'}")
            if ran is None:
                what += "; loaded but not run in the audited steps"
            elif kernel.device == "cpu" and threads < 2:
                what += "; it races at 2+ threads, and this run used 1"
            place = {k: ran[k] for k in ("step", "phase", "module")} if ran else {}
            hazards.append(Hazard(kind="kernel", certainty="certain" if races else "possible", subject=kernel.name,
                                  what=what, aten=kernel.aten, ranks=ranks, source=generated["code"],
                                  fix=("call detrace.deterministic(seed) before the first compiled call: Inductor "
                                       "then generates deterministic code for these ops (it reads the flags when "
                                       "it generates code, not when the code runs)"),
                                  fixed_by="deterministic", **place))
        return hazards

    def write(self) -> None:
        self.written = True
        rank, world_size, _ = _process_group(self.tracer)
        try:
            hazards = self.hazards()
            path = rank_file(Path(self.tracer.config.out), rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            # The steps that ran in the window, not the steps asked for: a run that ends (or crashes) early
            # audited fewer, and one that never stepped audited none.
            write_json_atomic(path,
                              {"schema": SCHEMA, "rank": rank, "world_size": world_size,
                               "steps": min(self.steps, self.tracer.clock.step + self.tracer.clock.trailing),
                               "hazards": [h.to_json() for h in hazards]})
        except Exception as err:  # the program must run on; say why this rank's audit is missing
            print(f"detrace: the audit of rank {rank} was not written: {err}", file=sys.stderr)

    def close(self) -> None:
        self.remove_mode()
        if not self.written and os.getpid() == self.pid:
            self.write()
        for undo in reversed(self.undo):
            undo()
        self.undo.clear()


def _inductor_deterministic() -> bool:
    return bool(getattr(inductor_config(), "deterministic", False))


def _process_group(tracer: Tracer) -> tuple[int, int, str | None]:
    """(rank, world size, backend) of the default process group; (tracer's rank or 0, 1, None) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    return tracer.rank or 0, 1, None


def _ddp_type() -> type:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _live(kind: type) -> list[Any]:
    """Every live object of a type (one scan of the garbage collector's objects), in creation order."""
    return [obj for obj in gc.get_objects() if issubclass(type(obj), kind)]


def arm_from_env() -> None:
    """Arm the probe where `detrace audit` asks for it (ENV_AUDIT: how many steps to audit), beside the tracer that
    `detrace run`'s start-up hook has just started in this process (the hook calls this next), and take it down
    with that tracer. A malformed value is one sentence on stderr, the audit off and the program on: the rule for
    every detrace variable read in the training process."""
    text, tracer = os.environ.get(ENV_AUDIT), tracing.active()
    if not text or not isinstance(tracer, Tracer):
        return
    steps = parse_count(text)
    if not steps:
        print(f"detrace: {ENV_AUDIT} must be a positive number of steps, not {text[:40]!r}; the audit is off in "
              f"process {os.getpid()}", file=sys.stderr)
        return
    for undo in install(tracer, steps):
        tracing.on_stop(undo)


def install(tracer: Tracer, steps: int) -> list[Undo]:
    """Arm the probe in this process (the tracer's rung must include module, its window the audited steps)."""
    probe = AuditProbe(tracer, steps)
    probe.undo += probe.seeds.install()
    probe.patch_fetchers()
    probe.patch_threads()
    if inductor_imported():
        probe.patch_inductor()
    else:
        original = torch.compile

        def compile(*args: Any, **kwargs: Any) -> Any:
            probe.patch_inductor()
            return original(*args, **kwargs)

        probe.undo.append(patch(torch, "compile", compile))
    tracer.add_listener(probe.switch)
    probe.switch()
    return [probe.close]
