"""``fedgrid launch`` topologies of a ``--peft`` run: each region is given the model keys of
``[global]`` (it hashes the frozen base that it shows upstream and requires of its clients), and
``[clients] peft_rank`` gives each client its own LoRA rank."""

from __future__ import annotations

from fedgrid.ops.topology import Identity, client_argv, load_topology, region_argv

TOPOLOGY = """
[global]
dataset = "shakespeare"
model = "hf:/models/tiny"
peft = "lora:r=8,alpha=16,targets=q_proj,v_proj"
lora_aggregation = "svd"

[clients]
peft_rank = "4,8"

[[regions]]
name = "eu"
clients = 2
"""


def _argv(tmp_path, text: str) -> tuple[list[str], list[str]]:
    path = tmp_path / "topology.toml"
    path.write_text(text)
    top = load_topology(path)
    tls = Identity("ca.pem", "cert.pem", "key.pem")
    region = region_argv(
        top,
        top.regions[0],
        upstream="h:1",
        listen="127.0.0.1:0",
        out="o",
        state_dir="s",
        tls=tls,
        upstream_tls=tls,
    )
    return region, client_argv(top, 1, coordinator="h:2", state_dir="c", tls=tls)


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_a_peft_runs_regions_take_the_model_keys_and_clients_their_ranks(tmp_path):
    region, client = _argv(tmp_path, TOPOLOGY)
    assert _value(region, "--model") == "hf:/models/tiny" and _value(region, "--peft").startswith("lora:r=8")
    assert _value(region, "--dataset") == "shakespeare" and region.count("--lora-aggregation") == 1
    assert _value(client, "--peft-rank") == "4,8" and _value(client, "--model") == "hf:/models/tiny"


def test_a_run_without_adapters_gives_its_regions_no_model(tmp_path):
    region, _ = _argv(
        tmp_path,
        TOPOLOGY.replace("peft =", "# peft =").replace("lora_agg", "# lora_agg").replace("peft_rank", "# p"),
    )
    assert "--model" not in region and "--peft" not in region


def test_hf_data_reaches_the_clients_with_its_columns_and_partition(tmp_path):
    text = (
        TOPOLOGY.replace('dataset = "shakespeare"', 'dataset = "hf:data/mine.jsonl"')
        .replace("peft =", "# peft =")
        .replace("lora_agg", "# lora_agg")
        .replace(
            'peft_rank = "4,8"',
            'text_column = "prompt,completion"\nlabel_column = "topic"\npartition = "shard:2"',
        )
    )
    _, client = _argv(tmp_path, text)
    assert _value(client, "--dataset") == "hf:data/mine.jsonl"
    assert (
        _value(client, "--text-column") == "prompt,completion" and _value(client, "--label-column") == "topic"
    )
    assert _value(client, "--data-partition") == "shard:2" and _value(client, "--partition") == "1/2"
