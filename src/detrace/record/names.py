"""Qualified names of modules and parameters, as the user's model names them.

Wrappers that add a prefix without adding meaning are looked through, so a traced DDP or compiled model
names its modules as the bare model does: DistributedDataParallel (`module.`) and torch.compile (`_orig_mod.`,
at the root or below).
FSDP2 (`fully_shard`) keeps the model's structure and needs nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import torch
from torch import nn


def _inner(module: nn.Module) -> nn.Module | None:
    """The module a DDP / torch.compile wrapper holds, or None for anything else."""
    attribute = "module" if type(module).__name__ == "DistributedDataParallel" else "_orig_mod"
    inner = getattr(module, attribute, None)
    return inner if isinstance(inner, nn.Module) else None


def named_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) for the root, the wrappers around it (all named "") and everything below. A
    submodule compiled on its own (`model.layers[i] = torch.compile(layer)`) is named as the bare model names it:
    its wrapper and the module it holds both get the wrapper's place, `layers.i`."""
    module = root
    while (inner := _inner(module)) is not None:
        yield "", module
        module = inner
    for name, found in module.named_modules(remove_duplicate=False):
        yield ".".join(part for part in name.split(".") if part != "_orig_mod"), found


def roots() -> list[nn.Module]:
    """Every live nn.Module that is nobody's child (one scan of the garbage collector's objects)."""
    modules = [obj for obj in gc.get_objects() if issubclass(type(obj), nn.Module)]
    children = {id(child) for module in modules for child in module.children()}
    return [module for module in modules if id(module) not in children]


def owners(parameters: set[int]) -> list[nn.Module]:
    """The root modules alive now that hold any of `parameters` (by id): the models an optimizer trains."""
    return [root for root in roots() if any(id(p) in parameters for p in root.parameters())]


def buffers(root: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(qualified name, tensor) of every buffer of a model, named as the bare model names it, each once."""
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for prefix, module in named_modules(root):
        for name, buffer in module.named_buffers(recurse=False):
            if isinstance(buffer, torch.Tensor):
                found.setdefault(id(buffer), (f"{prefix}.{name}" if prefix else name, buffer))
    return list(found.values())


def parameter_names() -> dict[int, str]:
    """id(parameter) -> qualified name, over every root module alive now. A parameter that two roots hold (a whole
    model and a pipeline stage built from its blocks) is named by the root that holds the most parameters: the order
    the garbage collector lists the roots in is no property of the program, and a name taken from it could differ
    between two runs of the same program (a false structural divergence)."""
    names: dict[int, str] = {}
    for root in sorted(roots(), key=lambda root: -sum(1 for _ in root.parameters())):
        for prefix, module in named_modules(root):
            for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
                if isinstance(param, torch.Tensor):
                    names.setdefault(id(param), f"{prefix}.{name}" if prefix else name)
    return names
