"""A user's own data, ``hf:PATH``: a local folder saved with ``datasets`` (``save_to_disk``) or data
files (json, jsonl, csv, parquet), split among sites by the built-in partitioners
(``fedgrid.simulation.datasets.partition``), as Flower Datasets splits a Hugging Face dataset::

    from fedgrid.simulation.hf_data import load_partition

    mine = load_partition("hf:data/reviews.jsonl", "dirichlet:0.5:label=stars", partitions=2, index=0)

Partitions (``HFPartition.parse``): ``iid``; ``dirichlet:A:label=COL`` (each label's examples
divided by a Dirichlet(A) draw); ``shard:K`` (McMahan's K label-sorted shards per site; the label
column from ``label=COL`` or ``label_column``); ``natural:COL`` (whole groups of COL's values per
site, e.g. a user id). Every site computes the same split from the same file and seed, and keeps
its own part.

Nothing is downloaded: a name that is not a local path is refused with how to save it locally.
``datasets`` is imported only here (the ``transformers`` extra).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedgrid.errors import ConfigError
from fedgrid.simulation.datasets import parse_partition, partition

__all__ = [
    "HFPartition",
    "HFText",
    "check_columns",
    "is_hf_data",
    "load_local",
    "load_partition",
    "load_text",
    "partition_indices",
    "site_windows",
    "text_columns",
]

#: Data files ``hf:PATH`` reads, by suffix: the ``datasets`` builder that reads them.
_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass(frozen=True)
class HFPartition:
    """A partition of a user's dataset: the built-in partitioner's spec and the column it reads.

    Attributes:
        spec: ``iid``, ``dirichlet:A``, ``shards:K`` or ``natural`` (``fedgrid.simulation.datasets.parse_partition``).
        column: the label column (dirichlet, shard) or the group column (natural); "" for iid.
    """

    spec: str
    column: str = ""

    @classmethod
    def parse(cls, text: str, *, label_column: str = "") -> "HFPartition":
        """``iid``, ``dirichlet:A[:label=COL]``, ``shard:K[:label=COL]`` or ``natural:COL``;
        ``label_column`` names the label where the spec does not.

        Raises:
            ConfigError: an unknown partitioner, a bad parameter, or no column to read (names ``partition``).
        """
        parts = text.split(":")
        options = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        params = [p for p in parts[1:] if "=" not in p]
        unknown = sorted(set(options) - {"label"})
        if unknown:
            raise ConfigError("partition", f"{text!r}: unknown option {unknown[0]!r} (known: label=COL)")
        label = options.get("label", label_column)
        name = parts[0]
        if name == "iid" and not params:
            return cls("iid")
        if name == "natural":
            if len(params) != 1 or not params[0]:
                raise ConfigError(
                    "partition", f"{text!r}: natural needs the column of the groups: natural:COL"
                )
            return cls("natural", params[0])
        if name in ("dirichlet", "shard", "shards"):
            if not label:
                raise ConfigError(
                    "partition", f"{text!r} splits by label: name the label column ({name}:...:label=COL)"
                )
            builtin = "dirichlet" if name == "dirichlet" else "shards"
            spec = builtin + (":" + params[0] if params else "")
            parse_partition(spec)  # a bad A or K names the partition key here
            return cls(spec, label)
        raise ConfigError(
            "partition",
            f"unknown partitioner {text!r} (known: iid, dirichlet:A:label=COL, shard:K, natural:COL)",
        )


@functools.lru_cache(maxsize=4)
def load_local(path: str) -> Any:
    """The ``datasets.Dataset`` of ``hf:PATH`` (or ``PATH``): a ``save_to_disk`` folder (its train
    split, if it holds several), a folder of data files, or one data file; read once per process
    (a simulation checks its options, then builds each client, from the same rows).

    Raises:
        ConfigError: a path that does not exist (a hub name: says how to save it locally), a file
            of another kind, or ``datasets`` not installed (names ``dataset``).
    """
    where = path.removeprefix("hf:")
    local = Path(where)
    if not where or not local.exists():
        raise ConfigError(
            "dataset",
            f"hf:{where}: no such local file or folder. Nothing is downloaded at run time: save a Hugging Face "
            f"dataset locally first, e.g. python -c \"import datasets; datasets.load_dataset('{where or 'NAME'}', "
            f"split='train').save_to_disk('data/{Path(where).name or 'NAME'}')\" on a machine with access, "
            f"then --dataset hf:data/{Path(where).name or 'NAME'}",
        )
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "dataset", "hf:PATH needs the datasets package: pip install 'fedgrid[transformers]'"
        ) from None
    if local.is_dir() and (
        (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file()
    ):
        loaded = datasets.load_from_disk(str(local))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ConfigError(
                    "dataset", f"hf:{where}: a DatasetDict without a train split ({', '.join(loaded)})"
                )
            loaded = loaded["train"]
        return loaded
    files = sorted(p for p in local.iterdir() if p.suffix in _BUILDERS) if local.is_dir() else [local]
    kinds = {_BUILDERS.get(p.suffix) for p in files}
    if not files or None in kinds or len(kinds) != 1:
        raise ConfigError(
            "dataset",
            f"hf:{where}: expected a save_to_disk folder or data files of one kind "
            f"({', '.join(sorted(_BUILDERS))}), found {', '.join(p.name for p in files) or 'none'}",
        )
    builder = kinds.pop()
    assert builder is not None
    return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train")


def _codes(dataset: Any, column: str, what: str) -> np.ndarray:
    if column not in dataset.column_names:
        raise ConfigError(
            "partition",
            f"the dataset has no {what} column {column!r}; its columns: {', '.join(dataset.column_names)}",
        )
    values = dataset[column]
    _, codes = np.unique(np.asarray([str(v) for v in values]), return_inverse=True)
    return codes.astype(np.int64)


def partition_indices(dataset: Any, part: HFPartition, partitions: int, seed: int) -> list[np.ndarray]:
    """Each site's example indices of ``dataset`` under ``part`` (the built-in partitioners).

    Raises:
        ConfigError: a column the dataset lacks (names it and lists those it has), or what the
            partitioner refuses.
    """
    if part.spec == "iid":
        return partition(np.zeros(len(dataset), dtype=np.int64), partitions, "iid", seed)
    if part.spec == "natural":
        groups = _codes(dataset, part.column, "group")
        return partition(groups, partitions, "natural", seed, groups=groups)
    return partition(_codes(dataset, part.column, "label"), partitions, part.spec, seed)


def load_partition(
    path: str, spec: str = "iid", *, partitions: int, index: int, seed: int = 0, label_column: str = ""
) -> Any:
    """Site ``index``'s part (of ``partitions``) of the local dataset ``path`` (``load_local``),
    split by ``spec`` (``HFPartition.parse``) under ``seed``: a ``datasets.Dataset``.

    Raises:
        ConfigError: what ``load_local``, ``HFPartition.parse`` and ``partition_indices`` raise,
            or an ``index`` outside ``[0, partitions)``.
    """
    if not 0 <= index < partitions:
        raise ConfigError("partition", f"site index {index} is outside 0..{partitions - 1}")
    part = HFPartition.parse(spec, label_column=label_column)
    dataset = load_local(path)
    return dataset.select(partition_indices(dataset, part, partitions, seed)[index].tolist())


def is_hf_data(dataset: str) -> bool:
    """Whether the ``dataset`` key names a user's own data (``hf:PATH``)."""
    return dataset.startswith("hf:")


def check_columns(dataset: Any, columns: list[str], what: str) -> None:
    """Raises ``ConfigError`` (naming ``what``) for the first of ``columns`` the dataset lacks,
    listing the columns it has."""
    for column in columns:
        if column not in dataset.column_names:
            raise ConfigError(
                what,
                f"the dataset has no column {column!r}; its columns: {', '.join(dataset.column_names)}",
            )


def text_columns(text_column: str) -> list[str]:
    """The columns ``text_column`` names (``prompt,completion``: joined in that order per row)."""
    return [c.strip() for c in text_column.split(",") if c.strip()]


#: Every TEST_EVERY-th window of the stream is a test window (a fixed split, the same at every site).
TEST_EVERY = 10


@dataclass(frozen=True, eq=False)
class HFText:
    """A user's text data as a language model's windows: ``chars`` (a ``CharData`` over the tokens
    of every row back to back, so the language-model path reads it as Shakespeare's characters),
    the row each train and test window starts in, and the rows themselves (for the partitioners).
    """

    chars: Any
    train_rows: np.ndarray
    test_rows: np.ndarray
    rows: Any


@functools.lru_cache(maxsize=4)
def load_text(path: str, context: int, text_column: str = "text", tokenizer: str = "") -> HFText:
    """``hf:PATH``'s rows (``load_local``) as windows of ``context`` tokens: each row's
    ``text_column`` (several, comma-separated, joined) tokenized by the model folder ``tokenizer``'s
    own tokenizer (bytes when ``""`` or it holds none), a newline after each row, all rows back to
    back, cut into non-overlapping windows; a window belongs to the row it starts in, and every
    ``TEST_EVERY``-th window tests (of fewer windows, the last one).

    Raises:
        ConfigError: what ``load_local`` raises, a text column the data lacks (names
            ``text_column`` and lists the columns), or fewer than two windows (names ``dataset``).
    """
    import torch

    from fedgrid.simulation.causal_lm import load_tokenizer
    from fedgrid.simulation.shakespeare import CharData

    rows = load_local(path)
    columns = text_columns(text_column)
    if not columns:
        raise ConfigError("text_column", "name the text column (or columns, comma-separated)")
    check_columns(rows, columns, "text_column")
    tok = load_tokenizer(tokenizer) if tokenizer else load_tokenizer("", "bytes")
    values = [rows[c] for c in columns]
    ids: list[int] = []
    row_of: list[int] = []
    for r, parts in enumerate(zip(*values)):
        piece = tok.encode("".join(str(p) for p in parts) + "\n")
        if hasattr(tok, "bos_token_id") and piece and piece[0] == tok.bos_token_id:
            piece = piece[1:]
        ids.extend(piece)
        row_of.extend([r] * len(piece))
    count = max((len(ids) - 1) // context, 0)
    if count < 2:
        raise ConfigError(
            "dataset", f"{path}: the text holds {count} window(s) of {context} tokens; at least 2 needed"
        )
    starts = context * np.arange(count)
    every = min(TEST_EVERY, count)  # a short text still tests on its last window
    test = np.arange(count) % every == every - 1
    window_rows = np.asarray(row_of, dtype=np.int64)[starts]
    size = max(int(getattr(tok, "vocab_size", 256)), len(getattr(tok, "get_vocab", lambda: {})()))
    chars = CharData(
        text=torch.tensor(ids, dtype=torch.int64),
        train_starts=torch.from_numpy(starts[~test]).long(),
        test_starts=torch.from_numpy(starts[test]).long(),
        train_roles=window_rows[~test],
        test_roles=window_rows[test],
        roles=[str(r) for r in range(len(rows))],
        vocab="\0" * size,
        seq_len=context,
    )
    return HFText(chars, window_rows[~test], window_rows[test], rows)


def site_windows(
    data: HFText, part: HFPartition, partitions: int, index: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Site ``index``'s train and test windows of ``data``: those starting in its rows
    (``partition_indices`` of the rows under ``part``)."""
    mine = partition_indices(data.rows, part, partitions, seed)[index]
    return np.flatnonzero(np.isin(data.train_rows, mine)), np.flatnonzero(np.isin(data.test_rows, mine))
