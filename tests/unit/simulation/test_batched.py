"""The batched engine (``fedgrid.simulation.batched``) against ``TorchClient.fit``, and the fleet around it."""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from datetime import timedelta
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from fedgrid.aggregation.scaffold import CONTROL_PREFIX
from fedgrid.client.api import Client, FitOutput
from fedgrid.client.torch_client import TorchClient
from fedgrid.compression.spec import CodecSpec
from fedgrid.errors import ConfigError
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.simulation.batched import BatchedTrainer, choose_engine
from fedgrid.simulation.batched_optim import NotBatchable, optimizer_spec
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import FitIns, ModelState


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: a second OpenMP thread only adds wake-ups (slow on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SIZES = (30, 5, 17, 8)  # batch 8: one client smaller than a batch, one with a partial last batch
ATOL = 1e-5


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def _clients(
    optimizer: Callable[..., torch.optim.Optimizer] = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    *,
    model: Callable[[], nn.Module] = _mlp,
    sizes: tuple[int, ...] = SIZES,
    shape: tuple[int, ...] = (6,),
    loader: Callable[[TensorDataset], DataLoader] = lambda d: DataLoader(d, batch_size=8, shuffle=True),
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
) -> list[TorchClient]:
    gen = torch.Generator().manual_seed(0)
    clients = []
    for i, n in enumerate(sizes):
        data = TensorDataset(torch.randn(n, *shape, generator=gen), torch.randint(0, 3, (n,), generator=gen))
        torch.manual_seed(1)
        clients.append(
            TorchClient(model(), loader(data), loss, optimizer, device="cpu", seed=i, name=f"c{i}")
        )
    return clients


def _state(clients: list[TorchClient]) -> ModelState:
    return OrderedDict((k, v.detach().clone()) for k, v in clients[0].model.state_dict().items())


def _compare(batched: list, sequential: list[FitOutput]) -> None:
    for got, want in zip(batched, sequential, strict=True):
        assert isinstance(got, FitOutput), got
        assert list(got.state) == list(want.state)
        for name in want.state:
            torch.testing.assert_close(got.state[name], want.state[name], atol=ATOL, rtol=0)
        assert got.num_examples == want.num_examples
        assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], abs=1e-5)


def _both(
    clients: list[TorchClient],
    config: dict,
    *,
    rounds: int = 1,
    state: ModelState | None = None,
    batch_clients: int = 0,
):
    """(batched outcomes, sequential outputs) of the last of ``rounds`` rounds, from twin clients."""
    twins = copy.deepcopy(clients)
    trainer = BatchedTrainer(clients, batch_clients=batch_clients)
    assert trainer.reason is None, trainer.reason
    state = state or _state(clients)
    for r in range(1, rounds + 1):
        ins = FitIns(round=r, config={"seed": 3, **config})
        got = trainer.fit([(i, state, ins) for i in range(len(clients))])
        want = [t.fit(state, ins) for t in twins]
    return got, want, clients, twins


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd-dampening-maximize": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.5, dampening=0.3, maximize=True
    ),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updates_equal_sequential_for_each_optimizer_with_two_epochs(name):
    got, want, _, _ = _both(_clients(OPTIMIZERS[name]), {"local_epochs": 2, "lr": 0.02})
    _compare(got, want)
    assert [o.num_examples for o in got] == list(SIZES)
    assert not torch.equal(
        got[0].state["0.weight"], got[1].state["0.weight"]
    )  # each client trained on its own data


def test_updates_equal_sequential_for_fedprox():
    got, want, _, _ = _both(_clients(), {"algorithm": "fedprox", "proximal_mu": 0.5})
    _compare(got, want)


def test_bcd_trains_and_returns_only_the_block():
    clients = _clients(OPTIMIZERS["adam"])
    state = _state(clients)
    got, want, _, _ = _both(clients, {"algorithm": "bcd", "block_prefixes": "2"}, state=state)
    _compare(got, want)
    assert list(got[0].state) == ["2.weight", "2.bias"]
    assert not torch.equal(got[0].state["2.weight"], state["2.weight"])


def test_scaffold_corrections_and_client_state_match_over_two_rounds():
    clients = _clients()
    model = _state(clients)
    gen = torch.Generator().manual_seed(5)
    download = OrderedDict(model)
    download.update((CONTROL_PREFIX + n, 0.1 * torch.randn(t.shape, generator=gen)) for n, t in model.items())
    got, want, batched, sequential = _both(clients, {"algorithm": "scaffold"}, rounds=2, state=download)
    _compare(got, want)
    for b, s in zip(batched, sequential):
        for name, c in s.algorithm("scaffold").control.c_i.items():
            torch.testing.assert_close(b.algorithm("scaffold").control.c_i[name], c, atol=ATOL, rtol=0)
            assert c.abs().sum() > 0


def test_loader_variants_subset_sequential_sampler_drop_last():
    base = TensorDataset(torch.randn(60, 6), torch.randint(0, 3, (60,)))
    clients = _clients(loader=lambda d: DataLoader(d, batch_size=8, shuffle=False, drop_last=True))
    clients[1].train_loader = DataLoader(Subset(base, list(range(40, 60))), batch_size=8, shuffle=True)
    clients[2].train_loader = DataLoader(
        Subset(Subset(base, list(range(50))), [3, 1, 4, 1, 5, 9, 2, 6, 5]), batch_size=4, shuffle=True
    )
    got, want, _, _ = _both(clients, {"local_epochs": 2})
    _compare(got, want)
    assert [o.num_examples for o in got] == [24, 20, 9, 8]  # drop_last drops client 0's partial batch


def test_chunks_of_k_give_the_same_updates():
    clients = _clients()
    got_all, want, _, _ = _both(clients, {}, batch_clients=0)
    got_two, _, _, _ = _both(_clients(), {}, batch_clients=2)
    _compare(got_all, want)
    _compare(got_two, want)


def test_out_of_memory_halves_k_and_keeps_it_down(monkeypatch, caplog):
    """A chunk larger than the device takes (here: more than 2 clients) trains as halves, batched;
    K stays down for later rounds; nothing falls back to one-by-one ``fit``."""
    clients = _clients(sizes=(30, 5, 17, 8, 12))
    got_want = _both(copy.deepcopy(clients), {}, rounds=1)
    trainer = BatchedTrainer(clients)
    assert trainer.chunk_size() >= 5  # the estimate: all of them at once
    real = BatchedTrainer._train_chunk
    sizes: list[int] = []

    def tight(self, chunk):
        sizes.append(len(chunk))
        if len(chunk) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, chunk)

    monkeypatch.setattr(BatchedTrainer, "_train_chunk", tight)
    monkeypatch.setattr(BatchedTrainer, "_sequential", lambda *a: pytest.fail("a client trained alone"))
    state = _state(clients)
    ins = FitIns(round=1, config={"seed": 3})
    with caplog.at_level(logging.WARNING, logger="fedgrid.simulation.batched"):
        got = trainer.fit([(i, state, ins) for i in range(len(clients))])
    _compare(got, got_want[1])
    assert sizes == [5, 3, 2, 1, 2]  # 5 -> 3 + 2, 3 -> 2 + 1
    assert trainer.chunk_size() == 2 and trainer.clients_per_call == 2
    assert "5 clients at once ran out of memory" in caplog.text and "training 2 at a time" in caplog.text
    sizes.clear()
    trainer.fit([(i, state, ins) for i in range(len(clients))])
    assert max(sizes) == 2  # the next round starts at the K that fit


def test_an_error_that_is_not_memory_trains_the_chunk_one_by_one(monkeypatch):
    clients = _clients(sizes=(10, 6))
    trainer = BatchedTrainer(clients)
    monkeypatch.setattr(
        BatchedTrainer,
        "_train_chunk",
        lambda self, chunk: (_ for _ in ()).throw(RuntimeError("a kernel failed")),
    )
    state = _state(clients)
    got = trainer.fit([(i, state, FitIns(round=1, config={"seed": 3})) for i in range(2)])
    assert [o.num_examples for o in got] == [
        10,
        6,
    ] and trainer.chunk_size() >= 2  # trained by fit; K unchanged


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every call that reads a tensor's value back to the host (a device sync on CUDA)."""

    READS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
    }

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS or (
            func is torch.Tensor.to and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))
        ):
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["sgd-momentum", "adam"])
def test_no_host_reads_in_the_training_steps(monkeypatch, name):
    """The CUDA path by construction: from a chunk's first step to reading its results
    (``_outputs``, once per chunk), no step reads a value back to the host."""
    clients = _clients(OPTIMIZERS[name], sizes=(40, 33, 17, 8))  # up to 5 steps
    trainer = BatchedTrainer(clients)
    mode = _HostReads()
    real_outputs, real_step_fn = BatchedTrainer._outputs, BatchedTrainer._step_fn
    steps = []

    def outputs(self, *args):
        mode.__exit__(None, None, None)
        return real_outputs(self, *args)

    def step_fn(self, *args):
        fn = real_step_fn(self, *args)

        def first_step_enters(*a):
            if not steps:
                mode.__enter__()
            steps.append(1)
            return fn(*a)

        return first_step_enters

    monkeypatch.setattr(BatchedTrainer, "_outputs", outputs)
    state = _state(clients)  # the trial step in the constructor ran with the real step function
    monkeypatch.setattr(BatchedTrainer, "_step_fn", step_fn)
    got = trainer.fit([(i, state, FitIns(round=1, config={"seed": 3, "local_epochs": 2})) for i in range(4)])
    assert [o.num_examples for o in got] == [40, 33, 17, 8]
    assert len(steps) == 10 and mode.reads == []  # 2 epochs of 5 batches


def test_out_of_memory_is_recognised_by_its_message():
    from fedgrid.simulation.batched import out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"
        )
    )
    assert out_of_memory(MemoryError())
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not out_of_memory(ValueError("out of memory"))


def test_errors_and_step_algorithms_go_through_fit(caplog):
    clients = _clients(sizes=(10, 10))
    twins = copy.deepcopy(clients)
    trainer = BatchedTrainer(clients)
    state = _state(clients)
    bad = FitIns(round=1, config={"local_epochs": 0})
    diloco = FitIns(round=1, config={"algorithm": "diloco", "inner_steps": 3, "seed": 1})
    with caplog.at_level(logging.INFO):
        got = trainer.fit([(0, state, bad), (1, state, diloco)])
    assert isinstance(got[0], ValueError) and "local_epochs must be at least 1" in str(got[0])
    _compare([got[1]], [twins[1].fit(state, diloco)])
    assert sum("diloco clients train sequentially" in r.message for r in caplog.records) == 1


# --- what cannot batch -----------------------------------------------------------------


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))


class _Spare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(6, 3), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class _Plain(Client):
    name = "plain"

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        return FitOutput(state=state, num_examples=1)


@pytest.mark.parametrize(
    "clients, words",
    [
        (lambda: _clients(model=_bn_model), ["BatchNorm1d at '1'", "running statistics"]),
        (lambda: _clients(model=lambda: nn.Sequential(nn.Linear(6, 3), nn.Dropout(0.5))), ["Dropout at '1'"]),
        (lambda: _clients(lambda p: torch.optim.RMSprop(p, lr=0.01)), ["RMSprop", "SGD, Adam, AdamW"]),
        (lambda: _clients(lambda p: torch.optim.Adam(p, amsgrad=True)), ["amsgrad"]),
        (lambda: _clients(loader=lambda d: list(DataLoader(d, batch_size=8))), ["not a torch DataLoader"]),
        (lambda: [*_clients(), _Plain()], ["_Plain, not a TorchClient"]),
        (lambda: _clients(model=_Spare), ["'spare.weight' gets no gradient"]),
        (
            lambda: _clients(loss=nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 0.2]))),
            ["not a mean over examples"],
        ),
    ],
)
def test_batched_engine_refuses_with_a_clear_reason(clients, words):
    with pytest.raises(ConfigError) as err:
        InProcessFleet(clients(), engine="batched")
    assert err.value.key == "engine"
    for word in words:
        assert word in str(err.value)
    assert "--engine sequential" in str(err.value)


def test_data_dependent_control_flow_fails_the_trial():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    trainer = BatchedTrainer(_clients(model=Branchy))
    assert trainer.reason is not None and "trial batched step failed" in trainer.reason


def _rounds(fleet: InProcessFleet, state: ModelState, rounds: int = 2, **kwargs):
    infos = fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=1))
    outcomes = []
    for r in range(1, rounds + 1):
        assignments = [(info, FitIns(round=r, config={"seed": 9, "local_epochs": 1})) for info in infos]
        outcomes.append(
            fleet.fit_round(
                server_round=r,
                global_state=state,
                assignments=assignments,
                timeout=timedelta(seconds=30),
                **kwargs,
            )
        )
    return outcomes


def test_auto_falls_back_to_sequential_for_batchnorm_with_the_same_bits(caplog):
    state = _state(_clients(model=_bn_model))
    with caplog.at_level(logging.INFO):
        auto = InProcessFleet(_clients(model=_bn_model), engine="auto")
    assert auto.engine == "sequential"
    notices = [r.message for r in caplog.records if r.message.startswith("engine:")]
    assert len(notices) == 1 and "BatchNorm1d" in notices[0]
    got, want = _rounds(auto, state), _rounds(InProcessFleet(_clients(model=_bn_model)), state)
    for a, b in zip(got, want):
        for ra, rb in zip(a.results, b.results, strict=True):
            for name in rb.state:
                assert torch.equal(ra.state[name], rb.state[name]), name


def test_auto_picks_sequential_for_a_convolutional_model_on_cpu():
    def cnn() -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 3))

    trainer = BatchedTrainer(_clients(model=cnn, shape=(1, 8, 8)))
    assert trainer.reason is None and trainer.conv_share > 0.5
    assert InProcessFleet(_clients(model=cnn, shape=(1, 8, 8)), engine="auto").engine == "sequential"
    batched = InProcessFleet(_clients(), engine="auto")
    assert batched.engine == "batched" and batched.device == torch.device("cpu")
    assert (
        InProcessFleet(_clients(), engine="sequential").device is None
    )  # each client trains on its own device
    assert choose_engine(device=torch.device("cuda"), conv_share=0.9)[0] == "batched"
    got, want, _, _ = _both(
        _clients(model=cnn, shape=(1, 8, 8)), {}
    )  # forced batched convolutions are still exact
    _compare(got, want)


class _TinyLSTM(nn.Module):
    """A character model in miniature: embedding, a 1-layer LSTM, a head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out[:, -1])


def _lstm_clients() -> list[TorchClient]:
    gen = torch.Generator().manual_seed(0)
    clients = []
    for i, n in enumerate(SIZES):
        data = TensorDataset(
            torch.randint(0, 5, (n, 7), generator=gen), torch.randint(0, 3, (n,), generator=gen)
        )
        torch.manual_seed(1)
        optimizer = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
        clients.append(
            TorchClient(
                _TinyLSTM(),
                DataLoader(data, batch_size=8, shuffle=True),
                nn.functional.cross_entropy,
                optimizer,
                device="cpu",
                seed=i,
                name=f"c{i}",
            )
        )
    return clients


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU, nn.RNN])
def test_auto_picks_sequential_for_a_recurrent_model_without_trying_vmap(rnn, caplog, recwarn):
    clients = _lstm_clients()
    for c in clients:
        c.model.rnn = rnn(4, 6, batch_first=True)
    with caplog.at_level(logging.INFO, logger="fedgrid.simulation.fleet"):
        fleet = InProcessFleet(clients, engine="auto")
    assert fleet.engine == "sequential" and fleet.device is None
    notices = [r for r in caplog.records if r.getMessage().startswith("engine:")]
    assert [r.levelname for r in notices] == ["INFO"]
    assert (
        f"recurrent module 'rnn' ({rnn.__name__})"
        in notices[0].getMessage()
        == f"engine: sequential ({fleet.engine_reason})"
    )
    assert not [w for w in recwarn if "batching rule" in str(w.message)]  # no trial batched step ran
    state = _state(clients)
    (outcome,) = _rounds(fleet, state, rounds=1)
    assert len(outcome.results) == len(SIZES) and not outcome.failures


def test_recurrent_models_can_still_be_batched_when_asked():
    with pytest.warns(
        UserWarning, match="batching rule"
    ):  # the warning auto avoids: vmap's fallback is slow, not wrong
        fleet = InProcessFleet(_lstm_clients(), engine="batched")
    assert fleet.engine == "batched" and fleet.engine_reason == "requested"
    assert (
        InProcessFleet(_clients(), engine="auto").engine == "batched"
    )  # the check looks for recurrent modules only


def test_optimizer_spec_reads_the_factory():
    spec = optimizer_spec(
        torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.3, betas=(0.5, 0.6), eps=1e-6)
    )
    assert (spec.kind, spec.lr, spec.beta1, spec.beta2, spec.eps, spec.weight_decay, spec.decoupled) == (
        "adam",
        0.3,
        0.5,
        0.6,
        1e-6,
        0.01,
        True,
    )
    with pytest.raises(NotBatchable, match="parameter groups"):
        p = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
        optimizer_spec(torch.optim.SGD([{"params": p[:1]}, {"params": p[1:], "lr": 1.0}], lr=0.1))


def test_bad_engine_values_are_config_errors():
    with pytest.raises(ConfigError, match="'engine'.*unknown engine 'fast'"):
        InProcessFleet(_clients(), engine="fast")
    with pytest.raises(ConfigError, match="'batch_clients'"):
        InProcessFleet(_clients(), batch_clients=-1)


# --- the fleet ---------------------------------------------------------------------------


def test_fleet_batched_equals_sequential_with_topk_and_error_feedback():
    state = _state(_clients())
    policy = CodecPolicy(CodecSpec.parse("topk:0.1"))
    batched = _rounds(InProcessFleet(_clients(), engine="batched", codec_policy=policy), state)
    sequential = _rounds(InProcessFleet(_clients(), codec_policy=policy), state)
    for b, s in zip(batched, sequential):
        assert (b.bytes_up, b.bytes_down, b.extra) == (s.bytes_up, s.bytes_down, s.extra)
        assert b.extra["uplink_ratio"] > 2
        assert (
            [r.client.name for r in b.results]
            == [r.client.name for r in s.results]
            == ["c0", "c1", "c2", "c3"]
        )
        for rb, rs in zip(b.results, s.results):
            assert rb.num_examples == rs.num_examples
            for name in rs.state:
                torch.testing.assert_close(rb.state[name], rs.state[name], atol=ATOL, rtol=0)


class _Profiles:
    """Client 1 is away in round 1; client i takes ``10 - 2 * i`` seconds per example; regions by parity."""

    def available(self, index: int, server_round: int) -> bool:
        return not (index == 1 and server_round == 1)

    def region(self, index: int) -> str:
        return "eu" if index % 2 else "us"

    def train_seconds(self, index: int, num_examples: int) -> float:
        return num_examples * (10 - 2 * index)


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_profiles_availability_region_and_simulated_round_time(engine):
    fleet = InProcessFleet(_clients(), engine=engine, profiles=_Profiles())
    infos = fleet.wait_for_clients(min_clients=4, timeout=timedelta(seconds=1))
    assert [i.region for i in infos] == ["us", "eu", "us", "eu"]
    state = _state(_clients())
    first, second = _rounds(fleet, state)
    assert [f.reason for f in first.failures] == ["unavailable in round 1 (simulated)"]
    assert first.failures[0].client.name == "c1"
    assert [r.client.name for r in first.results] == ["c0", "c2", "c3"]
    times = {f"c{i}": n * (10 - 2 * i) for i, n in enumerate(SIZES)}  # 300, 40, 102, 32
    assert first.extra["sim_round_s"] == max(times[n] for n in ("c0", "c2", "c3")) == 300
    assert not second.failures and second.extra["sim_round_s"] == 300
    # Goodput in simulated seconds: each trains its own, then waits for the slowest (c0).
    for r in second.results:
        own = times[r.client.name]
        assert (r.metrics["compute_s"], r.metrics["wait_s"], r.metrics["wall_s"]) == (own, 300 - own, 300)
        assert r.metrics["comm_s"] == 0 and r.metrics["utilization"] == own / 300
    infos = fleet.wait_for_clients(min_clients=4, timeout=timedelta(seconds=1))
    over = fleet.fit_round(
        server_round=3,
        global_state=state,
        assignments=[(i, FitIns(round=3)) for i in infos],
        timeout=timedelta(seconds=30),
        target=2,
    )
    assert sorted(r.client.name for r in over.results) == ["c1", "c3"]  # the two that finish first
    assert sorted(c.name for c in over.cancelled) == ["c0", "c2"]
    assert over.extra["sim_round_s"] == 40


def test_own_region_wins_over_the_profile():
    clients = _clients()
    clients[0].region = "ap"
    infos = InProcessFleet(clients, profiles=_Profiles()).wait_for_clients(
        min_clients=1, timeout=timedelta(seconds=1)
    )
    assert [i.region for i in infos] == ["ap", "eu", "us", "eu"]


def test_cuda_budget_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """After a round, torch keeps freed blocks reserved; the device reports them as taken. K
    must come from memory free to torch: the device's free memory plus those blocks."""
    from fedgrid.simulation.batched import memory_budget

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * gib)
    assert memory_budget(torch.device("cuda")) == int((10 + 26) * gib * 0.8)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    assert memory_budget(torch.device("cuda")) == int(10 * gib * 0.8)


def test_a_chunks_steps_are_a_tasks_progress_for_a_local_runs_bar(monkeypatch):
    """The batched engine reports each chunk's steps (``fedgrid.client.progress``), in the
    examples its clients train at each step, as a sequential client does; its clock is driven."""
    from fedgrid.client import progress
    from fedgrid.clock import ManualClock
    from fedgrid.simulation import batched

    clock = ManualClock()

    class Driven(progress.TaskProgress):
        def __init__(self, **kwargs) -> None:
            super().__init__(clock=clock, **kwargs)

        def step(self, examples: int, tokens: int = 0) -> None:
            clock.advance(1.0)  # a step's time
            super().step(examples, tokens)

    monkeypatch.setattr(batched, "TaskProgress", Driven)
    clients = _clients()
    seen: list[progress.ProgressReport] = []
    progress.listen(seen.append)
    try:
        BatchedTrainer(clients).fit([(i, _state(clients), FitIns(round=4)) for i in range(len(clients))])
    finally:
        progress.listen(None)
    steps = max(-(-n // 8) for n in SIZES)  # the longest client's batches of 8
    assert [r.steps_done for r in seen] == list(range(1, steps + 1))
    assert {r.round for r in seen} == {4} and {r.steps_total for r in seen} == {steps}
    # Step 1: every client's first batch, 8 examples each (or fewer when it holds fewer).
    assert seen[0].examples_per_s == sum(min(8, n) for n in SIZES)
    assert seen[-1].eta_s == 0.0
