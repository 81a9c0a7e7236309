"""A Hugging Face Llama parallelized the torchtitan way (a tensor-parallel plan, then fully_shard per decoder layer),
the same bits on every mesh with detrace's imports instead of torch's.

    detrace check-topology --layouts 1x1,fsdp2,tp2,fsdp2xtp2 -- python examples/llama_parallel.py --api detrace
    detrace check-topology --layouts 1x1,tp2 -- python examples/llama_parallel.py --api torch     # differs
    detrace check-topology --layouts 1x1,tp2,fsdp2xtp2 -- python examples/llama_parallel.py --sequence-parallel
    detrace check-topology --layouts fsdp2xtp2,1x1,tp2 --resume-at 1 -- python examples/llama_parallel.py
    detrace check-topology --layouts 1x1,pp2,pp2xtp2,pp2xfsdp2 -- python examples/llama_parallel.py --api detrace
    detrace check-topology --layouts 1x1,pp2 -- python examples/llama_parallel.py --schedule interleaved-1f1b

The model is a tiny `LlamaForCausalLM` built in code (no download). The layout comes from DETRACE_LAYOUT, which
`check-topology --layouts` sets (`1x1`, `fsdp2`, `tp2`, `fsdp2xtp2`, `dp2`, `dp2xfsdp2`; unset: one process);
the data dimensions shard the model with fully_shard (`dpDxfsdpF`: HSDP, fully_shard on the 2-D mesh (dp, fsdp),
replicated over dp), `tp` splits it with the plan. The loop is torchtitan's gradient
accumulation: the global batch is M microbatches of a fixed size, drawn from a generator seeded by the step; the
rank of data-parallel coordinate d runs microbatches [d n, (d + 1) n) with n = M / (data ranks), one backward each,
each loss scaled by 1 / n (torch's averaging does the rest). The only difference between `--api detrace` and
`--api torch` is where `fully_shard`, `parallelize_module`, `ColwiseParallel`, `RowwiseParallel` and
`SequenceParallel` come from; `--sequence-parallel` uses torchtitan's plan with sequence parallelism.

Layouts with `pp` (`pp2`, `pp2xtp2`, `pp2xfsdp2`) pipeline the model: after the plan, the model's pieces (the
embedding, each decoder layer, the norm with the head) are cut into contiguous stages, each rank keeping its
stages' pieces under the whole model's names (a layer another rank holds is an nn.Identity); with data ranks, each
piece is given to fully_shard over them (its tree sums the microbatches; with one, the schedule's does), and the
schedule (`--schedule`, from detrace or from torch, with `PipelineStage`) runs the data rank's block of the M
microbatches with the loss averaged by the schedule. `gpipe` and `1f1b` run one stage per rank; `interleaved-1f1b`,
`looped-bfs`, `interleaved-zb` and `zbv` two (four stages at pp2: the embedding, each decoder layer, the head), as
torchtitan's multi-stage schedules do. The zero-bubble ones split each backward into input and weight steps, which
a stage of fully_shard modules cannot run (refused in one sentence): they run on `pp2` and `pp2xtp2`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask

from detrace.parallel.layout import LAYOUT_ENV, Layout


def imports(api: str) -> tuple[Any, Any, Any, Any, Any]:
    """(fully_shard, parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel) from detrace or from
    torch."""
    if api == "detrace":
        from detrace.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            fully_shard,
            parallelize_module,
        )
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )
    return fully_shard, parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel


def build(api: str, mesh: DeviceMesh, stages: tuple[int, ...] = (), total: int = 1, *,
          sequence_parallel: bool = False) -> LlamaForCausalLM:
    """The tiny Llama, the same whole model on every rank, parallelized on `mesh` (dimensions data, tp); with
    `stages` (of `total` pipeline stages), only this rank's stages of it (mesh dimension pp)."""
    fully_shard, parallelize_module, ColwiseParallel, RowwiseParallel, SequenceParallel = imports(api)
    torch.manual_seed(0)  # the same whole model on every rank; the plan and fully_shard keep their shards
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    if sequence_parallel:
        parallelize_module(model, mesh["tp"], sequence_plan(ColwiseParallel, RowwiseParallel, SequenceParallel))
    else:  # torchtitan's plan for a Llama without sequence parallelism; T = 1 too, so that every mesh computes alike
        parallelize_module(model, mesh["tp"], {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "model.layers.*.self_attn.q_proj": ColwiseParallel(),
            "model.layers.*.self_attn.k_proj": ColwiseParallel(),
            "model.layers.*.self_attn.v_proj": ColwiseParallel(),
            "model.layers.*.self_attn.o_proj": RowwiseParallel(),
            "model.layers.*.mlp.gate_proj": ColwiseParallel(),
            "model.layers.*.mlp.up_proj": ColwiseParallel(),
            "model.layers.*.mlp.down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        })
    if stages:
        keep_stages(model, stages, total)
    shards = data_mesh(mesh)
    if not stages:
        for layer in model.model.layers:
            fully_shard(layer, mesh=shards)
        fully_shard(model, mesh=shards)
    elif mesh["data"].size() > 1:  # each piece of a stage is sharded alone: a rank's stages (two under the
        # multi-stage schedules) are modules of their own, and the pieces are what they share with the model
        for piece in (model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head):
            if piece is not None and not isinstance(piece, torch.nn.Identity):
                fully_shard(piece, mesh=shards)
    # (one pipeline per data rank: the schedule sums each stage's microbatches itself)
    return model


def sequence_plan(ColwiseParallel: Any, RowwiseParallel: Any, SequenceParallel: Any) -> dict[str, Any]:
    """torchtitan's plan for a Llama with sequence parallelism, on Hugging Face's names: between the decoder layers
    the activations are sharded on the sequence (Shard(1)); the norms run on their rank's tokens; attention and
    the MLP gather the sequence first (PrepareModuleInput: the attention takes it as the keyword hidden_states)
    and their row-wise projections give their rank's tokens of the sum. The embedding and the row-wise outputs
    stay DTensors, so that the model reads the whole sequence's length from the embedding's output (its positions
    and causal mask)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                       use_local_output=True),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                 use_local_output=True),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """fully_shard's mesh: the data ranks, or on a dpDxfsdpF layout HSDP's 2-D mesh (replicate D, shard F) over the
    same ranks, data rank d at (d // F, d % F), so that each rank keeps its block of microbatches."""
    layout = Layout.parse(os.environ.get(LAYOUT_ENV, "1x1"))
    replicas, shard = layout.size("dp"), layout.size("fsdp")
    if replicas == 1 or shard == 1:
        return mesh["data"]
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    return init_device_mesh("cpu", (pp, replicas, shard, tp), mesh_dim_names=("pp", "dp", "fsdp", "tp"))["dp", "fsdp"]


def pieces(model: LlamaForCausalLM, stage: int, total: int) -> range:
    """The pieces of pipeline stage `stage` of `total`, contiguous: 0 the embedding, 1..L the decoder layers, L + 1
    the norm with the head (at L = 2: two stages of two pieces each, or four of one)."""
    count = model.config.num_hidden_layers + 2
    if not 1 < total <= count:
        raise SystemExit(f"the Llama's {count} pieces make 2 to {count} pipeline stages, not {total}")
    return range(stage * count // total, (stage + 1) * count // total)


def keep_stages(model: LlamaForCausalLM, stages: tuple[int, ...], total: int) -> None:
    """Cut `model` down to the pieces of this rank's pipeline `stages` (of `total`), the whole model's names kept (a
    layer another rank holds is an nn.Identity, the embedding or head None)."""
    inner, kept = model.model, {i for stage in stages for i in pieces(model, stage, total)}
    for i in range(len(inner.layers)):
        if i + 1 not in kept:
            inner.layers[i] = torch.nn.Identity()
    if 0 not in kept:
        inner.embed_tokens = None
    if len(inner.layers) + 1 not in kept:
        inner.norm, model.lm_head = None, None


def stage_forward(model: LlamaForCausalLM, span: range) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward of the pipeline stage of pieces `span` of a cut Llama: input ids or the previous stage's hidden
    states in, hidden states or logits out."""
    inner = model.model
    last = len(inner.layers) + 1
    layers = [inner.layers[i - 1] for i in span if 0 < i < last]

    def forward(x: torch.Tensor) -> torch.Tensor:
        hidden = inner.embed_tokens(x) if 0 in span else x
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        rotary = inner.rotary_emb(hidden, position_ids=positions)
        for layer in layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        return model.lm_head(inner.norm(hidden)) if last in span else hidden
    return forward


def stage_modules(model: LlamaForCausalLM, stages: tuple[int, ...], total: int) -> list[torch.nn.Module]:
    """The module of each of this rank's pipeline stages. One stage per rank: the cut model itself, its forward the
    stage's. Several: a module per stage holding the model's own pieces, so that each stage's parameters are its own
    and the model, which holds more than any stage, keeps naming them (detrace names a parameter by the root module
    holding the most parameters)."""
    if len(stages) == 1:
        object.__setattr__(model, "forward", stage_forward(model, pieces(model, stages[0], total)))
        return [model]
    modules = []
    for stage in stages:
        inner, span = model.model, pieces(model, stage, total)
        module = torch.nn.Module()
        module.pieces = torch.nn.ModuleList(  # type: ignore[assignment]
            [inner.embed_tokens] * (0 in span) + [inner.layers[i - 1] for i in span if 0 < i <= len(inner.layers)]
            + [inner.norm, model.lm_head] * (len(inner.layers) + 1 in span))
        object.__setattr__(module, "forward", stage_forward(model, span))  # nn.Module calls self.forward
        modules.append(module)
    return modules


def train_step(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, step: int,
               microbatches: int) -> None:
    """One step of torchtitan's gradient accumulation over the global batch of `microbatches` (drawn from the
    step's seed): this rank's share, one backward each, each loss scaled by 1 / n."""
    data = mesh["data"].size()
    block, n = mesh.get_local_rank("data"), microbatches // data
    batch = torch.randint(0, model.config.vocab_size, (microbatches, 2, 16),
                          generator=torch.Generator().manual_seed(step))
    for i in range(block * n, (block + 1) * n):
        tokens = batch[i]
        loss = model(input_ids=tokens, labels=tokens).loss  # the model shifts the labels
        (loss / n).backward()
    optimizer.step()
    optimizer.zero_grad()


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "looped-bfs": "ScheduleLoopedBFS", "interleaved-zb": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble"}
"""`--schedule`: torch.distributed.pipelining's schedule classes (the first two one stage per rank, the others two)."""


def rank_stages(schedule: str, rank: int, pp: int) -> tuple[tuple[int, ...], int]:
    """(this pp rank's stages, the number of stages): one per rank, or two placed as torch's schedule expects them
    (looped: stages r and r + pp; ZBV's V: stages r and 2 pp - 1 - r)."""
    if schedule in ("gpipe", "1f1b"):
        return (rank,), pp
    return (rank, 2 * pp - 1 - rank if schedule == "zbv" else rank + pp), 2 * pp


def pipeline_step(schedule: Any, stages: tuple[int, ...], total: int, optimizer: torch.optim.Optimizer,
                  mesh: DeviceMesh, step: int, microbatches: int, vocab: int) -> None:
    """One step of the same global batch through the pipelines: the data rank's block of the M microbatches (2 rows
    each, as `train_step`'s), fed by the rank of the first stage; the rank of the last computes each one's loss (the
    model's own), and the schedule averages over the block."""
    data = mesh["data"].size()
    block, n = mesh.get_local_rank("data"), microbatches // data
    batch = torch.randint(0, vocab, (microbatches, 2, 16), generator=torch.Generator().manual_seed(step))
    rows = batch[block * n:(block + 1) * n].reshape(-1, 16)
    args = (rows,) if 0 in stages else ()
    schedule.step(*args, **({"target": rows} if total - 1 in stages else {}))
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("detrace", "torch"), default="detrace")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b",
                   help="the pipeline schedule of the pp layouts (default 1f1b)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="torchtitan's plan with sequence parallelism (the norms' activations sharded on the sequence)")
    args = p.parse_args()
    torch.set_num_threads(1)
    layout = Layout.parse(os.environ.get(LAYOUT_ENV, "1x1"))
    if layout.dims - {"dp", "fsdp", "tp", "pp"}:
        raise SystemExit(f"this example runs pipeline, data and tensor parallelism, not {layout.name}")
    data, tp, pp = layout.data, layout.size("tp"), layout.size("pp")
    if args.sequence_parallel and pp > 1:
        raise SystemExit(f"this example runs --sequence-parallel without pipeline stages, not on {layout.name}")
    if "WORLD_SIZE" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    if dist.get_world_size() != pp * data * tp:
        raise SystemExit(f"layout {layout.name} takes {pp * data * tp} processes, not {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (pp, data, tp), mesh_dim_names=("pp", "data", "tp"))
    stages, total = rank_stages(args.schedule, mesh.get_local_rank("pp"), pp) if pp > 1 else ((), 1)
    model = build(args.api, mesh, stages, total, sequence_parallel=args.sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = (pipeline(args.api, args.schedule, model, mesh, stages, total, args.microbatches // data)
                if pp > 1 else None)
    # check-topology --resume-at K's contract: stop after step K with a checkpoint, or resume from it
    ckpt, stop_at = os.environ.get("DETRACE_CKPT_DIR"), int(os.environ.get("DETRACE_STOP_AT", "0"))
    first = resume(model, optimizer, ckpt) if ckpt and os.environ.get("DETRACE_RESUME") == "1" else 0
    for step in range(first, args.steps):
        if schedule is not None:
            pipeline_step(schedule, stages, total, optimizer, mesh, step, args.microbatches, model.config.vocab_size)
        else:
            train_step(model, optimizer, mesh, step, args.microbatches)
        if ckpt and step + 1 == stop_at:
            save(model, optimizer, ckpt, step + 1)
            break
    dist.destroy_process_group()


def pipeline(api: str, name: str, model: LlamaForCausalLM, mesh: DeviceMesh, stages: tuple[int, ...], total: int,
             microbatches: int) -> Any:
    """This rank's stages in schedule `name` (of `SCHEDULES`) from detrace or from torch (torch's signatures either
    way), over this data rank's `microbatches`."""
    import torch.distributed.pipelining as torch_pipelining

    import detrace.parallel as detrace_pipelining

    source: Any = detrace_pipelining if api == "detrace" else torch_pipelining
    group = mesh["pp"].get_group()
    built = [source.PipelineStage(module, stage, total, torch.device("cpu"), group=group)
             for stage, module in zip(stages, stage_modules(model, stages, total), strict=True)]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)

    schedule = getattr(source, SCHEDULES[name])
    return schedule(built[0] if len(built) == 1 else built, n_microbatches=microbatches, loss_fn=loss_fn)


def save(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, path: str, steps: int) -> None:
    """A torch.distributed.checkpoint of the model and optimizer by parameter name (global shapes: it loads on any
    mesh), and the number of steps done."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "steps": torch.tensor(steps)}, checkpoint_id=path)


def resume(model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, path: str) -> int:
    """Load `save`'s checkpoint into this mesh's shards; the step to go on from."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "steps": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["steps"])


if __name__ == "__main__":
    main()
