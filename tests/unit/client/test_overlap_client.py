"""Overlapped DiLoCo on the client (``TorchClient`` + ``DiLoCoTraining``): the merge arithmetic,
the steps each fit and lookahead train, what counts toward a task, and bad overlap options
named at the config, the strategy and the task."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedgrid.aggregation import DiLoCo, StreamingDiLoCo
from fedgrid.aggregation.by_name import build_strategy_from
from fedgrid.aggregation.diloco import Overlap
from fedgrid.client.algorithm_math import merge
from fedgrid.client.torch_client import TorchClient
from fedgrid.config import load_config
from fedgrid.errors import ConfigError
from fedgrid.seeding import RNG_LOCK
from fedgrid.types import ClientInfo, FitIns

INFO = ClientInfo(client_id="c0", name="c0")


def _model() -> nn.Module:
    # A lookahead may be drawing from torch's generator in the background: draw under its lock.
    with RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _global(shift: float = 0.0) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict((k, v.detach().clone() + shift) for k, v in _model().state_dict().items())


class _Counting(torch.optim.AdamW):
    """AdamW that logs the thread of each step."""

    def __init__(self, params, log: list[str]) -> None:
        super().__init__(params)
        self.log = log

    def step(self, closure=None):  # type: ignore[override]
        self.log.append(threading.current_thread().name)
        return super().step(closure)


def _client(*, examples: int = 100, log: list[str] | None = None, loss_fn=None) -> TorchClient:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(examples, 4, generator=g), torch.randint(0, 3, (examples,), generator=g))
    return TorchClient(
        _model(),
        DataLoader(data, batch_size=10, shuffle=True),
        loss_fn or nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=0.1),
        inner_optimizer=(lambda params: _Counting(params, log)) if log is not None else None,
        device="cpu",
        seed=3,
        name="w",
    )


def _ins(strategy, server_round: int) -> FitIns:
    return strategy.configure_round(server_round=server_round, clients=[INFO])[0][1]


# -- the merge -----------------------------------------------------------------------------
def test_merge_mixes_floating_tensors_by_alpha_and_takes_the_rest():
    local = OrderedDict(w=torch.tensor([1.0, 3.0]), n=torch.tensor(5), keep=torch.tensor([7.0]))
    glob = OrderedDict(w=torch.tensor([3.0, -1.0]), n=torch.tensor(9), keep=torch.tensor([0.0]))
    names = ["w", "n"]
    zero, half, one = (merge(local, glob, names, a) for a in (0.0, 0.5, 1.0))
    assert torch.equal(zero["w"], glob["w"]) and zero["w"] is glob["w"]  # a replace, bit for bit
    assert torch.equal(half["w"], torch.tensor([2.0, 1.0]))
    assert torch.equal(one["w"], local["w"])
    for out in (zero, half, one):
        assert int(out["n"]) == 9  # not floating: the global value
        assert out["keep"] is local["keep"]  # not merged
    assert torch.equal(local["w"], torch.tensor([1.0, 3.0]))  # the replica itself is unchanged
    with pytest.raises(ValueError, match=r"merge alpha must be in \[0, 1\], got 1.5"):
        merge(local, glob, names, 1.5)


# -- steps, examples, loss -----------------------------------------------------------------
def test_fit_trains_h_then_h_minus_tau_after_a_lookahead_in_the_background():
    log: list[str] = []
    strategy = DiLoCo(inner_steps=5, sync_delay_steps=2)
    strategy.initialize(initial_state=_global())
    ins1 = _ins(strategy, 1)
    assert ins1.config["sync_delay_steps"] == 2 and ins1.config["merge_alpha"] == 0.5  # the paper's default
    client = _client(log=log)
    out1 = client.fit(_global(), ins1)
    client.wait_lookahead()
    main = threading.current_thread().name
    assert log[:5] == [main] * 5  # H steps in the fit
    assert log[5:] == ["fedgrid-lookahead-w"] * 2  # tau after it, in the background
    assert out1.num_examples == 50
    window = client.timeline.split(0.0, float("inf"))
    assert window.compute_s > 0  # the lookahead's compute is on the timeline

    log.clear()
    out2 = client.fit(_global(0.01), _ins(strategy, 2))
    client.wait_lookahead()
    assert log == [main] * 3 + ["fedgrid-lookahead-w"] * 2  # H - tau, then tau again
    assert out2.num_examples == 50  # 3 batches in the fit + 2 in the lookahead, of 10
    steps = {int(s["step"]) for s in client.inner_optimizer.state.values()}
    assert steps == {12}  # one persistent optimizer: 5 + 2 + 3 + 2


def test_tau_equal_to_h_merges_and_uploads_at_once():
    log: list[str] = []
    strategy = StreamingDiLoCo(num_fragments=2, inner_steps=3, sync_delay_steps=3)
    strategy.initialize(initial_state=_global())
    client = _client(log=log)
    client.fit(_global(), _ins(strategy, 1))
    client.wait_lookahead()
    log.clear()
    out = client.fit(_global(), _ins(strategy, 2))
    assert log.count(threading.current_thread().name) == 0  # all H steps were the lookahead's
    assert out.num_examples == 30 and out.metrics["loss"] > 0


def test_merge_point_is_the_lookahead_end_state():
    """alpha = 1 keeps the local value: the next fit trains on from the lookahead's state,
    whatever the download holds; alpha = 0 takes the download as it is."""
    strategy = DiLoCo(inner_steps=4, sync_delay_steps=2, merge_alpha=1.0)
    strategy.initialize(initial_state=_global())
    a, b = _client(), _client()
    a.fit(_global(), _ins(strategy, 1))
    b.fit(_global(), _ins(strategy, 1))
    a.wait_lookahead()
    replica = a.algorithm("diloco").replica
    assert replica is not None
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(replica[name], tensor)  # the state the lookahead reached
    out_a = a.fit(_global(1.0), _ins(strategy, 2))
    out_b = b.fit(_global(-1.0), _ins(strategy, 2))
    for name in out_a.state:
        assert torch.equal(out_a.state[name], out_b.state[name]), name

    replace = DiLoCo(inner_steps=4, sync_delay_steps=2, merge_alpha=0.0)
    replace.initialize(initial_state=_global())
    c, d = _client(), _client()
    c.fit(_global(), _ins(replace, 1))
    c.wait_lookahead()
    d.algorithm("diloco").resume(state=_global(5.0))  # another replica, as if another lookahead
    d.load_state_dict({**d.state_dict(), "lookahead": c.state_dict()["lookahead"]})
    d.inner_optimizer.load_state_dict(copy.deepcopy(c.inner_optimizer.state_dict()))
    out_c, out_d = c.fit(_global(1.0), _ins(replace, 2)), d.fit(_global(1.0), _ins(replace, 2))
    for name in out_c.state:
        assert torch.equal(out_c.state[name], out_d.state[name]), name


def test_synchronous_diloco_tasks_are_unchanged():
    strategy = DiLoCo(inner_steps=3)
    strategy.initialize(initial_state=_global())
    ins = _ins(strategy, 1)
    assert not {"sync_delay_steps", "merge_alpha", "inner_time_s"} & set(ins.config)
    client = _client()
    client.fit(_global(), ins)
    assert client.algorithm("diloco").replica is None and client.state_dict()["lookahead"] is None


def test_evaluate_and_a_saved_state_keep_the_lookahead():
    strategy = StreamingDiLoCo(num_fragments=2, inner_steps=4, sync_delay_steps=2)
    strategy.initialize(initial_state=_global())
    plain, evaluating = _client(), _client()
    evaluating.eval_loader = plain.train_loader
    for c in (plain, evaluating):
        c.fit(_global(), _ins(strategy, 1))
    evaluating.evaluate(_global(3.0), {})  # loads the global model into the one the lookahead trained
    saved = plain.state_dict()  # waits for the lookahead
    assert saved["lookahead"]["steps"] == 2 and saved["lookahead"]["seen"] == 20
    restored = _client()
    restored.load_state_dict(saved)
    download = _global(0.5)
    outs = [c.fit(download, _ins(strategy, 2)) for c in (plain, evaluating, restored)]
    for name in outs[0].state:
        assert torch.equal(outs[1].state[name], outs[0].state[name]), name
        assert torch.equal(outs[2].state[name], outs[0].state[name]), name
    assert outs[2].metrics["loss"] == outs[0].metrics["loss"]


def test_a_failed_lookahead_fails_the_next_fit_and_drops_the_replica():
    calls = {"n": 0}

    def flaky(outputs, targets):
        calls["n"] += 1
        if calls["n"] == 5:  # the first lookahead step
            raise RuntimeError("device lost")
        return nn.functional.cross_entropy(outputs, targets)

    log: list[str] = []
    strategy = StreamingDiLoCo(num_fragments=2, inner_steps=4, sync_delay_steps=2)
    strategy.initialize(initial_state=_global())
    client = _client(loss_fn=flaky, log=log)
    client.fit(_global(), _ins(strategy, 1))
    with pytest.raises(
        RuntimeError,
        match=r"2 inner steps after round 1's upload \(sync_delay_steps\) failed: RuntimeError: device lost",
    ):
        client.fit(_global(), _ins(strategy, 2))
    assert client.algorithm("streaming-diloco").replica is None
    log.clear()
    client.fit(_global(), _ins(strategy, 3))  # the whole model, H steps from it
    assert log.count(threading.current_thread().name) == 4


# -- speed-aware local work ----------------------------------------------------------------
def test_time_budget_trains_at_least_one_step_and_counts_what_it_saw():
    log: list[str] = []
    strategy = DiLoCo(inner_steps=50, inner_time_s=1e-9)
    strategy.initialize(initial_state=_global())
    ins = _ins(strategy, 1)
    assert ins.config["inner_time_s"] == 1e-9
    out = _client(log=log).fit(_global(), ins)
    assert len(log) == 1 and out.num_examples == 10  # one step of 10 examples, not H = 50
    longer = DiLoCo(inner_steps=50, inner_time_s=0.3)
    longer.initialize(initial_state=_global())
    log.clear()
    out = _client(examples=30, log=log).fit(_global(), _ins(longer, 1))
    assert len(log) > 1 and out.num_examples == min(10 * len(log), 30)


def test_under_a_time_budget_the_lookahead_is_time_and_a_used_up_budget_still_trains_one_step():
    log: list[str] = []
    strategy = DiLoCo(inner_steps=20, sync_delay_steps=3, inner_time_s=1e-6)
    strategy.initialize(initial_state=_global())
    client = _client(log=log)
    client.fit(_global(), _ins(strategy, 1))
    client.wait_lookahead()
    log.clear()
    out = client.fit(_global(), _ins(strategy, 2))
    client.wait_lookahead()
    main = threading.current_thread().name
    # One budgeted step, then tau/H of the budget: one step, not tau = 3 (in steps, a slow
    # worker's lookahead alone outlasts the budget, and every round waits for it).
    assert log == [main] + ["fedgrid-lookahead-w"]
    assert out.num_examples == 20  # the lookahead's batch and the fit's one


def test_a_budgeted_lookahead_takes_tau_over_h_of_the_budget():
    log: list[str] = []
    strategy = DiLoCo(inner_steps=4, sync_delay_steps=2, inner_time_s=0.4)
    strategy.initialize(initial_state=_global())
    client = _client(log=log)
    client.fit(_global(), _ins(strategy, 1))
    client.wait_lookahead()
    ahead = client._lookahead
    assert ahead is not None and ahead.steps == 2
    # Seconds, not steps: its loop ends only once 0.4 * 2 / 4 s have passed (steps of this
    # model take about a millisecond, so far more than tau = 2 of them).
    assert ahead.compute_s >= 0.2 and ahead.seen > 2 * 10
    assert log.count("fedgrid-lookahead-w") == ahead.seen // 10


def test_a_multi_process_trainer_refuses_a_time_budget():
    class Ranked(TorchClient):
        _time_budget_allowed = False

    strategy = DiLoCo(inner_steps=5, inner_time_s=1.0)
    strategy.initialize(initial_state=_global())
    base = _client()
    client = Ranked(
        base.model, base.train_loader, base.loss_fn, base.optimizer_factory, device="cpu", name="r"
    )
    with pytest.raises(ValueError, match="cannot take inner_time_s=1.0"):
        client.fit(_global(), _ins(strategy, 1))


# -- bad input, named ----------------------------------------------------------------------
BAD = [
    ({"inner_steps": 5, "sync_delay_steps": 6}, "sync_delay_steps", r"in 0..inner_steps \(5\)"),
    ({"sync_delay_steps": -1}, "sync_delay_steps", "got -1"),
    ({"merge_alpha": 1.5}, "merge_alpha", r"must be in \[0, 1\]"),
    ({"merge_alpha": -0.1}, "merge_alpha", r"must be in \[0, 1\]"),
    ({"inner_time_s": -1.0}, "inner_time_s", "at least 0"),
    ({"inner_time_s": float("inf")}, "inner_time_s", "finite"),
]


@pytest.mark.parametrize("options,key,message", BAD)
@pytest.mark.parametrize("strategy", ["diloco", "streaming-diloco"])
def test_bad_overlap_options_are_named_at_config_and_strategy(strategy, options, key, message):
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(overrides={"strategy": strategy, **options})
    assert raised.value.key == key
    with pytest.raises(ConfigError, match=message) as raised:
        build_strategy_from(strategy, **options)
    assert raised.value.key == key


@pytest.mark.parametrize("options,key,message", BAD)
def test_bad_overlap_options_in_a_task_fail_it_before_training(options, key, message):
    log: list[str] = []
    client = _client(log=log)
    config = {"algorithm": "streaming-diloco", "inner_steps": 5, "merge_fragment_prefixes": "0", **options}
    with pytest.raises(ValueError, match=f"'{key}'.*{message}"):
        client.fit(_global(), FitIns(round=1, config=config))
    assert log == []


def test_overlap_defaults():
    assert Overlap.resolve(inner_steps=5) == Overlap(0, 0.0, 0.0)
    assert Overlap.resolve(inner_steps=5, sync_delay_steps=1).merge_alpha == 0.5
    assert Overlap.resolve(inner_steps=5, merge_alpha=0.25).keeps_replica
    assert Overlap.from_task({"sync_delay_steps": 2, "merge_alpha": 0.0}, inner_steps=2) == Overlap(
        2, 0.0, 0.0
    )
