"""The reference trainer: `python -m detrace.workload.train [options]`, also under torchrun.

    python -m detrace.workload.train --preset tiny --steps 20 --seed 0 --threads 2 --dispatch index
    torchrun --standalone --nproc-per-node 2 -m detrace.workload.train --parallel ddp --threads 1
    python -m detrace.workload.train --deterministic --spike data --spike-step 12   # a planted loss spike

It prints one line per step on rank 0, with the exact bits of the loss and of the gradient norm:

    step 3 loss 5.512713 (0x40b06926) lm 5.489... mtp 5.49... aux 1.00... grad_norm 1.234 (0x3f9df3b6)

It knows nothing of detrace's tracer: `detrace run -- python -m detrace.workload.train ...` injects it from
outside. With `--deterministic` it applies `detrace.deterministic(seed)`; without, it seeds torch and leaves
every other setting at PyTorch's default (and the "index" MoE dispatch is then nondeterministic on CPU with
2+ threads). Checkpoint/resume goes through `detrace.TrainState` and its environment contract
(DETRACE_CKPT_DIR, DETRACE_STOP_AT, DETRACE_RESUME, and the data controls DETRACE_SKIP_STEPS, DETRACE_DATA_SHIFT).
`--spike data|state|both --spike-step S` plants a loss spike of that kind at global step S (off by default): the
workload of `detrace spikes` and `detrace ablate` (docs/ablate.md).
"""

from __future__ import annotations

import argparse
import itertools
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from detrace._exit import leave
from detrace.errors import DetraceError, UsageError
from detrace.parallel.layout import LAYOUT_ENV, Layout
from detrace.parallel.tensor import TP_ENV
from detrace.state.loader import ResumableSampler
from detrace.workload import layouts
from detrace.workload import sharding as parallel
from detrace.workload.corpus import Poisoned, SyntheticTokens, split_batch
from detrace.workload.model import DISPATCHES, PRESETS, QUANT_FORMATS, ModelConfig

PROG = "detrace.workload.train"
NAMED = ("invariant", "plain")
"""--parallel values that take a named layout (--layout): its invariant layers, or their ordinary control."""
SPIKES = ("data", "state", "both", "moments", "weights")
"""The planted spikes' kinds (`TrainConfig.spike`)."""
STATE_BUMP = 300.0
"""The learning-rate factor of the "state" spike's one step: alone, it throws the model off."""
POISON_TOKEN = 0
"""The token the poisoned sequences repeat."""
BOTH_CORRUPTION = -5.0
"""The "both" spike's factor on the embedding and LM-head rows of `POISON_TOKEN`: on clean batches (where the
token is rare) the loss barely moves; on sequences made of that token it jumps."""
BOTH_POISONED = 2
"""Sequences of the "both" spike's batch that are runs of `POISON_TOKEN` (the whole batch for "data")."""
MOMENTS_CORRUPTION = 1e-12
"""The "moments" spike's factor on every second moment (Adam's exp_avg_sq): the next update is far too large."""
WEIGHTS_CORRUPTION = 8.0
"""The "weights" spike's factor on the LM head's weight: the logits are far too sharp."""
WARMUP_STEPS = 10
# Size of one epoch of the synthetic stream; fixed so that a run's first steps do not depend on --steps.
NUM_SAMPLES = 4096


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run of the reference workload. Checked in `__post_init__`."""

    preset: str = "tiny"
    """Model and batch sizes: a key of `model.PRESETS`."""
    steps: int = 20
    """Optimizer steps of the whole run (a resumed run still ends at this step)."""
    seed: int = 0
    """Seeds the weights, the data stream and the sampler's shuffle."""
    threads: int = 2
    """torch.set_num_threads for this process (CPU nondeterminism needs 2 or more)."""
    dispatch: str = "index"
    """MoE dispatch: "index" or "fixed" (see `model.ModelConfig.dispatch`)."""
    recompute: bool = False
    """Activation recompute on every layer."""
    quant: str = "none"
    """Fake-quantized linears: "none", "mxfp8" or "nvfp4"."""
    parallel: str = "none"
    """Parallel layout: a key of `layouts.LAYOUTS` (`parse_args` turns --parallel invariant and plain with a named
    layout into one of them: `resolve_layout`)."""
    deterministic: bool = False
    """Apply `detrace.deterministic(seed)` before anything else."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warmup over the first steps)."""
    batch_size: int | None = None
    """Sequences per data stream per step; None takes the preset's."""
    nondeterministic_from: int | None = None
    """A planted late divergence: the first S optimizer steps (global steps 0..S-1, printed 1..S) run under
    `torch.use_deterministic_algorithms(True)`, the later ones without, so the real race of the "index"
    dispatch starts at global step S. None: PyTorch's defaults throughout (or `deterministic`)."""
    microbatches: int | None = None
    """--parallel dp-invariant, tp-invariant, tp-plain: the global batch's microbatches M (a multiple of the
    data-parallel size)."""
    tp: int = 1
    """--parallel tp-invariant, tp-plain: the tensor-parallel size T (a power of two dividing the world size)."""
    schedule: str = "1f1b"
    """The pipeline schedule of the pp layouts: "1f1b" or "gpipe"."""
    stages: int = 1
    """--parallel pp-invariant: pipeline stages P (each data-parallel over world / (P T) ranks); fsdp-invariant,
    fsdp-plain: the stages of a ppPxfsdpF layout (each sharded over world / P ranks); ep-invariant, ep-plain: the
    stages of a ppPxepE layout (each stage's experts split over world / P ranks, its data blocks over them too)."""
    replicas: int = 1
    """--parallel fsdp-invariant, fsdp-plain: data-parallel replicas D of the sharded model (a named dpDxfsdpF
    layout: each replica's F ranks shard it; HSDP); ep-invariant, ep-plain: the replicas of the experts (a named
    epExdpD layout: each replica's E ranks split the experts); ep-fsdp-invariant: the same over the fsdp dimension
    (a named fsdpFxepE layout)."""
    spike: str | None = None
    """A planted loss spike at global step `spike_step` (off by default), each reproducible from a checkpoint:
    "data": the batch of that step is poisoned (every sequence one repeated token); "state": the optimizer step
    just before it runs at `STATE_BUMP` x the learning rate (a schedule fault: the scheduler's step count decides
    it); "both": right after the step before it, the rows of token `POISON_TOKEN` in the embedding and the LM head
    are scaled by `BOTH_CORRUPTION` (a parameter fault at a step), and `BOTH_POISONED` sequences of the step's batch
    are runs of that token: either alone leaves the loss under the spike threshold, together they spike;
    "moments" and "weights": after S - 1 completed steps (before a save there), every second moment is scaled by
    `MOMENTS_CORRUPTION`, or the LM head's weight by `WEIGHTS_CORRUPTION` (a fault in that part of the state, which
    a checkpoint after S - 1 steps carries; the weights' shows in the loss of step S - 1 as well)."""
    spike_step: int | None = None
    """The global step where the planted spike shows in the loss (steps completed before it)."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise UsageError(f"preset {self.preset!r} must be one of {', '.join(PRESETS)}")
        if self.steps < 1 or self.threads < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise UsageError("--steps, --threads and --batch-size must be positive")
        if self.parallel not in layouts.LAYOUTS:
            raise UsageError(f"parallel layout {self.parallel!r} must be one of {', '.join(layouts.LAYOUTS)}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive, not {self.lr}")
        if self.nondeterministic_from is not None:
            if self.nondeterministic_from < 0:
                raise UsageError(f"--nondeterministic-from must be 0 or more, not {self.nondeterministic_from}")
            if self.deterministic or self.dispatch != "index":
                raise UsageError("--nondeterministic-from plants the race of the index dispatch: it needs "
                                 "--dispatch index and no --deterministic")
        if (self.spike is None) != (self.spike_step is None):
            raise UsageError("--spike and --spike-step go together")
        if self.spike is not None and self.spike not in SPIKES:
            raise UsageError(f"--spike must be one of {', '.join(SPIKES)}, not {self.spike!r}")
        if self.spike_step is not None and self.spike_step < 1:
            raise UsageError(f"--spike-step must be at least 1, not {self.spike_step}")
        if self.spike in ("both", "weights") and self.parallel not in ("none", "ddp"):
            raise UsageError(f"--spike {self.spike} scales whole parameter rows: it needs --parallel none or ddp")
        if self.spike in ("moments", "weights") and self.spike_step is not None and self.spike_step < 2:
            raise UsageError(f"--spike {self.spike} plants its fault after S - 1 completed steps: --spike-step must "
                             "be at least 2")
        if (self.parallel in layouts.INVARIANT) != (self.microbatches is not None):
            raise UsageError(f"--microbatches goes with --parallel {', '.join(layouts.INVARIANT)}, and they need it")
        if self.parallel in layouts.INVARIANT and self.dispatch == "index" and not self.deterministic:
            # Same bits at every world size needs each microbatch's kernels deterministic first.
            raise UsageError(f"--parallel {self.parallel} needs --dispatch fixed or --deterministic (the index "
                             "dispatch's backward races)")
        if self.schedule not in parallel.SCHEDULES:
            raise UsageError(f"--schedule must be one of {', '.join(parallel.SCHEDULES)}, not {self.schedule!r}")
        if self.stages < 1 or (self.stages != 1 and self.parallel not in ("pp-invariant", "pp-plain") and not (
                self.parallel in ("fsdp-invariant", "fsdp-plain", "ep-invariant", "ep-plain") and self.tp == 1
                and self.replicas == 1)):
            raise UsageError("pipeline stages other than 1 go with --parallel pp-invariant, pp-plain, or an fsdp or "
                             "ep layout on a ppPxfsdpF or ppPxepE mesh")
        if self.tp != 1 and not (self.parallel.startswith("tp-") or self.parallel in ("fsdp-invariant",
                                                                                      "pp-invariant", "ep-invariant")):
            raise UsageError("--tp goes with --parallel tp-invariant or tp-plain, or with the fsdp, pp and ep "
                             "invariant layouts of a mesh that names tp")
        if self.replicas < 1 or (self.replicas != 1 and not (self.parallel.startswith("ep-") or (
                self.parallel.startswith("fsdp-") and self.tp == 1))):
            raise UsageError("data-parallel replicas of a sharded model go with --parallel invariant or plain on a "
                             "dpDxfsdpF or epExdpD layout, or invariant on fsdpFxepE")

    def model_config(self) -> ModelConfig:
        base = PRESETS[self.preset]["model"]
        assert isinstance(base, ModelConfig)
        return replace(base, dispatch=self.dispatch, recompute=self.recompute, quant=self.quant)


def parse_args(argv: Sequence[str]) -> TrainConfig:
    p = argparse.ArgumentParser(prog=PROG, description="Train the detrace reference model (hybrid SSM/attention/MoE).")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--dispatch", default="index", choices=DISPATCHES)
    p.add_argument("--recompute", action="store_true", help="activation recompute on every layer")
    p.add_argument("--quant", default="none", choices=QUANT_FORMATS)
    p.add_argument("--parallel", default="none", choices=[*layouts.LAYOUTS, *NAMED],
                   help="a layout kind, or invariant / plain on the named --layout")
    p.add_argument("--layout", default=None,
                   help=f"--parallel invariant or plain: a named layout such as fsdp2 or 2x2 (default: ${LAYOUT_ENV}, "
                        "else dp over every process)")
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="apply detrace.deterministic(seed) (default: off, PyTorch's defaults)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per data stream (default: preset)")
    p.add_argument("--nondeterministic-from", type=int, default=None, metavar="S",
                   help="deterministic for the first S steps, then the index dispatch's real race (global step S on)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="dp-invariant, tp-invariant, tp-plain: microbatches M of the global batch")
    p.add_argument("--tp", type=int, default=None,
                   help=f"tp-invariant, tp-plain: tensor-parallel size T (default: ${TP_ENV} or 1)")
    p.add_argument("--schedule", default="1f1b", choices=parallel.SCHEDULES,
                   help="pipeline schedule of the pp layouts (default 1f1b)")
    p.add_argument("--spike", default=None, choices=SPIKES,
                   help="plant a loss spike at --spike-step: a poisoned batch (data), a learning-rate bump (state), "
                        "a poisoned batch under a smaller bump (both), or a fault in the optimizer's moments or "
                        "the weights after S - 1 steps; off by default")
    p.add_argument("--spike-step", type=int, default=None, metavar="S", help="global step of the planted spike")
    args = p.parse_args(list(argv))
    kind, tp, stages, replicas = resolve_layout(args.parallel, args.layout, args.tp)
    return TrainConfig(**{k: v for k, v in vars(args).items() if k not in ("tp", "layout", "parallel")},
                       parallel=kind, tp=tp, stages=stages, replicas=replicas)


def resolve_layout(parallel: str, layout: str | None, tp: int | None) -> tuple[str, int, int, int]:
    """(layout kind, tensor-parallel size, pipeline stages, data-parallel replicas of a sharded model) of
    --parallel, --layout and --tp: --parallel invariant or plain runs the named layout (--layout, else
    $DETRACE_LAYOUT, else dp over WORLD_SIZE processes) with the invariant layers or their control; any other
    --parallel is itself, with --tp."""
    if parallel not in NAMED:
        if layout is not None:
            raise UsageError("--layout goes with --parallel invariant or plain")
        return parallel, _tp_size(tp), 1, 1
    if tp is not None:
        raise UsageError(f"--parallel {parallel} takes the tensor-parallel size from the layout, not from --tp")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    named = Layout.parse(layout or os.environ.get(LAYOUT_ENV) or f"dp{world}")
    if named.world != world:
        raise UsageError(f"layout {named} takes {named.world} processes, not {world}: launch it with torchrun "
                         f"--nproc-per-node {named.world}")
    if len(named.sizes) > 1 and named.size("pp") == 1:  # one stage is no pipeline: pp1xep2 runs as ep2 does
        named = Layout(name=named.name, sizes=tuple(pair for pair in named.sizes if pair[0] != "pp"))
    t = named.size("tp")
    if "ep" in dict(named.sizes) and set(dict(named.sizes)) <= {"dp", "ep"}:  # ep1 too: its own final param lines
        return f"ep-{parallel}", 1, 1, named.size("dp")
    if "ep" in dict(named.sizes) and parallel == "invariant" and named.dims in ({"fsdp", "ep"}, {"ep", "tp"}):
        # fsdpFxepE: the experts' replicas are the fsdp ranks, the other parameters sharded over fsdp x ep
        return ("ep-fsdp-invariant" if "fsdp" in named.dims else "ep-invariant"), t, 1, named.size("fsdp")
    if "fsdp" not in dict(named.sizes) and named.dims <= {"dp", "tp"} and (parallel == "invariant" or t > 1):
        # a named tp (1x1 too) runs the chunked projections, whose bits are the same at every T (not dp's)
        return ("tp-" + parallel if "tp" in dict(named.sizes) else "dp-invariant"), t, 1, 1
    if "fsdp" in dict(named.sizes) and (named.dims <= {"dp", "fsdp"}
                                        or (named.dims <= {"fsdp", "tp"} and parallel == "invariant")):
        return f"fsdp-{parallel}", t, 1, named.size("dp")
    if "pp" in dict(named.sizes) and (named.dims <= {"pp", "dp"} or (named.dims <= {"pp", "tp"}
                                                                    and parallel == "invariant")):
        return f"pp-{parallel}", t, named.size("pp"), 1
    if named.dims == {"pp", "fsdp"}:  # each stage sharded: the tree in its reduce-scatter, or (plain) torch's stage
        return f"fsdp-{parallel}", 1, named.size("pp"), 1
    if named.dims == {"pp", "ep"}:  # each stage's experts split over its ep ranks, which split its data too
        return f"ep-{parallel}", 1, named.size("pp"), 1
    raise UsageError(f"layout {named} is not one the reference trainer runs with --parallel {parallel}: it runs "
                     "dp, fsdp, DxT (dp x tp), ppPxdpD, ppPxfsdpF, ppPxepE, dpDxfsdpF, epE, epExdpD and, invariant "
                     "only, ppPxtpT, fsdpFxtpT, fsdpFxepE and epExtpT layouts")


def _tp_size(flag: int | None) -> int:
    """--tp, else DETRACE_TP (set by `detrace check-topology --layouts`), else 1; both given must agree."""
    env = os.environ.get(TP_ENV)
    try:
        from_env = None if env is None else int(env)
    except ValueError:
        raise UsageError(f"{TP_ENV} must be an integer, not {env!r}") from None
    if flag is not None and from_env is not None and flag != from_env:
        raise UsageError(f"--tp {flag} and {TP_ENV}={from_env} disagree")
    return flag or from_env or 1


def bits(x: torch.Tensor) -> str:
    """The exact bits of a float32 scalar, as 0x followed by 8 hex digits."""
    return "0x" + struct.pack(">f", float(x)).hex()


def _lr_bump(cfg: TrainConfig) -> tuple[int | None, float]:
    """(global step whose optimizer step runs at a bumped learning rate, the factor) of a planted spike."""
    if cfg.spike_step is None or cfg.spike != "state":
        return None, 1.0
    # The loss of step S is computed before S's optimizer step: a bump at S - 1 shows in it.
    return cfg.spike_step - 1, STATE_BUMP


def _poisoned_step(cfg: TrainConfig) -> int | None:
    """The global step whose batch (in an unshifted run) the planted spike poisons."""
    if cfg.spike_step is None or cfg.spike == "state":
        return None
    return cfg.spike_step


def _batch_samples(sampler: ResumableSampler, batch_size: int, step: int) -> list[int]:
    """The samples of the batch that global step `step` trains on in a run from step 0 (ResumableLoader with
    drop_last: every epoch holds the same number of whole batches). The poison travels with these samples, so a
    replay that feeds them at another step feeds the poison there."""
    per_epoch = len(sampler) // batch_size
    epoch, index = divmod(step, per_epoch)
    return sampler.indices(epoch)[index * batch_size:(index + 1) * batch_size]


def _corrupt_token_rows(model: torch.nn.Module) -> None:
    """The "both" spike's parameter fault: scale the rows of `POISON_TOKEN` in the embedding and the LM head (on
    the ranks that hold them)."""
    with torch.no_grad():
        for name in ("embedding", "output"):
            module = getattr(model, name, None)
            if module is not None:
                module.weight[POISON_TOKEN] *= BOTH_CORRUPTION


def _corrupt_state(kind: str | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The "moments" and "weights" spikes' faults, each in its one part of the state (nothing for other kinds)."""
    with torch.no_grad():
        if kind == "moments":
            for per in optimizer.state.values():
                per["exp_avg_sq"].mul_(MOMENTS_CORRUPTION)
        elif kind == "weights":
            head = getattr(model, "output", None)
            if isinstance(head, torch.nn.Linear):  # on the ranks that hold it
                head.weight.mul_(WEIGHTS_CORRUPTION)


def train(cfg: TrainConfig) -> None:
    """Run `cfg` to its last step (or to DETRACE_STOP_AT), printing one line per step on rank 0."""
    import detrace
    from detrace.state import ResumableLoader

    torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        detrace.deterministic(cfg.seed)
    else:
        torch.manual_seed(cfg.seed)
    layout = layouts.setup(cfg.parallel, tp=cfg.tp, pp=cfg.stages, dp=cfg.replicas)
    completed = False
    try:
        preset = PRESETS[cfg.preset]
        # mypy, ignored below: PRESETS values are typed object; batch_size is an int
        batch_size = cfg.batch_size or int(preset["batch_size"])  # type: ignore[call-overload]
        # mypy, ignored below: PRESETS values are typed object; seq_len is an int
        seq_len = int(preset["seq_len"])  # type: ignore[call-overload]
        model_cfg = cfg.model_config()
        pm = parallel.ParallelModel(model_cfg, layout, seed=cfg.seed, batch_size=batch_size, seq_len=seq_len,
                                    microbatches=cfg.microbatches, schedule=cfg.schedule)
        params = [p for p in pm.raw.parameters()]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.1)
        bump_at, bump = _lr_bump(cfg)
        # The bump is a function of the scheduler's step count, which the checkpoint restores: a state fault.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS) * (bump if s == bump_at else 1.0))
        dataset: SyntheticTokens | Poisoned = SyntheticTokens(
            num_samples=NUM_SAMPLES, seq_len=seq_len, vocab_size=model_cfg.vocab_size, seed=cfg.seed
        )
        sampler = ResumableSampler(
            len(dataset), shuffle=True, seed=cfg.seed, num_replicas=layout.data_streams, rank=layout.data_rank
        )
        poison_at = _poisoned_step(cfg)
        if poison_at is not None:
            assert isinstance(dataset, SyntheticTokens)
            samples = _batch_samples(sampler, batch_size, poison_at)
            dataset = Poisoned(dataset, samples if cfg.spike == "data" else samples[:BOTH_POISONED],
                               token=POISON_TOKEN)
        loader = ResumableLoader(dataset, sampler=sampler, batch_size=batch_size, drop_last=True)
        # Invariant layouts: every rank reads the global batch and draws alike (the data position is in global
        # samples: the sampler has one replica), and names each parameter by its global name (a tp chunk by its
        # global index, a stage's layers as in the whole model), so a checkpoint resumes on any mesh.
        state = detrace.TrainState(model=pm.module, optimizer=optimizer, scheduler=scheduler, data=loader,
                                   elastic=cfg.parallel in layouts.INVARIANT)
        start = state.resume_if_requested()
        if layout.rank == 0:
            print(
                f"{PROG}: preset={cfg.preset} parallel={cfg.parallel} world={layout.world} dispatch={cfg.dispatch}"
                f" recompute={cfg.recompute} quant={cfg.quant} deterministic={cfg.deterministic}"
                f" threads={cfg.threads} seed={cfg.seed}{f' tp={cfg.tp}' if cfg.tp > 1 else ''}"
                f" steps={start}-{cfg.steps - 1}",
                flush=True,
            )
        batches = (batch for _ in itertools.count() for batch in loader)  # epoch after epoch
        for step in range(start + 1, cfg.steps + 1):
            if cfg.nondeterministic_from is not None:
                # Deterministic algorithms make the MoE backward's accumulating index_put serial (sorted); off,
                # its CPU kernel adds from 2+ threads in a racing order. Global step = steps completed before.
                torch.use_deterministic_algorithms(step - 1 < cfg.nondeterministic_from)
            inputs, targets = (t.to(layout.device) for t in split_batch(next(batches)))
            pm.forward_backward(inputs, targets)
            m = pm.metrics()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if cfg.spike == "both" and step == cfg.spike_step:  # printed step S = global step S - 1 just ended
                _corrupt_token_rows(pm.raw)
            if cfg.spike_step is not None and step == cfg.spike_step - 1:  # before the save after S - 1 steps
                _corrupt_state(cfg.spike, pm.raw, optimizer)
            if layout.rank == 0:
                print(
                    f"step {step - 1} loss {float(m['loss']):.6f} ({bits(m['loss'])}) lm {float(m['lm']):.6f}"
                    f" mtp {float(m['mtp']):.6f} aux {float(m['aux']):.6f}"
                    f" grad_norm {float(m['grad_norm']):.6f} ({bits(m['grad_norm'])})",
                    flush=True,
                )
            if state.end_of_step(step):
                break
        if cfg.parallel in layouts.INVARIANT:
            final, each = pm.fingerprint()  # collective: every rank
            if layout.rank == 0:
                for name, digest in sorted(each.items()):
                    print(f"final param {name} {digest}")
                print(f"final params {final}", flush=True)  # the same line at every W (and T, tp-invariant)
        completed = True
    finally:
        layouts.teardown(layout, completed=completed)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        train(parse_args(sys.argv[1:] if argv is None else argv))
    except DetraceError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    leave(main())
