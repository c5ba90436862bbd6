"""Checkpoint loading: tensors by their transformers names into our (partly fused) parameters.

A module whose parameters fuse several checkpoint tensors (q/k/v, gate/up, per-expert weights)
declares `checkpoint_shards()`: checkpoint name relative to the module -> the Shard it fills.
Every other checkpoint name must be one of our parameters, shape for shape. Any unknown tensor,
wrong shape, tensor given twice or parameter left unfilled is refused with its name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows [start, start + rows) of our parameter `param` (of expert `expert`'s slice first)."""

    param: str
    start: int
    rows: int
    expert: int | None = None


IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Checkpoint entries that older transformers versions saved but that hold no weights."""


def _as_shard(value: Shard | tuple[str, int, int]) -> Shard:
    return value if isinstance(value, Shard) else Shard(*value)


def renamed(name: str, rename: dict[str, str]) -> str:
    """A checkpoint name as ours (the first rename whose source occurs, applied)."""
    for old, new in rename.items():
        if old in name:
            return name.replace(old, new)
    return name


def _checkpoint_name(name: str, rename: dict[str, str]) -> str:
    """Our name as the checkpoint spells it (the first rename whose target occurs, undone)."""
    for old, new in rename.items():
        if new in name:
            return name.replace(new, old)
    return name


def _declared(model: nn.Module, method: str) -> Iterator[tuple[str, str, Any]]:
    """(module prefix with its dot, name, value) for every entry of `method()`'s dict, over every
    module that defines `method`."""
    for prefix, module in model.named_modules():
        declare = getattr(module, method, None)
        if declare is None:
            continue
        base = f"{prefix}." if prefix else ""
        for name, value in declare().items():
            yield base, name, value


def shard_map(model: nn.Module) -> dict[str, Shard]:
    """Full checkpoint name -> Shard (full parameter name), over every module that declares one."""
    out: dict[str, Shard] = {}
    for base, name, value in _declared(model, "checkpoint_shards"):
        shard = _as_shard(value)
        out[base + name] = Shard(base + shard.param, shard.start, shard.rows, shard.expert)
    return out


TPSlice = tuple[int, int, int]
"""(dim, start, length): the part of a checkpoint tensor one tensor-parallel rank reads."""


def slice_map(model: nn.Module) -> dict[str, TPSlice | None]:
    """Full (our) name -> the slice this rank reads, None for a tensor it holds no part of, over
    every module that declares `tp_slices()`; names absent are read whole (replicated)."""
    return {base + name: value for base, name, value in _declared(model, "tp_slices")}


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: dict[str, str] | None = None,
    skip: Iterable[str] = (),
) -> None:
    """Copies (name, tensor) pairs into `model`'s parameters.

    rename: a substring of a checkpoint name -> ours (the first that occurs). skip: exact checkpoint names to drop
    (e.g. a tied lm_head) and our parameters not expected from the checkpoint.
    Raises ValueError on an unknown name, a shape mismatch, a tensor given twice or a parameter
    missing at the end.
    """
    params = dict(model.named_parameters())
    shards = shard_map(model)
    skipped = set(skip)
    filled = dict.fromkeys((n for n in params if n not in skipped), 0)  # elements written
    seen: set[str] = set()
    seen_targets: set[str] = set()
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or name in skipped:
            continue
        if name in seen:
            raise ValueError(f"checkpoint weight {name!r} appears twice")
        seen.add(name)
        target = renamed(name, rename or {})
        seen_targets.add(target)
        shard = shards.get(target) if target not in params else None
        param_name = shard.param if shard is not None else target
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"unexpected checkpoint weight {name!r}")
        dst = param.data
        if shard is not None:
            if shard.expert is not None:
                dst = dst[shard.expert]
            dst = dst.narrow(0, shard.start, shard.rows)
        if dst.shape != tensor.shape:
            raise ValueError(
                f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        if param_name in filled:
            filled[param_name] += dst.numel()
            if filled[param_name] > param.numel():
                raise ValueError(
                    f"checkpoint weight {name!r} overlaps weights already loaded into {param_name!r}"
                )
    missing = []
    for param_name, count in filled.items():
        if count == params[param_name].numel():
            continue
        pieces = [n for n, s in shards.items() if s.param == param_name and n not in seen_targets]
        missing.extend(pieces if count and pieces else [param_name])
    if missing:
        missing = sorted(_checkpoint_name(n, rename or {}) for n in missing)
        raise ValueError(f"checkpoint is missing weights: {missing}")
