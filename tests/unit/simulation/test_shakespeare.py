"""Unit tests of ``fedgrid.simulation.shakespeare`` on a synthetic tarball in the Gutenberg layout."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fedgrid.errors import ConfigError
from fedgrid.simulation.shakespeare import (
    MIN_EXAMPLES,
    UNKNOWN_INDEX,
    VOCAB,
    encode,
    load_shakespeare,
    parse_roles,
    partition_natural,
)

SEQ = 8  # short windows keep the synthetic roles small

# Speech texts, each long enough (or not) for the role it belongs to.
HAM_1 = "To be, or not to be, that is the question:"
HAM_2 = "Whether 'tis nobler in the mind to suffer"
HOR_1 = "Hail to your lordship!"
GHO_1 = "Adieu!"  # 6 characters: fewer than SEQ + MIN_EXAMPLES, dropped

HAMLET = f"""HAMLET, PRINCE OF DENMARK

by William Shakespeare

PERSONS REPRESENTED.

Claudius, King of Denmark.
Players.

ACT I.

Scene I. Elsinore.

Ham.
{HAM_1}
    {HAM_2}

Hor.
{HOR_1}

Ghost.
{GHO_1}

ACT II.

[Enter the King.]
"""

# A two-word speaker, case variants of one speaker, a character outside the vocabulary,
# and runs of spaces to collapse.
FIRST_1 = "Now,   fair Hippolyta, our nuptial hour  draws on apace;"
FIRST_2 = "Four happy days bring in another moon: {but} O, methinks"
PUCK_1 = "How now, spirit! whither wander you? Over hill, over dale."
DREAM = f"""A MIDSUMMER NIGHT'S DREAM

First Fairy.
{FIRST_1}

Puck.
{PUCK_1}

FIRST FAIRY.
{FIRST_2}
"""

ROLES = ["HAMLET/HAM", "HAMLET/HOR", "MIDSUMMER/FIRST FAIRY", "MIDSUMMER/PUCK"]
TEXTS = {
    "HAMLET/HAM": f"{HAM_1} {HAM_2}",
    "HAMLET/HOR": HOR_1,
    "MIDSUMMER/FIRST FAIRY": " ".join(f"{FIRST_1} {FIRST_2}".split()),
    "MIDSUMMER/PUCK": PUCK_1,
}


def _write_tar(folder: Path, files: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "gutenberg-texts.tar.gz", "w:gz") as tar:
        for name, text in files.items():
            raw = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return folder


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    # members out of order: the loader sorts them
    return _write_tar(
        tmp_path / "shakespeare",
        {
            "midsummer_gut.txt": DREAM,
            "hamlet_gut.txt": HAMLET,
            "COPYING.txt": "Ham.\nnot a play\n",
        },
    )


def _decode(codes: torch.Tensor) -> str:
    return "".join(VOCAB[int(c)] for c in codes)


def _seen(text: str) -> str:
    """``text`` as the model sees it: characters outside the vocabulary become its last one."""
    return "".join(c if c in VOCAB else VOCAB[UNKNOWN_INDEX] for c in text)


def _expected_split(n: int) -> tuple[list[int], list[int]]:
    n_train = int(0.9 * n)
    return list(range(n_train)), list(range(n_train + SEQ, n))


# -- vocabulary ----------------------------------------------------------------------------
def test_vocab_is_leafs_80_characters():
    assert len(VOCAB) == 80 == len(set(VOCAB))
    assert VOCAB.index("\n") == 0 and VOCAB.index(" ") == 1 and VOCAB.index("a") == 53
    assert UNKNOWN_INDEX == 79 and VOCAB[UNKNOWN_INDEX] == "}"


def test_encode_maps_known_and_unknown_characters():
    codes = encode("Ab 9{é€")
    assert codes.dtype == torch.int64
    assert codes.tolist() == [VOCAB.index("A"), VOCAB.index("b"), 1, VOCAB.index("9"), 79, 79, 79]


# -- role split ----------------------------------------------------------------------------
def test_parse_roles_assigns_text_to_speakers():
    roles = parse_roles("hamlet", HAMLET)
    # "PERSONS REPRESENTED.", "ACT I." and "ACT II." are headings; "Players." (in the cast list)
    # names a speaker, but the heading after it ends its speech before any text
    assert roles == {"HAMLET/HAM": TEXTS["HAMLET/HAM"], "HAMLET/HOR": HOR_1, "HAMLET/GHOST": GHO_1}


def test_parse_roles_merges_case_variants_and_collapses_spaces():
    roles = parse_roles("midsummer", DREAM)
    assert roles == {"MIDSUMMER/FIRST FAIRY": TEXTS["MIDSUMMER/FIRST FAIRY"], "MIDSUMMER/PUCK": PUCK_1}
    assert "  " not in roles["MIDSUMMER/FIRST FAIRY"]


def test_load_roles_text_and_dropped_short_roles(data_dir):
    data = load_shakespeare(data_dir, seq_len=SEQ)
    assert data.roles == ROLES  # sorted; the ghost's 6 characters are too few; COPYING.txt ignored
    assert data.vocab == VOCAB and data.num_classes == 80 and data.seq_len == SEQ
    expected = "".join(TEXTS[r] for r in ROLES)
    assert data.text.dtype == torch.int64
    assert torch.equal(data.text, encode(expected))
    assert _decode(data.text[:20]) == expected[:20]


def test_min_examples_threshold(tmp_path):
    just = "a" * (SEQ + MIN_EXAMPLES)
    short = "b" * (SEQ + MIN_EXAMPLES - 1)
    folder = _write_tar(tmp_path / "d", {"p_gut.txt": f"Kept.\n{just}\n\nGone.\n{short}\n"})
    data = load_shakespeare(folder, seq_len=SEQ)
    assert data.roles == ["P/KEPT"]
    assert len(data.train_starts) + len(data.test_starts) <= MIN_EXAMPLES
    assert len(data.train_starts) == int(0.9 * MIN_EXAMPLES)


# -- windows, targets, split ---------------------------------------------------------------
def test_windows_targets_and_train_test_split_exactly(data_dir):
    data = load_shakespeare(data_dir, seq_len=SEQ)
    want_x: dict[str, list[str]] = {"train": [], "test": []}
    want_y: dict[str, list[str]] = {"train": [], "test": []}
    want_roles: dict[str, list[int]] = {"train": [], "test": []}
    for r, role in enumerate(ROLES):
        text = TEXTS[role]
        train, test = _expected_split(len(text) - SEQ)
        for split, starts in (("train", train), ("test", test)):
            want_x[split] += [_seen(text[s : s + SEQ]) for s in starts]
            want_y[split] += [_seen(text[s + SEQ]) for s in starts]
            want_roles[split] += [r] * len(starts)
    assert want_x["test"], "the synthetic data must exercise the test split"
    for split, x, y, roles in (
        ("train", data.x_train, data.y_train, data.train_roles),
        ("test", data.x_test, data.y_test, data.test_roles),
    ):
        assert x.dtype == y.dtype == torch.int64 and roles.dtype == np.int64
        assert x.shape == (len(want_x[split]), SEQ) and y.shape == (len(want_y[split]),)
        assert [_decode(row) for row in x] == want_x[split]
        assert _decode(y) == "".join(want_y[split])
        assert roles.tolist() == want_roles[split]


def test_test_windows_share_no_character_with_train_windows(data_dir):
    data = load_shakespeare(data_dir, seq_len=SEQ)
    for r in range(len(data.roles)):
        train = data.train_starts[torch.from_numpy(data.train_roles == r)]
        test = data.test_starts[torch.from_numpy(data.test_roles == r)]
        if len(test):
            assert int(test.min()) > int(train.max()) + SEQ  # last train target < first test input


def test_windows_and_dataset_gather_subsets(data_dir):
    data = load_shakespeare(data_dir, seq_len=SEQ)
    idx = np.array([5, 0, len(data.train_starts) - 1])
    x, y = data.windows("train", idx)
    assert torch.equal(x, data.x_train[idx]) and torch.equal(y, data.y_train[idx])
    x, y = data.windows("test", slice(1, 3))
    assert torch.equal(x, data.x_test[1:3]) and torch.equal(y, data.y_test[1:3])
    ds = data.dataset("train", idx)
    assert len(ds) == 3
    for k, i in enumerate(idx):
        xi, yi = ds[k]
        assert torch.equal(xi, data.x_train[i]) and int(yi) == int(data.y_train[i])
    batch_x, batch_y = next(iter(torch.utils.data.DataLoader(data.dataset("test"), batch_size=4)))
    assert torch.equal(batch_x, data.x_test[:4]) and torch.equal(batch_y, data.y_test[:4])
    with pytest.raises(ValueError, match="split"):
        data.windows("valid")  # type: ignore[arg-type]


def test_seq_len_changes_windows(data_dir):
    data = load_shakespeare(data_dir, seq_len=20)
    assert data.x_train.shape[1] == 20
    role = data.roles[0]
    assert _decode(data.x_train[0]) == TEXTS[role][:20] and VOCAB[int(data.y_train[0])] == TEXTS[role][20]


# -- errors, caching -----------------------------------------------------------------------
def test_missing_tarball_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="gutenberg-texts.tar.gz") as info:
        load_shakespeare(tmp_path / "nowhere")
    assert info.value.key == "data_dir"
    with pytest.raises(ConfigError):
        load_shakespeare(tmp_path, seq_len=0)


def test_reload_is_identical_and_sees_a_changed_file(data_dir):
    a, b = load_shakespeare(data_dir, seq_len=SEQ), load_shakespeare(data_dir, seq_len=SEQ)
    assert torch.equal(a.text, b.text) and torch.equal(a.train_starts, b.train_starts)
    assert a.text is not b.text  # each call owns its tensors
    _write_tar(data_dir, {"solo_gut.txt": f"Solo.\n{HAM_1}\n"})
    assert load_shakespeare(data_dir, seq_len=SEQ).roles == ["SOLO/SOLO"]


# -- partition_natural ---------------------------------------------------------------------
ROLE_OF = np.array([2, 0, 0, 1, 2, 2, 3, 0, 2, 4, 4, 2, 1], dtype=np.int64)  # counts: 3, 2, 5, 1, 2


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))
    for p in parts:
        assert p.dtype == np.int64 and np.array_equal(p, np.sort(p))


def test_partition_one_role_per_client():
    parts = partition_natural(ROLE_OF, 5)
    _assert_exact_cover(parts, len(ROLE_OF))
    for k, p in enumerate(parts):
        assert p.tolist() == np.flatnonzero(ROLE_OF == k).tolist()


def test_partition_fewer_clients_deals_whole_roles_balanced():
    parts = partition_natural(ROLE_OF, 2)
    _assert_exact_cover(parts, len(ROLE_OF))
    # largest first onto the least loaded: 2(5)->A, 0(3)->B, 1(2)->B, 4(2)->A, 3(1)->B
    assert [sorted(set(ROLE_OF[p].tolist())) for p in parts] == [[0, 1, 3], [2, 4]]
    assert sorted(len(p) for p in parts) == [6, 7]
    for p in parts:  # whole roles only
        for r in set(ROLE_OF[p].tolist()):
            assert set(np.flatnonzero(ROLE_OF == r)) <= set(p.tolist())


def test_partition_is_deterministic_and_covers_real_shapes(data_dir):
    data = load_shakespeare(data_dir, seq_len=SEQ)
    for clients in (1, 2, 3, len(data.roles)):
        a, b = partition_natural(data.train_roles, clients), partition_natural(data.train_roles, clients)
        assert len(a) == clients
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        _assert_exact_cover(a, len(data.train_roles))


def test_partition_balances_many_roles():
    rng = np.random.default_rng(0)
    roles = np.repeat(np.arange(200), rng.integers(1, 500, size=200))
    parts = partition_natural(rng.permutation(roles), 8)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 499  # greedy bound: at most the largest role apart
    assert max(sizes) / min(sizes) < 1.05


def test_partition_rejects_bad_client_counts():
    with pytest.raises(ConfigError, match="only 5 roles") as info:
        partition_natural(ROLE_OF, 6)
    assert info.value.key == "clients"
    with pytest.raises(ConfigError):
        partition_natural(ROLE_OF, 0)
