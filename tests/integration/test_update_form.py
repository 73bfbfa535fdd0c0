"""One update form (issue 39, item 3): on its way from a client's fit to its strategy's
aggregate, an update turns from a value into a difference from the global model, or back,
at most once, for every built-in strategy, on both fleets: the gRPC fleet (a coordinator,
``fedgrid.cli.serve``, on port 0 in this process, with two SDK clients in threads) and the
simulated one (``run_simulation``); LoRA clients at their own ranks under ``svd`` on a lossy
uplink, on both; late results of quorum rounds, on a deployed coordinator (simulation replays
quorum rounds from a deployment's events, tests/e2e/test_quorum_replay.py).

The conversions are counted where they happen, by wrapping the functions that do them:

- ``UplinkEncoder.encode`` (the client): a lossy uplink sends ``new - global``;
- ``protocol.UpdateCheck.add`` (the coordinator): a difference it does not keep is added back;
- ``updates.client_value``: a difference with the global model added back;
- ``updates.client_delta`` and ``updates.client_difference``: a value with the global model
  subtracted;
- ``staleness.rebase``: a late value made a difference from its task's model.

Not counted: the aggregate's own arithmetic on differences, as FedAvg adding its mean
difference to the model, or LoRA's ``svd`` merge taking each client's product ``B_i @ A_i``
in float64 from its differences and the pair it downloaded (``aggregation.lora.svd_average``).

Each is counted tensor by tensor; an update's count at a place is the most conversions of
any one of its tensors there (``client_value`` and ``client_difference`` work slice by slice:
a tensor's first slice counts).
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest
from test_lora_ranks import _ranked
from test_quorum_rounds import GRACE_S, Run

from fedgrid.aggregation import fedavg, lora, staleness, updates
from fedgrid.aggregation.by_name import STRATEGIES
from fedgrid.cli import serve
from fedgrid.client import start_client
from fedgrid.client.uplink import UplinkEncoder
from fedgrid.compression.feedback import is_delta_tensor
from fedgrid.config import Config, load_config
from fedgrid.fleet import protocol
from fedgrid.fleet.base import Quorum
from fedgrid.runlog import read_metrics
from fedgrid.server import late_merge, privacy
from fedgrid.simulation.run import run_simulation
from fedgrid.simulation.tasks import builtin_client, client_options

from harness import wait_until

pytestmark = pytest.mark.timeout(300)

CLIENTS = 2
#: (uplink, downlink) codecs: values on the wire (``none``); differences (``int8``, lossy) from
#: the exact model; differences from a lossy downlink's model (the shadow the clients hold).
CODECS = (("none", "none"), ("int8", "none"), ("int8", "int8"))


class Conversions:
    """Counts the conversions of each tensor by where they happen."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        encode, add = UplinkEncoder.encode, protocol.UpdateCheck.add
        client_value, client_delta, rebase = updates.client_value, updates.client_delta, staleness.rebase
        client_difference = updates.client_difference

        def counted_encode(encoder, *, global_state, new_state):
            encoded, delta = encode(encoder, global_state=global_state, new_state=new_state)
            for name, tensor in new_state.items() if delta else ():
                if name in global_state and is_delta_tensor(tensor):
                    self._hit("client: value -> difference", name)
            return encoded, delta

        def counted_add(check, name, tensor):
            if check.delta and is_delta_tensor(tensor) and not check.keeps_delta and name in check.base:
                self._hit("accept: difference -> value", name)
            return add(check, name, tensor)

        def counted_value(global_state, res, name, part=None):
            got = res.state.get(name)
            first = part is None or part.start == 0
            if res.delta and got is not None and got.is_floating_point() and first:
                self._hit("client_value: difference -> value", name)
            return client_value(global_state, res, name, part)

        def counted_delta(global_state, res, names):
            for name in names if not res.delta else ():
                self._hit("client_delta: value -> difference", name)
            return client_delta(global_state, res, names)

        def counted_difference(global_state, res, name, part=None):
            first = part is None or part.start == 0
            if not res.delta and name in res.state and first:
                self._hit("client_difference: value -> difference", name)
            return client_difference(global_state, res, name, part)

        def counted_rebase(res, base, *, weight):
            for name, value in res.state.items() if not res.delta else ():
                if name in base and value.is_floating_point():
                    self._hit("rebase: value -> difference", name)
            return rebase(res, base, weight=weight)

        monkeypatch.setattr(UplinkEncoder, "encode", counted_encode)
        monkeypatch.setattr(protocol.UpdateCheck, "add", counted_add)
        for module in (updates, fedavg):
            monkeypatch.setattr(module, "client_value", counted_value)
        # The svd merge adds no value back since it takes products from differences; were it to
        # call client_value again, it would be counted.
        monkeypatch.setattr(lora, "client_value", counted_value, raising=False)
        for module in (updates, privacy):
            monkeypatch.setattr(module, "client_delta", counted_delta)
        for module in (updates, fedavg):
            monkeypatch.setattr(module, "client_difference", counted_difference)
        monkeypatch.setattr(late_merge, "rebase", counted_rebase)

    def _hit(self, where: str, name: str) -> None:
        with self._lock:
            self.counts[where, name] += 1

    def per_update(self, updates_accepted: int) -> dict[str, float]:
        """Each place's conversions per accepted update (its most converted tensor's)."""
        most: dict[str, int] = {}
        for (where, _), n in self.counts.items():
            most[where] = max(most.get(where, 0), n)
        return {where: n / updates_accepted for where, n in sorted(most.items())}


def _config(out: Path, strategy: str, codecs: tuple[str, str], **overrides):
    return load_config(
        overrides={
            "strategy": strategy,
            "codec": codecs[0],
            "downlink_codec": codecs[1],
            "model": "logistic",
            "clients": CLIENTS,
            "rounds": 1,
            "local_epochs": 1,
            "threads": 1,
            "engine": "sequential",
            "progress": False,
            "seed": 5,
            "out": str(out),
            **overrides,
        }
    )


def _simulated(config_of: Callable[..., Config], out: Path) -> int:
    """One simulated round of ``config_of(out, **overrides)``; the updates accepted."""
    _, history = run_simulation(config_of(out / "sim"))
    return history[-1].clients_ok


def _deployed(config_of: Callable[..., Config], out: Path) -> int:
    """One round of a coordinator on port 0 and two SDK clients, in this process; the updates accepted."""
    config = config_of(out / "grpc", listen="127.0.0.1:0", min_clients=CLIENTS)
    thread = threading.Thread(target=serve, args=(config,), daemon=True)
    thread.start()
    address = Path(config.out) / "address"
    wait_until(lambda: address.exists() and address.read_text().strip() != "", timeout=120, what="address")
    handles = [
        start_client(
            builtin_client(i, CLIENTS, config.seed, client_options(config)), address.read_text().strip()
        )
        for i in range(CLIENTS)
    ]
    thread.join(timeout=240)
    assert not thread.is_alive(), "the coordinator did not finish"
    for handle in handles:
        handle.join(timeout=60)
    (row,) = read_metrics(Path(config.out))
    return row["clients_ok"]


FLEETS = {"simulated": _simulated, "grpc": _deployed}


@pytest.mark.parametrize("fleet", sorted(FLEETS))
@pytest.mark.parametrize("codecs", CODECS, ids="/".join)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_an_update_changes_form_at_most_once_on_its_way_to_the_strategy(
    tmp_path, monkeypatch, strategy, codecs, fleet
):
    conversions = Conversions(monkeypatch)
    accepted = FLEETS[fleet](lambda out, **more: _config(out, strategy, codecs, **more), tmp_path)
    assert accepted == CLIENTS
    per_update = conversions.per_update(accepted)
    print(f"CONVERSIONS {fleet} {strategy} {'/'.join(codecs)}: {per_update}")
    # Every update takes the same path: each place converts all of them or none.
    assert all(n == int(n) for n in per_update.values()), per_update
    assert sum(per_update.values()) <= 1, per_update
    # A lossy uplink sends differences: the client's is the one conversion, none after it.
    if codecs[0] != "none":
        assert per_update == {"client: value -> difference": 1.0}, per_update


@pytest.mark.parametrize("fleet", sorted(FLEETS))
@pytest.mark.parametrize("ranks", ["8,8", "4,8"])
def test_a_lora_update_at_its_own_rank_changes_form_once_under_svd(
    llama, data_dir, tmp_path, monkeypatch, ranks, fleet
):
    # Clients of LoRA ranks 4 and 8 (or both 8, the coordinator's) on a lossy uplink send their
    # differences from the model at their rank; the coordinator keeps them, and the svd merge
    # takes each product from the pair its client downloaded and the differences.
    conversions = Conversions(monkeypatch)
    accepted = FLEETS[fleet](
        lambda out, **more: _ranked(llama, data_dir, out, peft_rank=ranks, codec="int8", rounds=1, **more),
        tmp_path,
    )
    assert accepted == CLIENTS
    per_update = conversions.per_update(accepted)
    print(f"CONVERSIONS {fleet} lora svd ranks {ranks} int8/none: {per_update}")
    assert per_update == {"client: value -> difference": 1.0}, per_update


def test_a_late_result_changes_form_once_on_its_way_to_the_merge(monkeypatch):
    # Quorum rounds over a deployed coordinator (test_quorum_rounds.Run: FedAvg, values on the
    # wire): the slow worker's round-1 result lands after round 2 and merges into round 3, made
    # a difference from its task's model (rebase), once. The fresh result beside it is made one
    # by FedAvg's mean of differences, once; the fresh results of rounds 1 and 2, values alone,
    # are averaged as values (no conversion).
    conversions = Conversions(monkeypatch)
    gate = threading.Event()
    run = Run(Quorum(min_quorum=1, grace_s=GRACE_S, max_staleness=4), [gate, threading.Event()])
    try:
        run.round(1)
        run.round(2)
        gate.set()
        wait_until(
            lambda: any(f.get("late") for f in run.of("update_accepted")), timeout=30, what="late result"
        )
        run.round(3)
        merges = {f["round"]: [(m["name"], m["task_round"]) for m in f["results"]] for f in run.of("merged")}
        assert merges[3] == [("fast", 3), ("slow", 1)], merges
    finally:
        for g in run.slow.gates:
            g.set()
        run.close()
    # Four updates merged (fast in rounds 1 to 3, slow late in 3): two conversions, one each.
    assert dict(conversions.counts) == {
        ("client_difference: value -> difference", "w"): 1,
        ("rebase: value -> difference", "w"): 1,
    }, conversions.counts
