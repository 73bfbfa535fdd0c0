"""Progress inside a task (issue 40, item 4): a client logs its steps, examples (tokens) per
second and time left at most every 10 s of its clock, its heartbeats carry the figures, and a
local run's progress bar hears them. The tests drive a ``ManualClock``; none sleeps."""

from __future__ import annotations

import io
import logging
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.cli import build_parser
from fedgrid.cli.simulate import SimulateProgress
from fedgrid.cli.support import CLIENT_CONFIG_KEYS, config_from
from fedgrid.client.progress import LOG_EVERY_S, ProgressBoard, ProgressReport, TaskProgress, listen
from fedgrid.client.torch_client import TorchClient
from fedgrid.clock import ManualClock
from fedgrid.types import FitIns

LOGGER = "fedgrid.client.progress"


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_task_logs_at_most_every_10_s_of_its_clock_with_rates_and_time_left(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock, board = ManualClock(), ProgressBoard()
    progress = TaskProgress(round=3, steps_total=100, board=board, clock=clock)
    for _ in range(39):  # 39 steps of 32 examples, 64 tokens each, 0.25 s apart: 9.75 s
        clock.advance(0.25)
        progress.step(32, 64)
    assert _lines(caplog) == []  # under 10 s: nothing logged yet
    clock.advance(0.25)
    progress.step(32, 64)  # step 40 at 10 s: 128 examples/s, 60 steps left at 0.25 s each
    assert _lines(caplog) == ["round 3: step 40/100, 128.0 examples/s, 256 tokens/s, 0:00:15 left"]
    assert board.latest == ProgressReport(3, 40, 100, 128.0, 256.0, 15.0)
    for _ in range(39):
        clock.advance(0.25)
        progress.step(32, 64)
    assert len(_lines(caplog)) == 1  # the next one only 10 s after the last
    clock.advance(0.25)
    progress.step(32, 64)
    assert _lines(caplog)[1] == "round 3: step 80/100, 128.0 examples/s, 256 tokens/s, 0:00:05 left"
    progress.close()
    assert board.latest is None  # between tasks the heartbeats carry none


def test_a_task_bounded_in_time_counts_down_its_seconds_and_an_unknown_length_says_so(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = ManualClock()
    timed = TaskProgress(round=1, steps_total=0, time_s=60.0, clock=clock)
    unknown = TaskProgress(round=1, steps_total=0, clock=clock)
    clock.advance(LOG_EVERY_S)
    timed.step(8)
    unknown.step(8)
    assert _lines(caplog) == [
        "round 1: step 1, 0.8 examples/s, 0:00:50 left",
        "round 1: step 1, 0.8 examples/s, ? left",
    ]


class _Ticking:
    """A loader over ``data`` that moves ``clock`` ``seconds`` ahead at each batch (a step's time)."""

    def __init__(self, data: DataLoader, clock: ManualClock, seconds: float) -> None:
        self.data, self.clock, self.seconds = data, clock, seconds

    def __iter__(self):
        for batch in self.data:
            self.clock.advance(self.seconds)
            yield batch

    def __len__(self) -> int:
        return len(self.data)


def _client(clock: ManualClock) -> TorchClient:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    loader = _Ticking(DataLoader(data, batch_size=8), clock, seconds=1.5)  # 8 batches an epoch
    client = TorchClient(
        nn.Linear(4, 2),
        loader,
        nn.functional.cross_entropy,
        lambda p: torch.optim.SGD(p, lr=0.1),
        name="ticking",
    )
    client.progress_clock = clock
    return client


def test_a_torch_clients_fit_logs_its_progress_and_leaves_none_behind(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = ManualClock()
    client = _client(clock)
    seen: list[ProgressReport] = []
    listen(seen.append)
    try:
        state = OrderedDict((k, v.detach().clone()) for k, v in client.model.state_dict().items())
        client.fit(state, FitIns(round=2, config={"local_epochs": 3}))
    finally:
        listen(None)
    # 24 steps of 8 examples, 1.5 s each: lines at steps 7 (10.5 s), 14 (21 s) and 21 (31.5 s).
    assert _lines(caplog) == [
        "round 2: step 7/24, 5.3 examples/s, 0:00:26 left",
        "round 2: step 14/24, 5.3 examples/s, 0:00:15 left",
        "round 2: step 21/24, 5.3 examples/s, 0:00:04 left",
    ]
    assert [r.steps_done for r in seen] == list(range(1, 25))  # the bar: every step (>= 0.5 s apart)
    assert client.progress.latest is None


def test_quiet_is_a_client_and_simulate_flag():
    args = build_parser("client").parse_args(["client", "--coordinator", "h:1", "--quiet", "true"])
    assert config_from(args, CLIENT_CONFIG_KEYS).quiet is True
    args = build_parser("client").parse_args(["client", "--coordinator", "h:1"])
    assert config_from(args, CLIENT_CONFIG_KEYS).quiet is False


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_simulates_bar_shows_the_training_inside_a_round_on_a_terminal_only(terminal):
    stream = _Terminal() if terminal else io.StringIO()
    bar = SimulateProgress(10, stream)
    bar.task(ProgressReport(4, 30, 120, 250.0, 0.0, 90.0))
    expected = "\rround 4/10 | training: step 30/120, 250.0 examples/s, 0:01:30 left\033[K"
    assert stream.getvalue() == (expected if terminal else "")
