"""Unit tests of ``fedgrid simulate``'s progress line and of the client options the CLI builds."""

from __future__ import annotations

import io

import pytest

from fedgrid.cli import SimulateProgress, build_parser
from fedgrid.cli.client import client_options as _client_options
from fedgrid.errors import ConfigError
from fedgrid.simulation.tasks import ClientOptions
from fedgrid.types import RoundMetrics


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _round(
    r: int, wall_s: float, accuracy: float | None = 0.5, loss: float | None = 1.25, ok: int = 10
) -> RoundMetrics:
    return RoundMetrics(
        round=r,
        loss=loss,
        accuracy=accuracy,
        bytes_up=0,
        bytes_down=0,
        wall_s=wall_s,
        clients_ok=ok,
        clients_failed=0,
    )


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    progress = SimulateProgress(5, stream)
    progress.update(_round(1, 2.0))
    progress.update(_round(2, 4.0, accuracy=0.8125, loss=0.5))
    progress.close()
    assert stream.getvalue().splitlines() == [
        "round 1/5 | 5.0 clients/s | accuracy 0.5000 | loss 1.2500 | ETA 0:00:08",  # 4 rounds left x 2 s
        "round 2/5 | 2.5 clients/s | accuracy 0.8125 | loss 0.5000 | ETA 0:00:09",  # 3 left x mean 3 s
    ]
    assert "\r" not in stream.getvalue()


def test_one_updating_line_on_a_terminal():
    stream = _Terminal()
    progress = SimulateProgress(3, stream)
    progress.update(_round(1, 1.0, accuracy=None, loss=None))
    assert stream.getvalue() == "\rround 1/3 | 10.0 clients/s | accuracy - | loss - | ETA 0:00:02\033[K"
    progress.clear()  # before other output
    progress.update(_round(3, 3600.0))
    progress.close()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("ETA 0:00:00\033[K\n")
    assert "\r\033[K\rround 3/3 | 0.0 clients/s" in text


def test_long_eta_in_hours():
    line = SimulateProgress.line(_round(1, 10.0), 1000, 999 * 10.0)
    assert line.endswith("ETA 2:46:30")


def test_client_flags_become_builtin_options():
    args = build_parser().parse_args(
        [
            "client",
            "--coordinator",
            "h:1",
            "--dataset",
            "synthetic",
            "--batch-size",
            "8",
            "--optimizer",
            "adamw",
            "--data-partition",
            "iid",
            "--lr",
            "0.3",
        ]
    )
    assert _client_options(args) == {
        "options": ClientOptions(
            dataset="synthetic",
            data_dir="",
            partitioner="iid",
            model="",
            batch_size=8,
            optimizer="adamw",
            lr=0.3,
            momentum=0.9,
            weight_decay=0.0,
            precision="fp32",
            peft="",
            peft_rank="",
            lora_aggregation=None,
            grad_accum=1,
            grad_checkpointing=False,
        )
    }
    # a user's --app gets only what was given, typed
    args = build_parser().parse_args(["client", "--coordinator", "h:1", "--app", "m:f", "--batch-size", "8"])
    assert _client_options(args) == {"batch_size": 8}
    args = build_parser().parse_args(["client", "--coordinator", "h:1", "--app", "m:f"])
    assert _client_options(args) == {}


def test_bad_client_flag_names_the_key():
    args = build_parser().parse_args(["client", "--coordinator", "h:1", "--optimizer", "rmsprop"])
    with pytest.raises(ConfigError) as info:
        _client_options(args)
    assert info.value.key == "optimizer"


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--model", "gpt:heads=3,dim=64"], "model"),
        (["--model", "gpt:layers=0"], "model"),
        (["--model", "hf:/no/such/folder"], "model"),
        (["--precision", "fp16"], "precision"),
    ],
)
def test_bad_language_model_flags_name_the_key(tmp_path, flags, key):
    base = ["client", "--coordinator", "h:1", "--dataset", "shakespeare", "--data-dir", str(tmp_path)]
    with pytest.raises(ConfigError) as info:
        _client_options(build_parser().parse_args([*base, *flags]))
    assert info.value.key == key


@pytest.mark.parametrize("command", ["simulate", "coordinator"])
def test_help_renders_every_key_with_the_strategy_defaults(command, capsys):
    """argparse %-formats help text: a stray '%' in a key's help breaks --help for everyone."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--inner-lr FLOAT diloco, streaming-diloco: learning rate of the inner optimizer, AdamW (default 1e-3"
        in out
    )
    assert (
        "every client trains block (round - 1) mod B" in out
        and "the median norm of the round's updates" in out
    )
