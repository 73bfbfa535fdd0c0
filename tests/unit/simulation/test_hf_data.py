"""``hf:PATH`` data (``fedgrid.simulation.hf_data``): local files and ``save_to_disk`` folders split by
the built-in partitioners; a missing column named with those the data has; a hub name refused with
how to save it locally. Files only, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedgrid.errors import ConfigError
from fedgrid.simulation.datasets import partition
from fedgrid.simulation.hf_data import HFPartition, load_local, load_partition, partition_indices

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _rows(n: int = 60) -> list[dict]:
    return [
        {"text": f"example {i}", "label": ["pos", "neg", "mixed"][i % 3], "user": f"u{i % 4}"}
        for i in range(n)
    ]


@pytest.fixture()
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "reviews.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return path


def test_dirichlet_on_a_label_column_is_the_builtin_split_of_its_codes(jsonl):
    parts = [
        load_partition(f"hf:{jsonl}", "dirichlet:0.5:label=label", partitions=2, index=k, seed=3)
        for k in range(2)
    ]
    codes = np.unique([r["label"] for r in _rows()], return_inverse=True)[1]
    expected = partition(codes, 2, "dirichlet:0.5", 3)
    for k in range(2):
        assert list(parts[k]["text"]) == [f"example {i}" for i in expected[k]]
    assert sorted(list(parts[0]["text"]) + list(parts[1]["text"])) == sorted(r["text"] for r in _rows())


def test_shard_natural_and_iid_cover_every_example_once(jsonl, tmp_path):
    import datasets

    csv = tmp_path / "reviews.csv"
    datasets.Dataset.from_list(_rows()).to_csv(str(csv))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(_rows()).save_to_disk(str(saved))
    for path in (jsonl, csv, saved):
        data = load_local(f"hf:{path}")
        assert len(data) == 60 and set(data.column_names) >= {"text", "label", "user"}
        for spec, kwargs in (("shard:2", {"label_column": "label"}), ("natural:user", {}), ("iid", {})):
            part = HFPartition.parse(spec, **kwargs)
            split = partition_indices(data, part, 2, seed=0)
            assert sorted(np.concatenate(split).tolist()) == list(range(60)), (path, spec)
    natural = partition_indices(load_local(str(jsonl)), HFPartition.parse("natural:user"), 2, seed=0)
    users = [{_rows()[i]["user"] for i in part} for part in natural]
    assert users[0].isdisjoint(users[1]) and len(users[0]) == len(users[1]) == 2  # whole users per site


def test_a_missing_label_column_names_it_and_lists_the_columns(jsonl):
    with pytest.raises(ConfigError) as info:
        load_partition(str(jsonl), "dirichlet:0.5:label=stars", partitions=2, index=0)
    assert "'stars'" in str(info.value) and "text, label, user" in str(info.value)


def test_a_hub_name_says_how_to_save_the_dataset_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_local("hf:imdb")
    text = str(info.value)
    assert "no such local file or folder" in text and "save_to_disk" in text and "load_dataset('imdb'" in text


@pytest.mark.parametrize(
    "spec, message",
    [("dirichlet:0.5", "name the label column"), ("natural", "natural needs the column"), ("shard:label=y", "needs the shards"),
     ("zipf:2", "unknown partitioner"), ("iid:colour=red", "unknown option")],
)  # fmt: skip
def test_bad_partition_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ConfigError, match=message):
        HFPartition.parse(spec)
