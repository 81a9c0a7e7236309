"""Invariant data parallelism (`detrace.parallel.data`) against DDP on gloo: step time and memory, as ratios.

Both train the reference model on the same global batch of M microbatches; each rank computes its M / W
microbatches one at a time (DDP accumulates them under `no_sync` and all-reduces with the last; the invariant
step sums them in the fixed tree and completes it with its exchange). The compute is the same: the ratio is the
cost of the fixed order (the partial-sum buffers, the flat copies, the exchange).

Time: at each world size, one set of ranks runs both, interleaved step by step (the starting method alternates),
so that machine noise hits them alike; the figure is the median over steps of (invariant step / DDP step of the
same pair), with the interquartile range as spread.

Memory: a separate set of ranks per method (peak RSS cannot be separated within one process): the growth of
rank 0's peak resident set over the training steps, invariant / DDP.

Exchange: the two ways of completing the tree (recursive doubling over p2p, all-gather of the partial sums),
timed interleaved on flat buffers of several sizes: what `detrace.parallel.data.GATHER_MAX_BYTES` is chosen from.

Tensor parallelism (`--part tp`): `detrace.parallel.tensor`'s invariant layers against plain tensor parallelism
on the same chunked parameters (one product per rank over its block, an all-reduce), on T ranks of gloo, one
set of ranks running both interleaved (the starting method alternates): the reference model's step (forward,
backward, AdamW; attention and MLP projections split over T, one microbatch of the preset's batch), and the
forward and backward of one MLP block alone (a column-parallel layer [width -> 4 width] then a row-parallel
one back, --tokens rows). Figures: the median over pairs of invariant / plain, with the interquartile range.
Plain concatenates the rank's chunks into one weight at each call (a copy the size of its block).

FSDP (`--part fsdp`): fsdp-invariant (`detrace.parallel.fsdp`: fully_shard with the fixed-tree reduce-scatter)
against fsdp-plain (fully_shard's own reduce-scatter, gradient accumulation without sync until the last
microbatch), the reference model's whole step over the global batch of M microbatches (`ParallelModel`), at each
fsdp size of --worlds and on dp2xfsdp2 (2 replicas of 2 shards: the invariant tree completed over the replicas
against fully_shard's HSDP, reduce-scatter then all-reduce), one set of ranks running both interleaved. Figure: the
median of invariant / plain.

Pipeline (`--part pp`): pp-invariant (`detrace.parallel.pipeline`: the tree over microbatch gradients, seeded
forwards, 1F1B) against torch's Schedule1F1B as the `pp` layout runs it (autograd's accumulation, scaled), the
whole step on 2 stages, interleaved the same way; on pp2xfsdp2 (2 stages, each sharded over 2), fsdp-invariant
(the tree in each stage's reduce-scatter, one per microbatch) against fsdp-plain (torch's stage on fully_shard: its
own accumulation, one reduce-scatter after the last microbatch); and on pp2xep2 (2 stages, each one's experts split
over 2 ranks that split its data too), ep-invariant (the stage's tree, the experts' per source) against ep-plain
(torch's stage with the ordinary all-to-all MoE); all 1F1B.

Expert parallelism (`--part ep`): ep-invariant (`detrace.parallel.expert`: each source's tokens through the
experts apart, the expert weight gradients in the fixed tree) against ep-plain (the ordinary all-to-all MoE: one
GEMM per expert over every rank's tokens, autograd's accumulation), the rest of the model alike (the tree over the
dp x ep blocks), the reference model's whole step over the global batch of M microbatches, at each ep size of
--worlds, interleaved the same way.

Drop-ins (`--part dropin`): examples/llama_parallel.py's tiny Llama and loop (torchtitan's plan, fully_shard per
decoder layer, the global batch of M microbatches) built twice on one set of ranks, once with detrace's
`fully_shard`, `parallelize_module` and styles and once with torch's, timed interleaved on each mesh of
--dropin-layouts (default fsdp2, tp2 and fsdp2xtp2; empty: none); and examples/topology/moe_dropin.py's MoE
(torchtitan's all-to-all experts: detrace's ExpertParallel, parallelize_module and fully_shard against torch's and
the example's ordinary style, and against detrace's fully_shard with that style: the style's own cost) on each dp
x ep mesh of --moe-layouts (default ep2 and dp2xep2). Figures: the median
of detrace / torch with the IQR, and a 95% confidence interval of the median (bootstrap over the pairs).

Every timed pair also gives the ratio of the CPU time summed over the ranks (`time.process_time` of the step on
each rank, all-reduced): the work, which the scheduling of more ranks than cores (4 on the project's 2) spreads far
less than the wall time. `--step-only` (dp) times the steps alone, without the exchange sweep and the memory runs.

The last lines are the figures, one per line: `step time W=2 invariant/ddp: 1.03x (IQR 0.98-1.08, 8 pairs)`, then
`CPU time over the ranks W=2 invariant/ddp: ...`.

What changed, 2026-12-05 (docs/topology.md has the figures before and after): recursive doubling receives into one
buffer for every round and adds in place (it allocated two buffers a round), the all-gather sums its rows in place
(it cloned them); the invariant experts run every source's rows in one grouped call with an `expand`ed view of the
weights per source (one call per source before), their gradient trees stacked into one, and the all-to-all's output
is waited without a copy (it was cloned). The bits are those of before. The CPU-time figures and `--step-only` are
new.

    python bench/topology.py [--part dp|tp|fsdp|pp|ep|dropin|all] [--preset tiny] [--microbatches 4] [--steps 8]
        [--worlds 2,4] [--threads 1] [--tp-sizes 2,4] [--width 512] [--tokens 1024] [--chunk 64] [--step-only]
        [--dropin-layouts fsdp2,tp2,fsdp2xtp2] [--moe-layouts ep2,dp2xep2]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from detrace.parallel.data import InvariantDataParallel
from detrace.parallel.layout import Layout as NamedLayout
from detrace.workload.model import PRESETS, HybridLM, ModelConfig, lm_losses

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 24)  # bytes of the exchanged partial sum


def _setup(rank: int, world: int, rendezvous: str, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _reference(preset: str):  # type: ignore[no-untyped-def]
    """The preset's model config with the fixed dispatch, its batch size and sequence length, and the model."""
    spec = PRESETS[preset]
    cfg = spec["model"]
    assert isinstance(cfg, ModelConfig)
    cfg = ModelConfig(**{**cfg.__dict__, "dispatch": "fixed"})
    batch, seq = int(spec["batch_size"]), int(spec["seq_len"])  # type: ignore[call-overload]
    torch.manual_seed(0)
    return cfg, batch, seq, HybridLM(cfg)


def _trainer(method: str, preset: str, microbatches: int):  # type: ignore[no-untyped-def]
    """A step function of `method` ("invariant" or "ddp") on the preset's model and batch."""
    from torch.nn.parallel import DistributedDataParallel

    cfg, batch, seq, model = _reference(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    per = microbatches // world
    if method == "invariant":
        idp = InvariantDataParallel(model, microbatches=microbatches)

        def step() -> None:
            tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 2), generator=gen).chunk(microbatches)

            def loss_of(i: int) -> torch.Tensor:
                lm, mtp = lm_losses(model(tokens[i][:, :seq]), tokens[i][:, 1:])
                return (lm + cfg.mtp_loss_coef * mtp) / microbatches

            idp.backward(loss_of)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        ddp = DistributedDataParallel(model)

        def step() -> None:
            tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 2), generator=gen).chunk(microbatches)
            for k, i in enumerate(range(rank * per, (rank + 1) * per)):
                sync = ddp.no_sync() if k < per - 1 else _Null()
                with sync:
                    lm, mtp = lm_losses(ddp(tokens[i][:, :seq]), tokens[i][:, 1:])
                    # DDP averages over ranks: scale by W / M so both sum the same objective
                    ((lm + cfg.mtp_loss_coef * mtp) * world / microbatches).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _timing(rank: int, world: int, args: argparse.Namespace, out: str, rendezvous: str) -> None:
    _setup(rank, world, rendezvous, args.threads)
    steps = {m: _trainer(m, args.preset, args.microbatches) for m in ("invariant", "ddp")}
    for step in steps.values():  # warm-up
        step()
    ratios = _interleaved({"invariant": steps["invariant"], "plain": steps["ddp"]}, args.steps)
    exchange = {} if args.step_only else _exchange_sweep(world, args.steps)
    if rank == 0:
        Path(out).write_text(json.dumps({**ratios, "exchange": exchange}))
    dist.barrier()
    dist.destroy_process_group()


def _exchange_sweep(world: int, repeats: int) -> dict[str, list[float]]:
    """doubling / gather time ratios per size (median over repeats, interleaved)."""
    from detrace.parallel.data import _exchange

    rank = dist.get_rank()
    result = {}
    for size in SIZES:
        flat = torch.randn(size // 4)
        ratios = []
        for k in range(repeats):
            took = {}
            for how in (("doubling", "gather") if k % 2 == 0 else ("gather", "doubling")):
                dist.barrier()
                began = time.perf_counter()
                _exchange([flat.clone()], group=None, rank=rank, world=world, how=how)
                took[how] = time.perf_counter() - began
            ratios.append(took["doubling"] / took["gather"])
        result[str(size)] = ratios
    return result


def _memory(rank: int, world: int, args: argparse.Namespace, method: str, out: str, rendezvous: str) -> None:
    _setup(rank, world, rendezvous, args.threads)
    step = _trainer(method, args.preset, args.microbatches)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(max(2, args.steps // 2)):
        step()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    if rank == 0:
        Path(out).write_text(json.dumps({"kib": grown}))
    dist.barrier()
    dist.destroy_process_group()


class _ReduceForward(torch.autograd.Function):
    """Plain row-parallel's sum across ranks: an all-reduce forward, the gradient passed through backward."""

    @staticmethod
    def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _tp_step(layout, preset: str):  # type: ignore[no-untyped-def]
    """One training step of the reference model with its projections split over tp (the layout's mode)."""
    from detrace.workload.sharding import _chunked_tensor_parallel

    cfg, batch, seq, model = _reference(preset)
    _chunked_tensor_parallel(model, layout, layout.kind.removeprefix("tp-"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 2), generator=gen)
        lm, mtp = lm_losses(model(tokens[:, :seq]), tokens[:, 1:])
        (lm + cfg.mtp_loss_coef * mtp).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _tp_block(mode: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Forward and backward of one MLP block split over the world: column [width -> 4 width], row back."""
    from detrace.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    w, h = args.width, 4 * args.width
    col = ColumnParallelLinear(torch.randn(h, w) / w**0.5, chunk=args.chunk, mode=mode)
    row = RowParallelLinear(torch.randn(w, h) / h**0.5, chunk=args.chunk, mode=mode)
    x, grad = torch.randn(args.tokens, w, requires_grad=True), torch.randn(args.tokens, w)

    def block() -> None:
        row(col(x)).backward(grad)
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        x.grad = None

    return block


def _interleaved(fns: dict[str, object], repeats: int) -> dict[str, list[float]]:
    """invariant / plain ratios, one per pair, the starting method alternating: of the step's wall time ("step")
    and of its CPU time summed over the ranks ("cpu")."""
    ratios: dict[str, list[float]] = {"step": [], "cpu": []}
    for k in range(repeats):
        took, cpu = {}, {}
        for method in (("invariant", "plain") if k % 2 == 0 else ("plain", "invariant")):
            dist.barrier()
            began, cpu_began = time.perf_counter(), time.process_time()
            fns[method]()  # type: ignore[operator]
            cpu[method] = time.process_time() - cpu_began
            dist.barrier()
            took[method] = time.perf_counter() - began
        ratios["step"].append(took["invariant"] / took["plain"])
        ratios["cpu"].append(_summed(cpu["invariant"]) / _summed(cpu["plain"]))
    return ratios


def _summed(seconds: float) -> float:
    """`seconds` summed over the ranks (an all-reduce)."""
    total = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)


def _tp_timing(rank: int, world: int, args: argparse.Namespace, out: str, rendezvous: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from detrace.workload.layouts import Layout

    _setup(rank, world, rendezvous, args.threads)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    steps, blocks = {}, {}
    for mode in ("invariant", "plain"):
        layout = Layout(kind=f"tp-{mode}", rank=rank, world=world, device=torch.device("cpu"),
                        sizes={"dp": 1, "tp": world}, coords={"dp": 0, "tp": rank}, mesh=mesh)
        steps[mode], blocks[mode] = _tp_step(layout, args.preset), _tp_block(mode, args)
    for fn in (*steps.values(), *blocks.values()):  # warm-up
        fn()
    result = {**_interleaved(steps, args.steps), "block": _interleaved(blocks, args.steps)["step"]}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _layout_timing(rank: int, world: int, args: argparse.Namespace, sizes: dict[str, int],
                   kinds: tuple[tuple[str, str], ...], out: str, rendezvous: str) -> None:
    """The reference model's whole step on the global batch of M microbatches (`ParallelModel`), on the mesh of
    `sizes` (dimension -> size, outermost first), for each (mode, layout kind) of `kinds`, interleaved on one set of
    ranks: fsdp-invariant against fsdp-plain (fully_shard's own reduce-scatter, and all-reduce over dp replicas,
    accumulation without sync until the last microbatch), pp-invariant against pp (torch's Schedule1F1B,
    autograd's accumulation, scaled), ep-invariant against ep-plain (the all-to-all MoE; on pp x ep in torch's
    stage)."""
    from torch.distributed.device_mesh import init_device_mesh

    from detrace.workload.layouts import INVARIANT, Layout
    from detrace.workload.sharding import ParallelModel

    _setup(rank, world, rendezvous, args.threads)
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    coords = {name: mesh.get_local_rank(name) for name in sizes}
    cfg, batch, seq, _ = _reference(args.preset)
    gen = torch.Generator().manual_seed(0)
    steps = {}
    for mode, kind in kinds:
        layout = Layout(kind=kind, rank=rank, world=world, device=torch.device("cpu"), sizes=sizes, coords=coords,
                        mesh=mesh)
        pm = ParallelModel(cfg, layout, seed=0, batch_size=batch, seq_len=seq,
                           microbatches=args.microbatches if kind in INVARIANT else None)
        opt = torch.optim.AdamW(pm.raw.parameters(), lr=1e-3)

        def step(pm: ParallelModel = pm, opt: torch.optim.Optimizer = opt) -> None:
            tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 2), generator=gen)
            pm.forward_backward(tokens[:, :seq], tokens[:, 1:])
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[mode] = step
    for fn in steps.values():  # warm-up
        fn()
    result = _interleaved(steps, args.steps)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _dropin_timing(rank: int, world: int, args: argparse.Namespace, sizes: dict[str, int], out: str,
                   rendezvous: str) -> None:
    """examples/llama_parallel.py's step with detrace's drop-ins ("invariant") and with torch's APIs ("plain"),
    interleaved on one set of ranks, on the (data, tp) mesh of `sizes`."""
    import importlib.util

    from torch.distributed.device_mesh import init_device_mesh

    # bench/kernels.py, on the path as this script's folder, would stand for the Hugging Face `kernels` package
    # that transformers looks for
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    _setup(rank, world, rendezvous, args.threads)
    spec = importlib.util.spec_from_file_location("llama_parallel", EXAMPLES / "llama_parallel.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mesh = init_device_mesh("cpu", (sizes["data"], sizes["tp"]), mesh_dim_names=("data", "tp"))
    steps, count = {}, [0]
    for method, api in (("invariant", "detrace"), ("plain", "torch")):
        model = example.build(api, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            count[0] += 1
            example.train_step(model, opt, mesh, count[0], args.microbatches)

        steps[method] = step
    for fn in steps.values():  # warm-up
        fn()
    result = _interleaved(steps, args.steps)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _moe_timing(rank: int, world: int, args: argparse.Namespace, sizes: dict[str, int], out: str,
                rendezvous: str) -> None:
    """examples/topology/moe_dropin.py's step with detrace's ExpertParallel, parallelize_module and fully_shard
    ("invariant") against, interleaved on one set of ranks on the (dp, ep) mesh of `sizes`: torch's APIs with the
    example's ordinary all-to-all style ("apis"), and detrace's fully_shard with that style (the style's own cost,
    "style")."""
    import importlib.util

    from torch.distributed.device_mesh import init_device_mesh

    _setup(rank, world, rendezvous, args.threads)
    torch.use_deterministic_algorithms(True)  # as the example: index_add's backward on CPU
    spec = importlib.util.spec_from_file_location("moe_dropin", EXAMPLES / "topology" / "moe_dropin.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mesh = init_device_mesh("cpu", (sizes["dp"], sizes["ep"]), mesh_dim_names=("dp", "ep"))
    data = init_device_mesh("cpu", (world,), mesh_dim_names=("data",))
    steps, count = {}, [0]
    for api in ("detrace", "torch", "torch-experts"):
        model = example.build(api, mesh, data)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            count[0] += 1
            example.train_step(model, opt, count[0], args.microbatches)

        steps[api] = step
    for fn in steps.values():  # warm-up
        fn()
    result = {against: _interleaved({"invariant": steps["detrace"], "plain": steps[api]}, args.steps)
              for against, api in (("apis", "torch"), ("style", "torch-experts"))}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _median_ci(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% confidence interval of the median of `values`: the percentile bootstrap (seeded: the same figures
    from the same ratios)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _spawn(fn, world: int, *args: object) -> None:  # type: ignore[no-untyped-def]
    rendezvous = tempfile.mktemp(prefix="detrace-bench-topology-")  # a file the ranks meet in (no port)
    mp.start_processes(fn, args=(world, *args, rendezvous), nprocs=world, start_method="spawn")


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def _figures(label: str, data: dict[str, list[float]]) -> list[str]:
    """The step-time figure of `label` ("W=4 invariant/ddp") and the CPU-time one (the ranks' sum: the work, which
    the scheduling of more ranks than cores does not spread as it spreads the wall time)."""
    lines = []
    for what, name in (("step", "step time"), ("cpu", "CPU time over the ranks")):
        lo, mid, hi = _quartiles(data[what])
        lines.append(f"{name} {label}: {mid:.2f}x (IQR {lo:.2f}-{hi:.2f}, {len(data[what])} pairs)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--part", default="all", choices=("dp", "tp", "fsdp", "pp", "ep", "dropin", "all"))
    p.add_argument("--dropin-layouts", default="fsdp2,tp2,fsdp2xtp2", help="dropin: the meshes, data x tp")
    p.add_argument("--moe-layouts", default="ep2,dp2xep2", help="dropin: the MoE's meshes, dp x ep")
    p.add_argument("--tp-sizes", default="2,4")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--step-only", action="store_true", help="dp: the step times alone (no exchange sweep, no memory)")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")] if args.part in ("dp", "all") else []
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in [int(t) for t in args.tp_sizes.split(",")] if args.part in ("tp", "all") else []:
            path = f"{tmp}/tp-{tp}.json"
            _spawn(_tp_timing, tp, args, path)
            data = json.loads(Path(path).read_text())
            figures += _figures(f"T={tp} ({args.preset}) tp-invariant/plain", data)
            lo, mid, hi = _quartiles(data["block"])
            figures.append(f"MLP block fwd+bwd T={tp} ({args.tokens}x{args.width}, chunk {args.chunk}) "
                           f"tp-invariant/plain: {mid:.2f}x (IQR {lo:.2f}-{hi:.2f}, {len(data['block'])} pairs)")
        fsdp = (("invariant", "fsdp-invariant"), ("plain", "fsdp-plain"))
        meshes = [{"fsdp": int(w)} for w in args.worlds.split(",")] + [{"dp": 2, "fsdp": 2}]
        for sizes in meshes if args.part in ("fsdp", "all") else []:
            name, world = "x".join(f"{d}{n}" for d, n in sizes.items()), math.prod(sizes.values())
            path = f"{tmp}/{name}.json"
            _spawn(_layout_timing, world, args, sizes, fsdp, path)
            figures += _figures(f"{name} ({args.preset}, M={args.microbatches}) fsdp-invariant/fully_shard",
                                json.loads(Path(path).read_text()))
        for world in [int(w) for w in args.worlds.split(",")] if args.part in ("ep", "all") else []:
            path = f"{tmp}/ep-{world}.json"
            _spawn(_layout_timing, world, args, {"ep": world}, (("invariant", "ep-invariant"), ("plain", "ep-plain")),
                   path)
            figures += _figures(f"ep{world} ({args.preset}, M={args.microbatches}) ep-invariant/all-to-all MoE",
                                json.loads(Path(path).read_text()))
        if args.part in ("pp", "all"):
            path = f"{tmp}/pp-2.json"
            _spawn(_layout_timing, 2, args, {"pp": 2}, (("invariant", "pp-invariant"), ("plain", "pp")), path)
            figures += _figures(f"pp2 1F1B ({args.preset}, M={args.microbatches}) pp-invariant/torch schedule",
                                json.loads(Path(path).read_text()))
            path = f"{tmp}/pp2xfsdp2.json"
            _spawn(_layout_timing, 4, args, {"pp": 2, "fsdp": 2}, (("invariant", "fsdp-invariant"),
                                                                   ("plain", "fsdp-plain")), path)
            figures += _figures(f"pp2xfsdp2 1F1B ({args.preset}, M={args.microbatches}) fsdp-invariant/torch stage "
                                "on fully_shard", json.loads(Path(path).read_text()))
            path = f"{tmp}/pp2xep2.json"
            _spawn(_layout_timing, 4, args, {"pp": 2, "ep": 2}, (("invariant", "ep-invariant"),
                                                                 ("plain", "ep-plain")), path)
            figures += _figures(f"pp2xep2 1F1B ({args.preset}, M={args.microbatches}) ep-invariant/torch stage with "
                                "the all-to-all MoE", json.loads(Path(path).read_text()))
        for name in [n for n in args.dropin_layouts.split(",") if n] if args.part in ("dropin", "all") else []:
            layout = NamedLayout.parse(name)
            sizes = {"data": layout.data, "tp": layout.size("tp")}
            path = f"{tmp}/dropin-{layout.name}.json"
            _spawn(_dropin_timing, layout.world, args, sizes, path)
            data = json.loads(Path(path).read_text())
            label = f"{layout.name} (Llama, M={args.microbatches}) detrace/torch APIs"
            figures += _figures(label, data)
            for what, title in (("step", "step time"), ("cpu", "CPU time over the ranks")):
                low, high = _median_ci(data[what])
                figures.append(f"{title} {label}: 95% CI of the median [{low:.3f}, {high:.3f}]")
        for name in [n for n in args.moe_layouts.split(",") if n] if args.part in ("dropin", "all") else []:
            layout = NamedLayout.parse(name)
            sizes = {"dp": layout.size("dp"), "ep": layout.size("ep")}
            path = f"{tmp}/moe-{layout.name}.json"
            _spawn(_moe_timing, layout.world, args, sizes, path)
            moe = json.loads(Path(path).read_text())
            for against, what_to in (("apis", "detrace/torch APIs"), ("style", "ExpertParallel/ordinary style")):
                label, data = f"{layout.name} (MoE, M={args.microbatches}) {what_to}", moe[against]
                figures += _figures(label, data)
                for what, title in (("step", "step time"), ("cpu", "CPU time over the ranks")):
                    low, high = _median_ci(data[what])
                    figures.append(f"{title} {label}: 95% CI of the median [{low:.3f}, {high:.3f}]")
        for world in worlds:
            path = f"{tmp}/time-{world}.json"
            _spawn(_timing, world, args, path)
            data = json.loads(Path(path).read_text())
            figures += _figures(f"W={world} invariant/ddp", data)
            if args.step_only:
                continue
            for size, ratios in data["exchange"].items():
                lo, mid, hi = _quartiles(ratios)
                figures.append(f"exchange W={world} {int(size) >> 10} KiB doubling/gather: {mid:.2f}x "
                               f"(IQR {lo:.2f}-{hi:.2f})")
            kib = {}
            for method in ("invariant", "ddp"):
                path = f"{tmp}/mem-{world}-{method}.json"
                _spawn(_memory, world, args, method, path)
                kib[method] = json.loads(Path(path).read_text())["kib"]
            figures.append(f"peak RSS growth W={world} invariant/ddp: {kib['invariant'] / max(kib['ddp'], 1):.2f}x "
                           f"({kib['invariant'] / 1024:.1f} MiB vs {kib['ddp'] / 1024:.1f} MiB)")
    print(f"preset={args.preset} microbatches={args.microbatches} steps={args.steps} threads={args.threads} "
          f"part={args.part} backend=gloo")
    for line in figures:
        print(line)


if __name__ == "__main__":
    main()
