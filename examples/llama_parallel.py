"""A Hugging Face Llama parallelized the torchtitan way (a tensor-parallel plan, then fully_shard per decoder layer),
the same bits on every mesh with detrace's imports instead of torch's.

    detrace check-topology --layouts 1x1,fsdp2,tp2,fsdp2xtp2 -- python examples/llama_parallel.py --api detrace
    detrace check-topology --layouts 1x1,tp2 -- python examples/llama_parallel.py --api torch     # differs
    detrace check-topology --layouts fsdp2xtp2,1x1,tp2 --resume-at 1 -- python examples/llama_parallel.py

The model is a tiny `LlamaForCausalLM` built in code (no download). The layout comes from DETRACE_LAYOUT, which
`check-topology --layouts` sets (`1x1`, `fsdp2`, `tp2`, `fsdp2xtp2`, `dp2`; unset: one process); the data
dimensions shard the model with fully_shard, `tp` splits it with the plan. The loop is torchtitan's gradient
accumulation: the global batch is M microbatches of a fixed size, drawn from a generator seeded by the step; the
rank of data-parallel coordinate d runs microbatches [d n, (d + 1) n) with n = M / (data ranks), one backward each,
each loss scaled by 1 / n (torch's averaging does the rest). The only difference between `--api detrace` and
`--api torch` is where `fully_shard`, `parallelize_module`, `ColwiseParallel` and `RowwiseParallel` come from.
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


def build(api: str, mesh: DeviceMesh) -> LlamaForCausalLM:
    """The tiny Llama, the same whole model on every rank, parallelized on `mesh` (dimensions data, tp)."""
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
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data"])
    fully_shard(model, mesh=mesh["data"])
    return model


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("detrace", "torch"), default="detrace")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    layout = Layout.parse(os.environ.get(LAYOUT_ENV, "1x1"))
    if layout.dims - {"dp", "fsdp", "tp"}:
        raise SystemExit(f"this example runs data and tensor parallelism, not layout {layout.name}")
    data, tp = layout.data, layout.size("tp")
    if "WORLD_SIZE" not in os.environ:  # one process without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    if dist.get_world_size() != data * tp:
        raise SystemExit(f"layout {layout.name} takes {data * tp} processes, not {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (data, tp), mesh_dim_names=("data", "tp"))
    model = build(args.api, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # check-topology --resume-at K's contract: stop after step K with a checkpoint, or resume from it
    ckpt, stop_at = os.environ.get("DETRACE_CKPT_DIR"), int(os.environ.get("DETRACE_STOP_AT", "0"))
    first = resume(model, optimizer, ckpt) if ckpt and os.environ.get("DETRACE_RESUME") == "1" else 0
    for step in range(first, args.steps):
        train_step(model, optimizer, mesh, step, args.microbatches)
        if ckpt and step + 1 == stop_at:
            save(model, optimizer, ckpt, step + 1)
            break
    dist.destroy_process_group()


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
