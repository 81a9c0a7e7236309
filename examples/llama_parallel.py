"""A Hugging Face Llama parallelized the torchtitan way (a tensor-parallel plan, then fully_shard per decoder layer),
the same bits on every mesh with detrace's imports instead of torch's.

    detrace check-topology --layouts 1x1,fsdp2,tp2,fsdp2xtp2 -- python examples/llama_parallel.py --api detrace
    detrace check-topology --layouts 1x1,tp2 -- python examples/llama_parallel.py --api torch     # differs
    detrace check-topology --layouts fsdp2xtp2,1x1,tp2 --resume-at 1 -- python examples/llama_parallel.py
    detrace check-topology --layouts 1x1,pp2 -- python examples/llama_parallel.py --api detrace

The model is a tiny `LlamaForCausalLM` built in code (no download). The layout comes from DETRACE_LAYOUT, which
`check-topology --layouts` sets (`1x1`, `fsdp2`, `tp2`, `fsdp2xtp2`, `dp2`, `dp2xfsdp2`; unset: one process);
the data dimensions shard the model with fully_shard (`dpDxfsdpF`: HSDP, fully_shard on the 2-D mesh (dp, fsdp),
replicated over dp), `tp` splits it with the plan. The loop is torchtitan's gradient
accumulation: the global batch is M microbatches of a fixed size, drawn from a generator seeded by the step; the
rank of data-parallel coordinate d runs microbatches [d n, (d + 1) n) with n = M / (data ranks), one backward each,
each loss scaled by 1 / n (torch's averaging does the rest). The only difference between `--api detrace` and
`--api torch` is where `fully_shard`, `parallelize_module`, `ColwiseParallel` and `RowwiseParallel` come from.

Layout `pp2` pipelines the model instead: after the plan (at T = 1), stage 0 keeps the embedding and the first half
of the decoder layers, stage 1 the rest, the norm and the head, each under the whole model's names (a layer another
stage holds is an nn.Identity); each decoder layer is given to fully_shard (one shard), and `Schedule1F1B` (from
detrace or from torch, with `PipelineStage`) runs the same M microbatches with the loss averaged by the schedule.
"""

from __future__ import annotations

import argparse
import os
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


def imports(api: str) -> tuple[Any, Any, Any, Any]:
    """(fully_shard, parallelize_module, ColwiseParallel, RowwiseParallel) from detrace or from torch."""
    if api == "detrace":
        from detrace.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[assignment]
        from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    return fully_shard, parallelize_module, ColwiseParallel, RowwiseParallel


def build(api: str, mesh: DeviceMesh, stages: int = 1) -> LlamaForCausalLM:
    """The tiny Llama, the same whole model on every rank, parallelized on `mesh` (dimensions data, tp); with
    `stages` > 1, this rank's stage of it (mesh dimension pp)."""
    fully_shard, parallelize_module, ColwiseParallel, RowwiseParallel = imports(api)
    torch.manual_seed(0)  # the same whole model on every rank; the plan and fully_shard keep their shards
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    # torchtitan's plan for a Llama without sequence parallelism; T = 1 too, so that every mesh computes alike
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
    if stages > 1:
        keep_stage(model, mesh.get_local_rank("pp"), stages)
    shards = data_mesh(mesh)
    for layer in model.model.layers:
        if not isinstance(layer, torch.nn.Identity):
            fully_shard(layer, mesh=shards)
    if stages == 1:  # a pipeline stage's root stays unsharded: torch's stage turns its gradient sync off between
        fully_shard(model, mesh=shards)  # microbatches, which detrace's fully_shard refuses
    return model


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """fully_shard's mesh: the data ranks, or on a dpDxfsdpF layout HSDP's 2-D mesh (replicate D, shard F) over the
    same ranks, data rank d at (d // F, d % F), so that each rank keeps its block of microbatches."""
    layout = Layout.parse(os.environ.get(LAYOUT_ENV, "1x1"))
    replicas, shard = layout.size("dp"), layout.size("fsdp")
    if replicas == 1 or shard == 1:
        return mesh["data"]
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    return init_device_mesh("cpu", (pp, replicas, shard, tp), mesh_dim_names=("pp", "dp", "fsdp", "tp"))["dp", "fsdp"]


def keep_stage(model: LlamaForCausalLM, stage: int, stages: int) -> None:
    """Cut `model` down to pipeline stage `stage` of `stages` (contiguous decoder layers, the embedding first, the
    norm and head last), the whole model's names kept, and make its forward the stage's: input ids or the previous
    stage's hidden states in, hidden states or logits out."""
    inner, layers = model.model, model.config.num_hidden_layers
    per = layers // stages
    for i in range(layers):
        if not stage * per <= i < (stage + 1) * per:
            inner.layers[i] = torch.nn.Identity()
    if stage > 0:
        inner.embed_tokens = None
    if stage < stages - 1:
        inner.norm, model.lm_head = None, None

    def forward(x: torch.Tensor) -> torch.Tensor:
        hidden = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        rotary = inner.rotary_emb(hidden, position_ids=positions)
        for layer in inner.layers:
            if not isinstance(layer, torch.nn.Identity):
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        return model.lm_head(inner.norm(hidden)) if model.lm_head is not None else hidden

    object.__setattr__(model, "forward", forward)  # nn.Module calls self.forward: this instance's stage


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


def pipeline_step(schedule: Any, model: LlamaForCausalLM, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                  step: int, microbatches: int) -> None:
    """One step of the same global batch through the pipeline: the first stage feeds the M microbatches (2 rows
    each), the last computes each one's loss (the model's own), and the schedule averages over them."""
    batch = torch.randint(0, model.config.vocab_size, (microbatches, 2, 16),
                          generator=torch.Generator().manual_seed(step)).view(-1, 16)
    stage, last = mesh.get_local_rank("pp"), mesh["pp"].size() - 1
    if stage == 0:
        schedule.step(batch)
    elif stage == last:
        schedule.step(target=batch)
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("detrace", "torch"), default="detrace")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    layout = Layout.parse(os.environ.get(LAYOUT_ENV, "1x1"))
    if layout.dims - {"dp", "fsdp", "tp", "pp"} or ("pp" in layout.dims and len(layout.dims) > 1):
        raise SystemExit(f"this example runs data and tensor parallelism, or pipelining alone, not {layout.name}")
    data, tp, pp = layout.data, layout.size("tp"), layout.size("pp")
    if "WORLD_SIZE" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    if dist.get_world_size() != pp * data * tp:
        raise SystemExit(f"layout {layout.name} takes {pp * data * tp} processes, not {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (pp, data, tp), mesh_dim_names=("pp", "data", "tp"))
    model = build(args.api, mesh, stages=pp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = pipeline(args.api, model, mesh, args.microbatches) if pp > 1 else None
    # check-topology --resume-at K's contract: stop after step K with a checkpoint, or resume from it
    ckpt, stop_at = os.environ.get("DETRACE_CKPT_DIR"), int(os.environ.get("DETRACE_STOP_AT", "0"))
    first = resume(model, optimizer, ckpt) if ckpt and os.environ.get("DETRACE_RESUME") == "1" else 0
    for step in range(first, args.steps):
        if schedule is not None:
            pipeline_step(schedule, model, optimizer, mesh, step, args.microbatches)
        else:
            train_step(model, optimizer, mesh, step, args.microbatches)
        if ckpt and step + 1 == stop_at:
            save(model, optimizer, ckpt, step + 1)
            break
    dist.destroy_process_group()


def pipeline(api: str, model: LlamaForCausalLM, mesh: DeviceMesh, microbatches: int) -> Any:
    """This rank's stage in a 1F1B schedule from detrace or from torch (torch's signatures either way)."""
    if api == "detrace":
        from detrace.parallel import PipelineStage, Schedule1F1B
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # type: ignore[assignment]
    stage = PipelineStage(model, mesh.get_local_rank("pp"), mesh["pp"].size(), torch.device("cpu"),
                          group=mesh["pp"].get_group())

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)

    return Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn)


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
