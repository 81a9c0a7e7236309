"""The module rung's tags of autograd nodes (which module's forward created each node) are those of a full walk
from every module call's outputs back to its inputs, in the order the calls end, even though the walk reuses what
inner calls found (`rungs.module._walk`). Checked on random nested calls that return several outputs (some unused),
return their inputs, and read tensors of an outer scope that are not their inputs."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from detrace.record.rungs.module import OWNER, _tag

Tagger = Callable[[list[torch.Tensor], list[torch.Tensor], str], None]


def _full_walk(outputs: list[torch.Tensor], inputs: list[torch.Tensor], name: str) -> None:
    """The definition: every node reachable from the outputs short of the inputs' nodes, untagged ones tagged."""
    kept: list[Any] = [t.grad_fn for t in inputs]
    seen = {id(node) for node in kept}
    todo: list[Any] = [t.grad_fn for t in outputs]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or not node.next_functions:
            continue
        kept.append(node)
        seen.add(id(node))
        node.metadata.setdefault(OWNER, name)
        todo += [child for child, _ in node.next_functions]


def _call(rng: random.Random, tag: Tagger, name: str, depth: int, args: list[torch.Tensor],
          scope: list[torch.Tensor], made: list[torch.Tensor]) -> list[torch.Tensor]:
    """One module call: ops on its arguments and on tensors of the calls around it (read without being passed),
    inner calls, and one to three outputs, which may be an argument or a tensor no one uses later."""
    local = list(args)
    for index in range(rng.randint(1, 4)):
        if depth and rng.random() < 0.5:
            inner_args = rng.sample(local, rng.randint(1, min(2, len(local))))
            local += _call(rng, tag, f"{name}.{index}", depth - 1, inner_args, local + scope, made)
        else:
            a = rng.choice(local)
            b = rng.choice(local + scope)
            local.append(a * b.sin() if rng.random() < 0.5 else a + b)
        made.append(local[-1])
    outputs = rng.sample(local, rng.randint(1, min(3, len(local))))
    tag([t for t in outputs if t.grad_fn is not None], [t for t in args if t.grad_fn is not None], name)
    return outputs


def _tags(seed: int, tag: Tagger) -> list[str | None]:
    """Run the random program of `seed` with `tag` and list every node's tag in a fixed order of the graph."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    x = torch.randn(3, requires_grad=True)
    base = [x, x.exp(), x * 2]
    made: list[torch.Tensor] = []
    outputs = _call(rng, tag, "", 3, base[1:], base, made)
    root = torch.stack([t.sum() for t in outputs + made + base]).sum().grad_fn
    order: list[str | None] = []
    seen: set[int] = set()
    todo: list[Any] = [root]
    kept: list[Any] = []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        kept.append(node)
        seen.add(id(node))
        order.append(node.metadata.get(OWNER))
        todo += [child for child, _ in node.next_functions]
    return order


@pytest.mark.parametrize("seeds", [range(0, 150), range(150, 300)])
def test_tags_are_those_of_a_full_walk_per_call(seeds: range) -> None:
    for seed in seeds:
        assert _tags(seed, _tag) == _tags(seed, _full_walk), f"seed {seed}"
