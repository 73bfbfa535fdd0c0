"""Partitions of a model into blocks of tensors, named by parameter-name prefixes.

Block-coordinate rounds (``bcd``) and streaming DiLoCo's fragments both split the model
into contiguous groups of modules. The functions here are pure and deterministic, so the
server and a client compute the same partition from the same tensor names and shapes.

A *prefix* names a module (``"encoder.layer.0"``) or a tensor (``"fc.bias"``): tensor
``name`` matches prefix ``p`` when ``name == p`` or ``name`` starts with ``p + "."``, so
``"layer1"`` does not match ``"layer10.weight"``.

A *row slice* names rows ``start:stop`` (along dim 0) of one tensor: ``"fc.weight#rows=0:1024"``
(``row_slice_name``; no tensor of torch's layers has such a name). Streaming DiLoCo's fragments may hold row
slices of a tensor too large for one fragment (``default_blocks(..., split_rows=True)``);
such a slice is its own prefix and its own tensor name, and travels as an ordinary tensor
(``sliced_state`` gives a model's tensors under those names, ``joined_state`` the way back).
"""

from __future__ import annotations

import bisect
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import torch

from fedgrid.types import ModelState, TensorSpec

__all__ = [
    "Block",
    "ROWS_MARK",
    "matches_prefix",
    "default_blocks",
    "blocks_from_prefixes",
    "balanced_split",
    "row_slice_name",
    "parse_row_slice",
    "tensor_of",
    "row_slices",
    "sliced_state",
    "joined_state",
]

#: What separates a tensor's name from the rows of a row slice (``row_slice_name``).
ROWS_MARK = "#rows="
_ROW_SLICE = re.compile(rf"^(?P<name>.+){re.escape(ROWS_MARK)}(?P<start>\d+):(?P<stop>\d+)$")


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


def row_slice_name(name: str, start: int, stop: int) -> str:
    """The name of rows ``start:stop`` (along dim 0) of tensor ``name``: ``"name#rows=start:stop"``."""
    return f"{name}{ROWS_MARK}{start}:{stop}"


def parse_row_slice(name: str) -> tuple[str, int, int] | None:
    """``(tensor, start, stop)`` of a row slice name (``row_slice_name``); ``None`` for any other name."""
    found = _ROW_SLICE.match(name)
    if found is None:
        return None
    return found["name"], int(found["start"]), int(found["stop"])


def tensor_of(name: str) -> str:
    """The tensor ``name`` belongs to: the tensor of a row slice, any other name itself."""
    part = parse_row_slice(name)
    return name if part is None else part[0]


def row_slices(blocks: Sequence[Block]) -> dict[str, list[tuple[str, int, int]]]:
    """The tensors ``blocks`` split, each with its slices ``(slice name, start, stop)`` in row order."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for block in blocks:
        for name in block.names:
            part = parse_row_slice(name)
            if part is not None:
                out.setdefault(part[0], []).append((name, part[1], part[2]))
    return {name: sorted(parts, key=lambda p: p[1]) for name, parts in out.items()}


def sliced_state(
    state: Mapping[str, torch.Tensor], slices: Mapping[str, Sequence[tuple[str, int, int]]]
) -> ModelState:
    """``state`` with each tensor of ``slices`` (``row_slices``) replaced by its row slices, in
    model order: views of its rows, no copy. ``state`` itself when ``slices`` is empty."""
    if not slices:
        return state if isinstance(state, OrderedDict) else OrderedDict(state)
    out: ModelState = OrderedDict()
    for name, tensor in state.items():
        for part, start, stop in slices.get(name, ((name, -1, -1),)):
            out[part] = tensor if start < 0 else tensor.narrow(0, start, stop - start)
    return out


def joined_state(state: Mapping[str, torch.Tensor]) -> ModelState:
    """The inverse of ``sliced_state``: each tensor whose row slices ``state`` holds, whole again
    (its slices concatenated in row order, at the position of its first slice); other tensors as they are.

    Raises:
        ValueError: the slices of a tensor do not cover its rows ``0:n`` exactly once.
    """
    if not any(parse_row_slice(name) for name in state):
        return state if isinstance(state, OrderedDict) else OrderedDict(state)
    parts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    order: list[str] = []
    for name, tensor in state.items():
        part = parse_row_slice(name)
        whole = name if part is None else part[0]
        if whole not in parts:
            order.append(whole)
            parts[whole] = []
        if part is None:
            parts[whole].append((-1, -1, tensor))
        else:
            parts[whole].append((part[1], part[2], tensor))
    out: ModelState = OrderedDict()
    for whole in order:
        pieces = sorted(parts[whole], key=lambda p: p[0])
        if pieces[0][0] < 0:
            if len(pieces) > 1:
                raise ValueError(f"tensor '{whole}' is given both whole and as row slices")
            out[whole] = pieces[0][2]
            continue
        at = 0
        for start, stop, tensor in pieces:
            if start != at or tensor.shape[0] != stop - start:
                raise ValueError(
                    f"the row slices of tensor '{whole}' do not cover its rows once: rows {at} onwards "
                    f"expected, got {start}:{stop} holding {tensor.shape[0]} rows"
                )
            at = stop
        out[whole] = torch.cat([tensor for _, _, tensor in pieces])
    return out


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


def default_blocks(
    specs: Mapping[str, TensorSpec], num_blocks: int, *, split_rows: bool = False
) -> list[Block]:
    """Splits a model into ``num_blocks`` contiguous groups of modules, balanced by element count.

    Modules are grouped by the first component of their names (the top-level modules); if
    there are fewer top-level modules than blocks, by the first two components, and so on,
    down to single tensors.

    With ``split_rows`` (streaming DiLoCo's fragments), a tensor larger than a fair share of
    the model (more bytes than total / ``num_blocks``) with at least 2 rows may be cut along
    dim 0 into row slices held by several blocks (``row_slice_name``), so that the blocks
    balance by bytes even when one layer dominates. The rule, when the model has such a
    tensor: the model is a sequence of units in model order (the groups above; a group
    holding a large tensor as its tensors, each large tensor as its rows), and cut ``k`` lies
    at the unit boundary nearest to ``k * total / num_blocks`` bytes (each block keeps at
    least one unit). A cut inside a large tensor is thus within half a row of its ideal
    place, and a block whose cuts both fall in large tensors holds total / ``num_blocks``
    bytes within one row's bytes (an MLP whose one layer dominates: every block). Without such
    a tensor, when the groups above leave a block over 1.5 fair shares, every group larger
    than a fair share (a transformer's layers under one module) is cut between its tensors the
    same way. Any other model (and every model without ``split_rows``) gets exactly the groups above.

    Raises:
        ValueError: ``num_blocks`` < 1, or the model has fewer tensors (or, when it splits
            rows, units) than ``num_blocks``.
    """
    if num_blocks < 1:
        raise ValueError(f"the number of blocks must be at least 1, got {num_blocks}")
    total = sum(spec.nbytes for spec in specs.values())
    large = {
        n
        for n, spec in specs.items()
        if split_rows
        and num_blocks > 1
        and spec.nbytes * num_blocks > total
        and spec.shape
        and spec.shape[0] > 1
    }
    if len(specs) < num_blocks and not large:
        raise ValueError(f"cannot split a model of {len(specs)} tensors into {num_blocks} blocks")
    depth = 1
    groups = _groups(specs, depth)
    max_depth = max(len(name.split(".")) for name in specs)
    while len(groups) < num_blocks and depth < max_depth:
        depth += 1
        groups = _groups(specs, depth)
    if large:
        return _row_split_blocks(specs, groups, large, num_blocks)
    whole = _group_blocks(specs, groups, num_blocks)
    if split_rows and max(sum(specs[n].nbytes for n in b.names) for b in whole) * num_blocks > 1.5 * total:
        # Whole groups leave a fragment over 1.5 fair shares: a group larger than a fair share
        # (a transformer's stack of layers under one module) is cut between its tensors.
        wide = {k for k, names in groups.items() if sum(specs[n].nbytes for n in names) * num_blocks > total}
        if wide:
            return _row_split_blocks(specs, groups, large, num_blocks, wide=wide)
    return whole


def _group_blocks(
    specs: Mapping[str, TensorSpec], groups: Mapping[str, list[str]], num_blocks: int
) -> list[Block]:
    """``num_blocks`` contiguous runs of whole ``groups``, balanced by element count."""
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


@dataclass(frozen=True)
class _Unit:
    """A piece ``default_blocks`` never cuts: a group (``key``), a tensor, or one row of a large tensor."""

    key: str
    names: tuple[str, ...]
    nbytes: int
    numel: int
    row: int = -1  # the row of tensor ``key``, or -1 for a group or a whole tensor


def _row_split_blocks(
    specs: Mapping[str, TensorSpec],
    groups: Mapping[str, list[str]],
    large: set[str],
    num_blocks: int,
    *,
    wide: Collection[str] = (),
) -> list[Block]:
    """``default_blocks`` for a model with ``large`` tensors or ``wide`` groups: cuts at the nearest unit boundaries."""
    units: list[_Unit] = []
    for key, names in groups.items():
        if key not in wide and not large.intersection(names):
            units.append(
                _Unit(
                    key,
                    tuple(names),
                    sum(specs[n].nbytes for n in names),
                    sum(_numel(specs[n]) for n in names),
                )
            )
            continue
        for name in names:
            spec = specs[name]
            if name not in large:
                units.append(_Unit(name, (name,), spec.nbytes, _numel(spec)))
                continue
            rows = spec.shape[0]
            units.extend(
                _Unit(name, (name,), spec.nbytes // rows, _numel(spec) // rows, row) for row in range(rows)
            )
    if len(units) < num_blocks:
        raise ValueError(f"cannot split a model of {len(units)} units into {num_blocks} blocks")
    ends = [0]
    for unit in units:
        ends.append(ends[-1] + unit.nbytes)
    total = ends[-1]
    cuts = [0]
    for k in range(1, num_blocks):
        target = k * total / num_blocks
        lowest, highest = cuts[-1] + 1, len(units) - (num_blocks - k)
        at = min(max(bisect.bisect_left(ends, target), lowest), highest)
        if at > lowest and target - ends[at - 1] <= ends[at] - target:
            at -= 1
        cuts.append(at)
    cuts.append(len(units))
    return [_block_of(index, units[cuts[index] : cuts[index + 1]], specs) for index in range(num_blocks)]


def _block_of(index: int, units: Sequence[_Unit], specs: Mapping[str, TensorSpec]) -> Block:
    """Block ``index`` of ``units``: consecutive rows of one tensor become one row slice (or the
    whole tensor, when they are all its rows)."""
    prefixes: list[str] = []
    names: list[str] = []
    at = 0
    while at < len(units):
        unit = units[at]
        if unit.row < 0:
            prefixes.append(unit.key)
            names.extend(unit.names)
            at += 1
            continue
        stop = at + 1
        while stop < len(units) and units[stop].key == unit.key:
            stop += 1
        first, last = unit.row, units[stop - 1].row + 1
        name = (
            unit.key
            if first == 0 and last == specs[unit.key].shape[0]
            else row_slice_name(unit.key, first, last)
        )
        prefixes.append(name)
        names.append(name)
        at = stop
    return Block(index, tuple(prefixes), tuple(names), sum(u.numel for u in units))


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
