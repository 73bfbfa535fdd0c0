"""Shakespeare next-character prediction with LEAF's natural split: one client per (play, speaking role).

Read straight from ``gutenberg-texts.tar.gz`` (the Project Gutenberg plays and poems as
``*_gut.txt``, latin-1; see the data folder's README), deterministically, with no extraction:

- **Roles.** A line matching ``^[A-Z][A-Za-z]+( [A-Z][A-Za-z]+)?\\.$`` (trailing whitespace
  ignored) names a speaker; the non-blank lines that follow, up to the next such line, are
  that speaker's. Act and scene headings (``ACT II.``, ``Scene 3.``, ``SCENE: Rome.``) and
  cast-list titles (``PERSONS REPRESENTED.``, ``Dramatis Personae``) end the current speech
  and start none (some of them match the speaker pattern); the lines after them, up to the
  next speaker, are dropped, as is text before a file's first speaker line. A
  role is ``"PLAY/ROLE"``: the file name without ``_gut.txt`` and the speaker without its
  dot, both upper-cased (``hamlet_gut.txt`` + ``Ham.`` -> ``"HAMLET/HAM"``), so spellings
  differing only in case are one role. Roles are sorted by that name.
- **Text.** A role's lines, each stripped, are joined with single spaces and runs of spaces
  collapsed to one (LEAF's ``txt_to_data``).
- **Vocabulary.** LEAF's fixed 80 characters (:data:`VOCAB`: newline, space, ``!"&'(),-.``,
  digits, ``:;>?``, A-Z, ``[]``, a-z, ``}``). A character outside it maps to
  :data:`UNKNOWN_INDEX` (79, the ``}`` slot, where LEAF's ``find() == -1`` lands too); ``}``
  itself never occurs in these texts.
- **Examples.** Every window of ``seq_len`` consecutive characters of one role, with the
  character after it as the target (LEAF's task: next character after the last position).
  Windows never cross roles.
- **Train/test.** LEAF's per-role sample split by position: of a role's ``n`` windows the
  first ``int(0.9 * n)`` are training examples; test examples are the windows after them
  that share no character with any training window (a gap of ``seq_len`` windows), so a
  role shorter than about ``10 * seq_len`` characters has training examples only.
- **Dropped roles.** Roles with fewer than :data:`MIN_EXAMPLES` (10) windows, i.e. shorter
  than ``seq_len + 10`` characters.

On the real corpus with ``seq_len=80``: 1,145 roles, 4.34 M characters, 3.82 M training
windows and 0.36 M test windows (from the 671 roles long enough to have any); loading takes
under a second.

Memory: materialising every training window as int64 would take ~2.4 GB, so
:class:`CharData` keeps one int64 character stream and the window start offsets. ``y_*`` and
the per-example role arrays are plain tensors/arrays; ``x_train`` / ``x_test`` gather the
full window matrix on each access (expensive on the real corpus). The normal path is a
subset: :meth:`CharData.windows` (a batch of ``(x, y)``) or :meth:`CharData.dataset` (a lazy
``torch.utils.data.Dataset`` for a ``DataLoader``).
"""

from __future__ import annotations

import functools
import heapq
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset

from fedgrid.errors import ConfigError

__all__ = [
    "NextChars",
    "TARBALL",
    "VOCAB",
    "UNKNOWN_INDEX",
    "MIN_EXAMPLES",
    "TRAIN_FRACTION",
    "CharData",
    "CharWindows",
    "load_shakespeare",
    "parse_roles",
    "encode",
    "partition_natural",
]

#: The file ``load_shakespeare`` reads inside ``data_dir``.
TARBALL = "gutenberg-texts.tar.gz"
#: LEAF's 80-character vocabulary (``ALL_LETTERS`` in LEAF's ``language_utils``).
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
#: Index of characters outside :data:`VOCAB`.
UNKNOWN_INDEX = len(VOCAB) - 1
#: Roles with fewer windows than this are dropped.
MIN_EXAMPLES = 10
#: Share of a role's windows (the first ones) that are training examples.
TRAIN_FRACTION = 0.9

_SPEAKER = re.compile(r"[A-Z][A-Za-z]+( [A-Z][A-Za-z]+)?\.")
# Act and scene headings and cast-list titles: "ACT II.", "Scene 3.", "SCENE: Rome.", "Dramatis Personae"
_HEADING = re.compile(
    r"(?:ACT|Act|SCENE|Scene)(?::|\s+(?:[IVXLC]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH|First|Second|Third|Fourth|Fifth)\b)"
    r"|(?i:dramatis personae|persons represented|persons in the)\b"
)
_SPACES = re.compile(r" {2,}")
_SUFFIX = "_gut.txt"

# latin-1 byte -> vocabulary index
_LUT = np.full(256, UNKNOWN_INDEX, dtype=np.int64)
for _i, _c in enumerate(VOCAB):
    _LUT[ord(_c)] = _i
del _i, _c

Split = Literal["train", "test"]


def encode(text: str) -> torch.Tensor:
    """Vocabulary indices (int64) of ``text``; characters outside :data:`VOCAB` (and beyond
    latin-1) map to :data:`UNKNOWN_INDEX`."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    codes = np.full(len(points), UNKNOWN_INDEX, dtype=np.int64)
    latin1 = points < 256
    codes[latin1] = _LUT[points[latin1]]
    return torch.from_numpy(codes)


def parse_roles(play: str, text: str) -> dict[str, str]:
    """Splits one play's text into ``{"PLAY/ROLE": joined text}`` (see the module docstring).

    Args:
        play: the play's name as it should appear in role names (upper-cased here).
        text: the whole file.

    Returns:
        Every speaker's text, in order of first appearance; roles with no text are absent.
    """
    lines: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        line = line.rstrip()
        if _HEADING.match(line.lstrip()):  # what follows a heading is no one's until the next speaker
            current = None
        elif _SPEAKER.fullmatch(line):
            current = lines.setdefault(f"{play.upper()}/{line[:-1].upper()}", [])
        elif current is not None and line:
            current.append(line.strip())
    return {role: _SPACES.sub(" ", " ".join(parts)) for role, parts in lines.items() if parts}


@functools.lru_cache(maxsize=4)
def _parse_tarball(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    """``(role, text)`` of every role in the tarball, sorted by role; cached per file version."""
    del size, mtime_ns  # part of the cache key only
    roles: dict[str, str] = {}
    with tarfile.open(path, "r:gz") as tar:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and m.name.endswith(_SUFFIX)), key=lambda m: m.name
        )
        for member in members:
            handle = tar.extractfile(member)
            assert handle is not None  # a regular file
            play = Path(member.name).name[: -len(_SUFFIX)]
            roles.update(parse_roles(play, handle.read().decode("latin-1")))
    return tuple(sorted(roles.items()))


@dataclass(frozen=True, eq=False)  # eq on tensors is elementwise: compare fields explicitly
class CharData:
    """Next-character examples of every kept role: window starts into one character stream.

    Example ``i`` of a split is ``text[s : s + seq_len]`` predicting ``text[s + seq_len]``
    with ``s = <split>_starts[i]``. Treat the tensors as read-only.

    Attributes:
        text: 1-D int64 vocabulary indices, the kept roles' texts back to back in ``roles`` order.
        train_starts: int64 ``[N_train]`` start offsets of the training windows, role by role, in text order.
        test_starts: int64 ``[N_test]`` the same for the test windows.
        train_roles: int64 ``[N_train]`` index into ``roles`` of every training example.
        test_roles: int64 ``[N_test]`` the same for the test examples.
        roles: ``"PLAY/ROLE"`` names.
        vocab: the vocabulary; index ``k`` is character ``vocab[k]``.
        seq_len: characters per input window.
    """

    text: torch.Tensor
    train_starts: torch.Tensor
    test_starts: torch.Tensor
    train_roles: np.ndarray
    test_roles: np.ndarray
    roles: list[str]
    vocab: str
    seq_len: int

    @property
    def num_classes(self) -> int:
        """Size of the vocabulary (the model's output classes)."""
        return len(self.vocab)

    def _starts(self, split: Split) -> torch.Tensor:
        if split == "train":
            return self.train_starts
        if split == "test":
            return self.test_starts
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")

    def windows(
        self, split: Split, index: torch.Tensor | np.ndarray | slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``[n, seq_len]`` and targets ``[n]`` (int64) of the chosen examples of ``split``.

        Args:
            split: ``"train"`` or ``"test"``.
            index: example indices (or a slice) into the split; all examples when None.
        """
        starts = self._starts(split)
        if index is not None:
            starts = starts[
                torch.as_tensor(index, dtype=torch.int64) if not isinstance(index, slice) else index
            ]
        # unfold is a view; indexing it copies only the chosen windows
        return self.text.unfold(0, self.seq_len, 1)[starts], self.text[starts + self.seq_len]

    def dataset(self, split: Split, index: torch.Tensor | np.ndarray | None = None) -> CharWindows:
        """A lazy ``Dataset`` of ``(x, y)`` over the chosen examples of ``split`` (all when None)."""
        starts = self._starts(split)
        if index is not None:
            starts = starts[torch.as_tensor(index, dtype=torch.int64)]
        return CharWindows(self.text, starts, self.seq_len)

    @property
    def x_train(self) -> torch.Tensor:
        """All training inputs ``[N_train, seq_len]`` int64, gathered on each access (~2.4 GB
        on the real corpus: prefer :meth:`windows` or :meth:`dataset` on a subset)."""
        return self.windows("train")[0]

    @property
    def y_train(self) -> torch.Tensor:
        """All training targets ``[N_train]`` int64 (the character after each window)."""
        return self.text[self.train_starts + self.seq_len]

    @property
    def x_test(self) -> torch.Tensor:
        """All test inputs ``[N_test, seq_len]`` int64, gathered on each access."""
        return self.windows("test")[0]

    @property
    def y_test(self) -> torch.Tensor:
        """All test targets ``[N_test]`` int64."""
        return self.text[self.test_starts + self.seq_len]


class CharWindows(TorchDataset):
    """``(x, y)`` windows of a character stream, gathered per item: ``x = text[s : s + seq_len]``,
    ``y = text[s + seq_len]`` for ``s = starts[i]``."""

    def __init__(self, text: torch.Tensor, starts: torch.Tensor, seq_len: int) -> None:
        self.text, self.starts, self.seq_len = text, starts, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        return self.text[s : s + self.seq_len], self.text[s + self.seq_len]


class NextChars(CharWindows):
    """``(x, y)`` windows for a model that predicts every next character (a causal
    transformer): ``x = text[s : s + seq_len]``, ``y = text[s + 1 : s + seq_len + 1]`` for
    ``s = starts[i]`` (the last target is ``CharWindows``' one, LEAF's next character)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        return self.text[s : s + self.seq_len], self.text[s + 1 : s + self.seq_len + 1]


def load_shakespeare(data_dir: str | os.PathLike[str], *, seq_len: int = 80) -> CharData:
    """Loads ``data_dir/gutenberg-texts.tar.gz`` as LEAF's Shakespeare (see the module docstring).

    The parse is cached per process (keyed on the file's path, size and modification time).

    Args:
        data_dir: the folder holding the tarball.
        seq_len: characters per input window.

    Returns:
        The examples of every role with at least :data:`MIN_EXAMPLES` windows.

    Raises:
        ConfigError: the tarball is missing (key ``data_dir``) or ``seq_len`` is below 1.
    """
    if seq_len < 1:
        raise ConfigError("seq_len", f"must be at least 1, got {seq_len}")
    path = Path(data_dir) / TARBALL
    if not path.is_file():
        raise ConfigError(
            "data_dir",
            f"{path} not found: expected the Shakespeare Gutenberg tarball {TARBALL} in {data_dir}",
        )
    stat = path.stat()
    parsed = _parse_tarball(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    kept = [(role, text) for role, text in parsed if len(text) - seq_len >= MIN_EXAMPLES]
    train_starts, test_starts, train_roles, test_roles = [], [], [], []
    offset = 0
    for r, (_, text) in enumerate(kept):
        n = len(text) - seq_len  # windows; window j starts at j and predicts text[j + seq_len]
        n_train = int(TRAIN_FRACTION * n)
        train = np.arange(offset, offset + n_train, dtype=np.int64)
        test = np.arange(
            offset + n_train + seq_len, offset + n, dtype=np.int64
        )  # empty when n - n_train <= seq_len
        train_starts.append(train)
        test_starts.append(test)
        train_roles.append(np.full(len(train), r, dtype=np.int64))
        test_roles.append(np.full(len(test), r, dtype=np.int64))
        offset += len(text)

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    return CharData(
        text=encode("".join(text for _, text in kept)),
        train_starts=torch.from_numpy(cat(train_starts)),
        test_starts=torch.from_numpy(cat(test_starts)),
        train_roles=cat(train_roles),
        test_roles=cat(test_roles),
        roles=[role for role, _ in kept],
        vocab=VOCAB,
        seq_len=seq_len,
    )


def partition_natural(roles: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Deals whole roles to ``num_clients`` clients, balancing example counts.

    Roles are taken largest first (ties: lower role index first) and each goes to the client
    holding the fewest examples so far (ties: lower client index). Clients are then ordered
    by the smallest role they hold, so with one client per role client ``k`` holds the
    ``k``-th role present in ``roles`` (ascending). Deterministic: no seed.

    Args:
        roles: the role index of every example (e.g. ``CharData.train_roles``).
        num_clients: clients, at least 1 and at most the number of distinct roles.

    Returns:
        One sorted int64 array of example indices per client; every example appears exactly once.

    Raises:
        ConfigError: ``num_clients`` is below 1 or above the number of distinct roles (key ``clients``).
    """
    roles = np.asarray(roles)
    present, counts = np.unique(roles, return_counts=True)
    if num_clients < 1:
        raise ConfigError("clients", f"must be at least 1, got {num_clients}")
    if num_clients > len(present):
        raise ConfigError(
            "clients",
            f"{num_clients} clients but only {len(present)} roles to deal: each client needs a whole role",
        )
    heap = [(0, c) for c in range(num_clients)]  # (examples held, client)
    held: list[list[int]] = [[] for _ in range(num_clients)]
    for k in sorted(range(len(present)), key=lambda k: (-counts[k], present[k])):
        load, client = heapq.heappop(heap)
        held[client].append(int(present[k]))
        heapq.heappush(heap, (load + int(counts[k]), client))
    order = np.argsort(roles, kind="stable")  # example indices grouped by role, ascending within
    bounds = np.searchsorted(roles[order], present)
    ends = np.concatenate((bounds[1:], np.array([len(order)], dtype=bounds.dtype)))
    where = {int(role): (int(b), int(e)) for role, b, e in zip(present, bounds, ends)}
    parts = []
    for client_roles in sorted(held, key=min):
        idx = np.concatenate([order[where[r][0] : where[r][1]] for r in client_roles])
        parts.append(np.sort(idx).astype(np.int64))
    return parts
