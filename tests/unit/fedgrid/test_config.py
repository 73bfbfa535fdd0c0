"""Unit tests of ``fedgrid.config``: defaults, TOML files, overrides and validation."""

from __future__ import annotations

import dataclasses

import pytest
import tomllib

from fedgrid.config import Config, config_keys, load_config, parse_flags
from fedgrid.constants import CHUNK_SIZE, HEARTBEAT_INTERVAL_S
from fedgrid.errors import ConfigError, FedgridError


def _write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid():
    config = load_config()
    assert config == Config()
    assert config.rounds == 10 and config.clients == 10 and config.min_clients == 2
    assert config.fraction_fit == 1.0 and config.local_epochs == 2 and config.lr == 0.1
    assert config.seed == 0 and config.dataset == "digits" and config.partition == ""
    assert config.strategy == "fedavg" and config.listen == "127.0.0.1:50051"  # loopback: no flags needed
    assert config.chunk_size == CHUNK_SIZE and config.heartbeat_interval_s == HEARTBEAT_INTERVAL_S
    assert config.out == "" and config.state_dir == ""


def test_simulation_key_defaults():
    config = load_config()
    assert (config.dataset, config.data_dir, config.model, config.partition) == ("digits", "", "", "")
    assert (config.batch_size, config.optimizer, config.momentum, config.weight_decay) == (
        32,
        "sgd",
        0.9,
        0.0,
    )
    assert (config.engine, config.batch_clients, config.progress) == ("auto", 0, True)
    assert (
        config.dropout_prob,
        config.availability_trace,
        config.speed,
        config.examples_per_second,
        config.regions,
    ) == (0.0, "", "1.0", 1000.0, "")


def test_simulation_keys_from_toml(tmp_path):
    path = _write(
        tmp_path,
        'dataset = "synthetic"\npartition = "shards:3"\nmodel = "logistic"\nbatch_size = 8\noptimizer = "adamw"\n'
        'weight_decay = 0.01\nengine = "sequential"\nbatch_clients = 16\nprogress = false\ndropout_prob = 0.1\n'
        'speed = "lognormal:0.5"\nregions = "us:1,eu:1"\nexamples_per_second = 50\n',
    )
    config = load_config(path, overrides=parse_flags({"momentum": "0"}))
    assert (config.dataset, config.partition, config.model, config.batch_size, config.optimizer) == (
        "synthetic",
        "shards:3",
        "logistic",
        8,
        "adamw",
    )
    assert (config.weight_decay, config.engine, config.batch_clients, config.progress, config.momentum) == (
        0.01,
        "sequential",
        16,
        False,
        0.0,
    )
    assert (config.dropout_prob, config.speed, config.regions, config.examples_per_second) == (
        0.1,
        "lognormal:0.5",
        "us:1,eu:1",
        50.0,
    )


def test_every_key_has_help_and_a_supported_type():
    keys = config_keys()
    assert set(keys) == set(Config().to_dict())
    for name, f in keys.items():
        assert f.metadata["help"], name
        assert str(f.type).removesuffix(" | None") in {"int", "float", "str", "bool"}, name
        if str(f.type).endswith("| None"):
            assert f.default is None, name  # optional keys: None means "the strategy's default"


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().rounds = 3  # type: ignore[misc]


def test_toml_file_load(tmp_path):
    path = _write(
        tmp_path,
        'rounds = 3\nclients = 4\nfraction_fit = 0.5\nlr = 1\nseed = 7\npartition = "iid"\n'
        'listen = "127.0.0.1:0"\nout = "runs/x"\nround_timeout_s = 12.5\n',
    )
    config = load_config(path)
    assert config.rounds == 3 and config.clients == 4 and config.seed == 7
    assert config.fraction_fit == 0.5
    assert config.lr == 1.0 and isinstance(config.lr, float)  # TOML int for a float key
    assert config.partition == "iid" and config.listen == "127.0.0.1:0" and config.out == "runs/x"
    assert config.round_timeout_s == 12.5
    assert config.local_epochs == 2  # untouched keys keep defaults


def test_load_config_accepts_str_path(tmp_path):
    assert load_config(str(_write(tmp_path, "rounds = 5\n"))).rounds == 5


def test_overrides_win_over_file(tmp_path):
    path = _write(tmp_path, 'rounds = 3\nlr = 0.5\npartition = "iid"\n')
    config = load_config(path, overrides={"rounds": 8, "partition": "dirichlet:2.0", "lr": None})
    assert config.rounds == 8
    assert config.partition == "dirichlet:2.0"
    assert config.lr == 0.5  # None means "not given on the command line"


def test_flags_text_is_parsed_as_the_keys_types():
    flags = parse_flags({"rounds": "4", "lr": "0.25", "fraction_fit": "1", "out": "d", "insecure": "YES"})
    config = load_config(overrides={**flags, "seed": None})
    assert (config.rounds, config.lr, config.fraction_fit, config.out, config.insecure) == (
        4,
        0.25,
        1.0,
        "d",
        True,
    )
    assert isinstance(config.rounds, int) and isinstance(config.fraction_fit, float)
    with pytest.raises(ConfigError, match=r"config key 'rounds': expected int, got '4.0'$"):
        parse_flags({"rounds": "4.0"})
    with pytest.raises(ConfigError, match=r"config key 'progress': expected bool, got 'maybe'$"):
        parse_flags({"progress": "maybe"})
    with pytest.raises(ConfigError, match=r"config key 'roundz': unknown key \(did you mean 'rounds'\?\)"):
        parse_flags({"roundz": "4"})


@pytest.mark.parametrize(
    "text, words",
    [
        ('rounds = "5"', r"expected int, got a string '5' \(a string: without the quotes, rounds = 5\)$"),
        ("rounds = 5.0", r"expected int, got a float 5.0 \(a whole number, without a decimal point\)$"),
        ("rounds = true", r"expected int, got a boolean True$"),
        ('lr = "0.1"', r"expected float, got a string '0.1'"),
        ('insecure = "true"', r"expected bool, got a string 'true'"),
        ("insecure = 1", r"expected bool, got an integer 1$"),
        ("partition = 5", r"expected str, got an integer 5$"),
        ('rounds = "five"', r"expected int, got a string 'five'$"),
    ],
)
def test_toml_types_are_checked_one_way(tmp_path, text, words):
    """An integer key takes only integers: a quoted number and a float are both refused."""
    key = text.split(" ")[0]
    with pytest.raises(ConfigError, match=rf"config key '{key}': {words}") as info:
        load_config(_write(tmp_path, text + "\n"))
    assert info.value.key == key
    with pytest.raises(ConfigError, match=rf"config key '{key}': expected"):  # Python overrides alike
        load_config(overrides=tomllib.loads(text))


def test_a_float_key_takes_a_toml_integer(tmp_path):
    config = load_config(_write(tmp_path, "lr = 1\nround_timeout_s = 30\n"))
    assert (config.lr, config.round_timeout_s) == (1.0, 30.0) and isinstance(config.lr, float)


def test_unknown_key_in_file_names_key(tmp_path):
    path = _write(tmp_path, "rounds = 3\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match=r"config key 'learning_rate': unknown key in .*run\.toml") as info:
        load_config(path)
    assert info.value.key == "learning_rate"


def test_unknown_key_in_overrides_names_key():
    with pytest.raises(
        ConfigError, match=r"config key 'epochs': unknown key \(did you mean 'local_epochs'\?\)$"
    ) as info:
        load_config(overrides={"epochs": 3})
    assert info.value.key == "epochs"


def test_unknown_key_suggests_the_close_ones_not_the_whole_list(tmp_path):
    path = _write(tmp_path, "roundz = 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config key 'roundz': unknown key in {path} (did you mean 'rounds'?)"
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"xyzzy": 1})
    assert (
        "did you mean" not in str(info.value)
        and "min_clients" not in str(info.value)
        and "--help" in str(info.value)
    )


def test_simulation_only_keys_are_no_coordinator_flags():
    from fedgrid.cli import CLIENT_CONFIG_KEYS, COORDINATOR_KEYS, REGION_KEYS, SIMULATE_KEYS
    from fedgrid.config import CLIENT_ONLY_KEYS, COORDINATOR_ONLY_KEYS, REGION_ONLY_KEYS, SIMULATION_ONLY_KEYS

    assert {"engine", "dropout_prob", "progress", "speed", "clients", "app"} <= SIMULATION_ONLY_KEYS
    assert not SIMULATION_ONLY_KEYS & set(COORDINATOR_KEYS) and not COORDINATOR_ONLY_KEYS & set(SIMULATE_KEYS)
    assert not CLIENT_ONLY_KEYS & (set(COORDINATOR_KEYS) | set(SIMULATE_KEYS)) and CLIENT_ONLY_KEYS <= set(
        CLIENT_CONFIG_KEYS
    )
    assert not REGION_ONLY_KEYS & (set(COORDINATOR_KEYS) | set(SIMULATE_KEYS)) and REGION_ONLY_KEYS <= set(
        REGION_KEYS
    )
    assert set(COORDINATOR_KEYS) | set(SIMULATE_KEYS) | CLIENT_ONLY_KEYS | REGION_ONLY_KEYS == set(
        config_keys()
    )  # every key is someone's flag
    assert {"require_device", "min_accelerators", "min_client_memory"} <= COORDINATOR_ONLY_KEYS


@pytest.mark.parametrize(
    "overrides, key, problem",
    [
        ({"require_device": "GPU"}, "require_device", "'GPU' is not a device type (lowercase letters"),
        ({"report_device": "cuda\x1b[2J"}, "report_device", "'cuda\\x1b[2J' is not a device type"),
        ({"min_accelerators": -1}, "min_accelerators", "must be in 0..1024, got -1"),
        ({"report_accelerators": 2000}, "report_accelerators", "must be in 0..1024, got 2000"),
        (
            {"min_client_memory": "16 gigs"},
            "min_client_memory",
            "'16 gigs' is not a size (e.g. 16GiB, 512MB or a byte count)",
        ),
        ({"report_memory": "2PiB"}, "report_memory", "'2PiB' is over the most a client may report, 1.0 PiB"),
    ],
)
def test_bad_capability_keys_name_the_key(overrides, key, problem):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert info.value.key == key and problem in str(info.value)


def test_capability_keys_from_a_file(tmp_path):
    text = 'require_device = "cuda"\nmin_accelerators = 2\nmin_client_memory = "40GiB"\nreport_memory = "8GB"\nreport_accelerators = 0\n'
    config = load_config(_write(tmp_path, text))
    assert (config.require_device, config.min_accelerators, config.min_client_memory) == ("cuda", 2, "40GiB")
    assert (config.report_device, config.report_accelerators, config.report_memory) == ("", 0, "8GB")


def test_table_in_file_is_unknown_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "[server]\nrounds = 3\n"))
    assert info.value.key == "server"


@pytest.mark.parametrize(
    "key,value",
    [
        ("rounds", '"abc"'),
        ("rounds", "2.5"),
        ("rounds", "true"),
        ("lr", '"fast"'),
        ("lr", "false"),
        ("dataset", "3"),
        ("seed", "[1]"),
    ],
)
def test_wrong_type_in_file_names_key(tmp_path, key, value):
    with pytest.raises(ConfigError, match=rf"config key '{key}': expected") as info:
        load_config(_write(tmp_path, f"{key} = {value}\n"))
    assert info.value.key == key


@pytest.mark.parametrize(
    "key,value", [("rounds", "abc"), ("rounds", 2.5), ("rounds", True), ("lr", "x"), ("out", 3)]
)
def test_wrong_type_in_overrides_names_key(key, value):
    with pytest.raises(ConfigError, match=rf"config key '{key}': expected") as info:
        load_config(overrides={key: value})
    assert info.value.key == key


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.key == "config"
    with pytest.raises(ConfigError, match="is not valid TOML") as info:
        load_config(_write(tmp_path, "rounds = = 3\n"))
    assert info.value.key == "config"


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("rounds", 0, "must be at least 1, got 0"),
        ("clients", -1, "must be at least 1"),
        ("min_clients", 0, "must be at least 1"),
        ("local_epochs", 0, "must be at least 1"),
        ("max_workers", 0, "must be at least 1"),
        ("chunk_size", 0, "must be at least 1"),
        ("chunk_size", 4 * 1024 * 1024, "at most 3 MiB"),
        ("chunk_size", 3 * 1024 * 1024 + 1, "at most 3 MiB"),
        ("fraction_fit", 1.5, r"must be in \(0, 1\], got 1.5"),
        ("fraction_fit", 0.0, r"must be in \(0, 1\]"),
        ("fraction_fit", float("nan"), r"must be in \(0, 1\]"),
        ("lr", -1, "must be positive, got -1"),
        ("lr", 0, "must be positive"),
        ("lr", float("nan"), "must be positive"),
        ("round_timeout_s", 0, "must be positive"),
        ("join_timeout_s", -5, "must be positive"),
        ("heartbeat_interval_s", 0, "must be positive"),
        ("listen", "nope", "expected HOST:PORT, got 'nope'"),
        ("listen", ":50051", "expected HOST:PORT"),
        ("listen", "localhost:", "expected HOST:PORT"),
        ("listen", "localhost:http", "expected HOST:PORT"),
        ("listen", "localhost:70000", "expected HOST:PORT"),
        ("strategy", "fedsgd", "unknown strategy 'fedsgd' \\(known: fedavg, fedavgm"),
        ("aggregator", "mode", "unknown aggregator 'mode'"),
        ("threads", -1, r"must be in 0\.\.1024 \(0: torch's default\), got -1"),
        ("threads", 1025, r"must be in 0\.\.1024"),
    ],
)
def test_out_of_range_names_key(key, value, words):
    with pytest.raises(ConfigError, match=words) as info:
        load_config(overrides={key: value})
    assert info.value.key == key
    assert str(info.value).startswith(f"config key '{key}': ")
    assert isinstance(info.value, FedgridError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:50051", "localhost:65535", "10.1.2.3:8080"])
def test_valid_listen_addresses(listen):
    assert load_config(overrides={"listen": listen}).listen == listen


def test_chunk_size_at_limit_is_valid():
    assert load_config(overrides={"chunk_size": 3 * 1024 * 1024}).chunk_size == 3 * 1024 * 1024


def test_to_dict_roundtrips_through_load_config():
    config = load_config(overrides={"rounds": 3, "lr": 0.01, "partition": "iid", "out": "x"})
    assert load_config(overrides=config.to_dict()) == config


# -- strategy and aggregator options ---------------------------------------------------------
def test_strategy_options_from_toml_and_flags(tmp_path):
    path = _write(
        tmp_path,
        'strategy = "fedadam"\nserver_lr = 0.05\naggregator = "trimmed-mean"\naggregator_beta = 0.2\n',
    )
    config = load_config(path, overrides=parse_flags({"server_beta1": "0.8", "aggregator_weighted": "true"}))
    assert config.strategy_options() == {
        "aggregator": "trimmed-mean",
        "aggregator_beta": 0.2,
        "aggregator_weighted": True,
        "server_lr": 0.05,
        "server_beta1": 0.8,
    }
    assert load_config().strategy_options() == {}  # every option absent: the strategy's defaults
    assert load_config(overrides=config.to_dict()) == config  # None values are left out, as in config.toml


@pytest.mark.parametrize(
    "overrides,key,words",
    [
        ({"server_lr": 0.1}, "server_lr", "does not apply to strategy 'fedavg'"),
        ({"strategy": "bcd", "proximal_mu": 0.1}, "proximal_mu", "does not apply to strategy 'bcd'"),
        ({"strategy": "fedprox", "proximal_mu": -1.0}, "strategy", "proximal_mu must be non-negative"),
        ({"strategy": "bcd", "block_schedule": "zigzag"}, "strategy", "block_schedule must be one of"),
        ({"aggregator": "krum", "aggregator_beta": 0.1}, "aggregator", "krum takes no option 'beta'"),
        ({"strategy": "diloco", "lr": 0.01}, "lr", "does not apply to strategy 'diloco'.*takes inner_lr"),
        (
            {"strategy": "streaming-diloco", "inner_lr": 0.0},
            "strategy",
            "inner_lr must be positive and finite, got 0.0",
        ),
        ({"strategy": "fedavg", "inner_lr": 0.01}, "inner_lr", "does not apply to strategy 'fedavg'"),
        ({"aggregator": "trimmed-mean", "aggregator_beta": 0.7}, "aggregator", r"beta must be in \[0, 0.5\)"),
        ({"inner_steps": "many"}, "inner_steps", "expected int"),
        ({"strategy": "bcd", "block_prefixes": "0;;2"}, "block_prefixes", "empty block"),
    ],
)
def test_bad_strategy_options_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError, match=words) as info:
        load_config(overrides=overrides)
    assert info.value.key == key


def test_precondition_checked_at_configure_time():
    from fedgrid.server.strategies import build_strategy

    config = load_config(overrides={"aggregator": "krum", "aggregator_f": 2})
    build_strategy(config, num_clients=7)  # n = 7 > 2f + 2
    with pytest.raises(ConfigError, match=r"needs more than 2f \+ 2 = 6 updates") as info:
        build_strategy(config, num_clients=6)
    assert info.value.key == "aggregator"


@pytest.mark.parametrize("name", ["fedadam", "scaffold", "streaming-diloco", "bcd"])
def test_every_strategy_gets_options_and_the_selection_policy(name):
    from fedgrid.aggregation import STRATEGIES
    from fedgrid.server.strategies import build_strategy

    lr = (
        {"inner_lr": 0.2} if name == "streaming-diloco" else {"lr": 0.2}
    )  # its inner optimizer's rate, sent as the task's lr
    config = load_config(
        overrides={"strategy": name, "clients_per_round": 4, "over_selection": 0.5, "seed": 3, **lr}
    )
    strategy = build_strategy(config)
    assert type(strategy) is STRATEGIES[name]
    assert strategy.selection.clients_per_round == 4 and strategy.selection.over_selection == 0.5  # type: ignore[attr-defined]
    assert strategy.seed == 3 and strategy._task_config(1)["lr"] == 0.2  # type: ignore[attr-defined]


def test_threads_key_from_toml_and_flags(tmp_path):
    assert load_config().threads == 0  # torch's own default
    path = _write(tmp_path, "threads = 3\n")
    assert load_config(path).threads == 3
    assert load_config(path, parse_flags({"threads": "1"})).threads == 1


def test_environment_table_of_a_run_directory_is_read_back(tmp_path, caplog):
    import torch

    path = _write(
        tmp_path, f'rounds = 4\nthreads = 1\n\n[environment]\ntorch = "{torch.__version__}"\ncpu = "x"\n'
    )
    with caplog.at_level("WARNING"):
        config = load_config(path)
    assert (config.rounds, config.threads) == (4, 1) and not caplog.records
    path = _write(tmp_path, 'rounds = 4\n\n[environment]\ntorch = "1.0.0"\n')
    with caplog.at_level("WARNING"):
        assert load_config(path).rounds == 4
    assert "written by torch 1.0.0" in caplog.text
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, 'environment = "cpu"\n'))
    assert info.value.key == "environment"


_TLS = {"ca": "ca.pem", "cert": "coordinator.pem", "key": "coordinator.key"}


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        ({"enroll_listen": "127.0.0.1:0", **_TLS}, "enroll_dir", "needs enroll_dir"),
        ({"enroll_dir": "pki", **_TLS}, "enroll_dir", "only with enroll_listen"),
        ({"enroll_listen": "127.0.0.1:0", "enroll_dir": "pki"}, "enroll_listen", "needs ca, cert and key"),
        ({"enroll_listen": "nowhere", "enroll_dir": "pki", **_TLS}, "enroll_listen", "expected HOST:PORT"),
    ],
)
def test_enrollment_keys_are_checked_together(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == key and words in str(info.value)


def test_enrollment_keys_are_coordinator_flags_only():
    from fedgrid.cli import COORDINATOR_KEYS, SIMULATE_KEYS

    config = load_config(None, {"enroll_listen": "127.0.0.1:0", "enroll_dir": "pki", **_TLS})
    assert (config.enroll_listen, config.enroll_dir) == ("127.0.0.1:0", "pki")
    assert {"enroll_listen", "enroll_dir"} <= set(COORDINATOR_KEYS)
    assert not {"enroll_listen", "enroll_dir"} & set(SIMULATE_KEYS)
