"""Partitions of a model into blocks of tensors, named by parameter-name prefixes.

Block-coordinate rounds (``bcd``) and streaming DiLoCo's fragments both split the model
into contiguous groups of modules. The functions here are pure and deterministic, so the
server and a client compute the same partition from the same tensor names and shapes.

A *prefix* names a module (``"encoder.layer.0"``) or a tensor (``"fc.bias"``): tensor
``name`` matches prefix ``p`` when ``name == p`` or ``name`` starts with ``p + "."``, so
``"layer1"`` does not match ``"layer10.weight"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from fedgrid.types import TensorSpec

__all__ = ["Block", "matches_prefix", "default_blocks", "blocks_from_prefixes", "balanced_split"]


@dataclass(frozen=True)
class Block:
    """One part of a model.

    Attributes:
        index: position in the partition.
        prefixes: the module or tensor names that define it (what a task config carries).
        names: the tensors it holds, in model order.
        numel: the elements it holds.
    """

    index: int
    prefixes: tuple[str, ...]
    names: tuple[str, ...]
    numel: int


def matches_prefix(name: str, prefix: str) -> bool:
    """Whether tensor ``name`` lies under module (or is tensor) ``prefix``."""
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


def _numel(spec: TensorSpec) -> int:
    count = 1
    for dim in spec.shape:
        count *= dim
    return count


def balanced_split(weights: Sequence[int], parts: int) -> list[int]:
    """Cuts ``weights`` into exactly ``parts`` contiguous, non-empty runs minimizing the largest sum.

    Returns:
        The start index of each run (the first is 0).

    Raises:
        ValueError: ``parts`` is not in [1, len(weights)].
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} groups into {parts} non-empty parts")

    def runs_needed(cap: int) -> int:
        count, acc = 1, 0
        for w in weights:
            if acc + w > cap:
                count, acc = count + 1, w
            else:
                acc += w
        return count

    lo, hi = max(weights), max(sum(weights), max(weights))
    while lo < hi:  # the smallest cap that greedy packing fits into `parts` runs
        mid = (lo + hi) // 2
        if runs_needed(mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    starts, acc = [0], 0
    for i, w in enumerate(weights):
        opened = len(starts)
        # Open a new run when the cap is reached, or when the items left are just enough
        # to give each remaining run one.
        if i > starts[-1] and opened < parts and (acc + w > lo or n - i == parts - opened):
            starts.append(i)
            acc = 0
        acc += w
    return starts


def _groups(specs: Mapping[str, TensorSpec], depth: int) -> dict[str, list[str]]:
    """Tensor names grouped by their first ``depth`` name components, in first-seen order."""
    groups: dict[str, list[str]] = {}
    for name in specs:
        key = ".".join(name.split(".")[:depth])
        groups.setdefault(key, []).append(name)
    return groups


def default_blocks(specs: Mapping[str, TensorSpec], num_blocks: int) -> list[Block]:
    """Splits a model into ``num_blocks`` contiguous groups of modules, balanced by element count.

    Modules are grouped by the first component of their names (the top-level modules); if
    there are fewer top-level modules than blocks, by the first two components, and so on,
    down to single tensors.

    Raises:
        ValueError: ``num_blocks`` < 1, or the model has fewer tensors than ``num_blocks``.
    """
    if num_blocks < 1:
        raise ValueError(f"the number of blocks must be at least 1, got {num_blocks}")
    if len(specs) < num_blocks:
        raise ValueError(f"cannot split a model of {len(specs)} tensors into {num_blocks} blocks")
    depth = 1
    groups = _groups(specs, depth)
    max_depth = max(len(name.split(".")) for name in specs)
    while len(groups) < num_blocks and depth < max_depth:
        depth += 1
        groups = _groups(specs, depth)
    keys = list(groups)
    sizes = [sum(_numel(specs[n]) for n in groups[k]) for k in keys]
    starts = balanced_split(sizes, num_blocks) + [len(keys)]
    block_of = {key: index for index in range(num_blocks) for key in keys[starts[index] : starts[index + 1]]}
    owner = {name: block_of[key] for key, names in groups.items() for name in names}
    blocks = []
    for index in range(num_blocks):
        names = tuple(n for n in specs if owner[n] == index)
        blocks.append(
            Block(
                index,
                tuple(keys[starts[index] : starts[index + 1]]),
                names,
                sum(_numel(specs[n]) for n in names),
            )
        )
    return blocks


def blocks_from_prefixes(specs: Mapping[str, TensorSpec], prefixes: Sequence[Sequence[str]]) -> list[Block]:
    """One block per entry of ``prefixes``, holding the tensors under any of its prefixes.

    Raises:
        ValueError: a block matches no tensor, a tensor matches no block or two blocks.
    """
    if not prefixes:
        raise ValueError("no block prefixes given")
    owner: dict[str, int] = {}
    for index, group in enumerate(prefixes):
        if not group or any(not p.strip(".") for p in group):
            raise ValueError(f"block {index} has an empty prefix")
        for name in specs:
            if any(matches_prefix(name, p) for p in group):
                if name in owner:
                    raise ValueError(
                        f"tensor '{name}' matches blocks {owner[name]} and {index}: block prefixes must not overlap"
                    )
                owner[name] = index
    missing = [n for n in specs if n not in owner]
    if missing:
        raise ValueError(
            f"tensors {missing[:5]} match no block prefix ({len(missing)} in all): the blocks must cover the model"
        )
    blocks = []
    for index, group in enumerate(prefixes):
        names = tuple(n for n in specs if owner[n] == index)
        if not names:
            raise ValueError(f"block {index} (prefixes {list(group)}) matches no tensor")
        blocks.append(
            Block(index, tuple(p.rstrip(".") for p in group), names, sum(_numel(specs[n]) for n in names))
        )
    return blocks
