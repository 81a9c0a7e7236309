"""detrace.ops.hf_experts: the "detrace" experts implementation of transformers' MoE models, against HF's "eager"
experts (same function to float tolerance) and bit-identical across runs without torch's global switch."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from detrace.errors import UsageError
from detrace.ops import hf_experts as hf

# Looked up, not imported: transformers' MoE integration and its models take about 3 s to import, which every
# pytest worker would pay at collection. The tests import them.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                or importlib.util.find_spec("transformers.integrations.moe") is None,
                                reason="needs transformers with its MoE experts (transformers.integrations.moe)")


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _mixtral(implementation: str) -> Any:
    """A one-layer Mixtral for causal LM whose experts run `implementation`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=128)
    config._experts_implementation = implementation
    return MixtralForCausalLM(config)


def _train_step(implementation: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _mixtral(implementation)
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_detrace_experts_compute_hfs_eager_experts() -> None:
    hf.register()
    hf.register()  # idempotent
    from transformers.integrations.moe import ExpertsInterface

    assert ExpertsInterface()["detrace"] is hf.experts_forward
    eager_loss, eager_grads = _train_step("eager")
    loss, grads = _train_step("detrace")
    torch.testing.assert_close(loss, eager_loss)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_detrace_experts_are_bit_identical_across_runs_and_thread_counts() -> None:
    hf.register()
    assert not torch.are_deterministic_algorithms_enabled()
    runs = []
    for threads in (2, 2, 1):
        torch.set_num_threads(threads)
        layer = _mixtral("detrace").model.layers[0].mlp.experts
        torch.nn.init.normal_(layer.gate_up_proj, std=0.2, generator=torch.Generator().manual_seed(2))
        torch.nn.init.normal_(layer.down_proj, std=0.2, generator=torch.Generator().manual_seed(3))
        g = torch.Generator().manual_seed(4)
        hidden = torch.randn(1024, 32, generator=g, requires_grad=True)
        weights, index = torch.rand(1024, 8, generator=g).softmax(-1).topk(2, dim=-1)
        weights.requires_grad_()
        out = layer(hidden, index, weights)
        out.backward(torch.cos(out))
        runs.append([out.detach(), hidden.grad, weights.grad, layer.gate_up_proj.grad, layer.down_proj.grad])
    for a, b in zip(runs[0], runs[1], strict=True):
        assert torch.equal(a, b)
    # permute/combine are thread-count independent; the expert GEMMs are BLAS calls, compared to tolerance
    for a, b in zip(runs[0], runs[2], strict=True):
        torch.testing.assert_close(a, b)


def test_expert_parallel_models_are_refused() -> None:
    hf.register()
    layer = _mixtral("detrace").model.layers[0].mlp.experts
    layer._is_expert_parallel = True
    with pytest.raises(UsageError, match="expert-parallel"):
        layer(torch.zeros(2, 32), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
