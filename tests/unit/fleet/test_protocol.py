"""``fleet/protocol.py``: a client's fit task, its download, the checks every fleet applies to
an update, the form it is kept in (``FitRes.delta``), and the round's byte tally; the delta flag survives a spill and
reaches only strategies that take it."""

from __future__ import annotations

import math
from collections import OrderedDict
from datetime import timedelta

import pytest
import torch

from fedgrid.aggregation.fedavg import FedAvg
from fedgrid.client.api import Client, FitOutput
from fedgrid.compression.spec import CodecSpec
from fedgrid.config_compression import task_uplink_codec
from fedgrid.errors import InvalidUpdateError
from fedgrid.fleet import protocol
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.fleet.codec_policy import CodecPolicy
from fedgrid.fleet.downlink import Downlink
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.server.spill import UpdateSpill
from fedgrid.simulation.fleet import InProcessFleet
from fedgrid.types import ClientInfo, FitIns, FitRes, TensorSpec

pytestmark = pytest.mark.timeout(60)

BASE = OrderedDict(w=torch.tensor([300.0, -2.0, 0.5]), steps=torch.tensor(4))


def test_header_checks_name_what_is_wrong():
    bounds, client = UpdateBounds(max_num_examples=100), ClientInfo("c", num_examples=10)
    protocol.check_header(bounds, client, num_examples=10, delta=True, codec=CodecSpec.parse("int8"))
    for kwargs, message in [
        ({"num_examples": 0, "delta": False, "codec": "none"}, "num_examples must be at least 1"),
        (
            {"num_examples": 11, "delta": False, "codec": "none"},
            "the update claims 11, the client reported 10 at join",
        ),
        ({"num_examples": 101, "delta": False, "codec": "none"}, "101 claimed, over the maximum of 100"),
        ({"num_examples": 5, "delta": True, "codec": "none"}, "sends whole values (delta=False)"),
        ({"num_examples": 5, "delta": False, "codec": "int8"}, "sends differences (delta=True)"),
    ]:
        with pytest.raises(InvalidUpdateError, match=message.replace("(", r"\(").replace(")", r"\)")):
            protocol.check_header(bounds, client, **{**kwargs, "codec": CodecSpec.parse(kwargs["codec"])})
    protocol.check_claim(
        bounds, client, 0, evaluate=True
    )  # an evaluation of nothing fails when counted, not here


def test_a_kept_difference_is_checked_as_the_value_it_stands_for():
    diff = torch.tensor([1e-3, 2.0, -0.25])
    kept = protocol.UpdateCheck(BASE, UpdateBounds(max_update_norm=3.0), delta=True, keep_delta=True)
    assert kept.keeps_delta and torch.equal(kept.add("w", diff), diff)
    assert torch.equal(kept.add("steps", BASE["steps"]), BASE["steps"])
    added = protocol.UpdateCheck(BASE, UpdateBounds(max_update_norm=3.0), delta=True)
    assert not added.keeps_delta and torch.equal(added.add("w", diff), BASE["w"] + diff)
    assert kept.norm is not None and added.norm is not None
    assert math.isclose(kept.norm.value, float(diff.double().norm()), rel_tol=1e-12)
    assert math.isclose(added.norm.value, kept.norm.value, rel_tol=1e-6)
    with pytest.raises(InvalidUpdateError, match="over max_update_norm"):
        protocol.UpdateCheck(BASE, UpdateBounds(max_update_norm=1.0), delta=True, keep_delta=True).add(
            "w", diff
        )
    with pytest.raises(InvalidUpdateError, match="contains NaN"):
        kept.add("w", torch.tensor([0.0, math.nan, 0.0]))
    values = protocol.UpdateCheck(BASE, UpdateBounds(), delta=False, keep_delta=True)
    assert not values.keeps_delta  # whole values are values, whatever the downlink


def test_the_tally_counts_bytes_by_region():
    tally = protocol.RoundTally()
    tally.add_up("eu", wire=100, payload=80, raw=320)
    tally.add_up("", wire=50, payload=40, raw=160)
    tally.add_down("eu", 7)
    assert (tally.bytes_up, tally.bytes_down) == (150, 7)
    assert tally.extra() == {"uplink_ratio": 4.0, "bytes_up.eu": 100.0, "bytes_down.eu": 7.0}
    assert protocol.RoundTally().extra() == {}
    assert protocol.raw_bytes(TensorSpec.of(BASE)) == 3 * 4 + 8


def test_the_delta_flag_survives_the_spill(tmp_path):
    spill = UpdateSpill(tmp_path)
    client, diff = (
        ClientInfo("c1", name="c1"),
        OrderedDict(w=torch.tensor([1.0, 2.0, 3.0]), steps=torch.tensor(5)),
    )
    put = spill.put(task_id="t", result=FitRes(client, diff, 3, {}, delta=True))
    writer = spill.writer(
        task_id="t",
        client=ClientInfo("c2"),
        specs=TensorSpec.of(diff),
        num_examples=3,
        metrics={},
        delta=False,
    )
    assert writer is not None
    for name, tensor in diff.items():
        writer.write(name, tensor)
    writer.commit()
    spill.flush()
    restored = spill.restore(task_id="t", assigned={"c1": client, "c2": ClientInfo("c2")})
    assert put.delta and restored["c1"].delta and not restored["c2"].delta
    assert torch.equal(restored["c1"].state["w"], diff["w"])
    spill.close()


class Trained(Client):
    """Adds ``step`` to every floating tensor it is sent."""

    def __init__(self, name: str, step: float) -> None:
        self.name, self.step = name, step

    @property
    def num_examples(self) -> int:
        return 4

    def fit(self, state, ins):
        trained = OrderedDict((k, v + self.step if v.is_floating_point() else v) for k, v in state.items())
        return FitOutput(trained, 4, {})


@pytest.mark.parametrize("downlink", ["none", "int8"])
def test_a_lossy_uplink_hands_over_differences_from_the_rounds_model_over_any_downlink(downlink):
    glob = OrderedDict(w=torch.linspace(-1, 1, 300), steps=torch.tensor(2))
    fleet = InProcessFleet(
        [Trained("a", 0.5)],
        codec_policy=CodecPolicy(CodecSpec.parse("int8")),
        downlink_codec=CodecSpec.parse(downlink),
    )
    [info] = fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=1))
    outcome = fleet.fit_round(
        server_round=1, global_state=glob, assignments=[(info, FitIns(round=1))], timeout=timedelta(seconds=5)
    )
    [res] = outcome.results
    assert res.delta and torch.equal(res.state["steps"], glob["steps"])
    torch.testing.assert_close(res.state["w"] + glob["w"], glob["w"] + 0.5, rtol=0, atol=0.02)  # int8's error


class ModelsOnly(FedAvg):
    """A strategy that reads ``res.state`` as weights and says nothing about deltas."""

    accepts_deltas = False

    def aggregate(self, *, server_round, results, failures):
        self.seen = [(r.delta, r.state["w"].clone()) for r in results]
        return super().aggregate(server_round=server_round, results=results, failures=failures)


def test_the_engine_hands_models_to_a_strategy_that_does_not_take_deltas():
    glob = OrderedDict(w=torch.linspace(-1, 1, 300))
    strategy = ModelsOnly()
    strategy.initialize(initial_state=glob)
    fleet = InProcessFleet([Trained("a", 0.5)], codec_policy=CodecPolicy(CodecSpec.parse("int8")))
    RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=1,
            min_clients=1,
            round_timeout=timedelta(seconds=5),
            join_timeout=timedelta(seconds=1),
        ),
    ).run()
    [(delta, w)] = strategy.seen
    assert not delta
    torch.testing.assert_close(w, glob["w"] + 0.5, rtol=0, atol=0.02)
    assert torch.equal(strategy.global_state["w"], w)


class NoExamples(Trained):
    """Trains, then claims it trained on nothing."""

    def fit(self, state, ins):
        return FitOutput(super().fit(state, ins).state, 0, {})


def test_a_simulated_client_claiming_no_examples_fails_its_round_and_the_run_goes_on():
    glob = OrderedDict(w=torch.linspace(-1, 1, 300))
    strategy = FedAvg()
    strategy.initialize(initial_state=glob)
    fleet = InProcessFleet([Trained("a", 0.5), NoExamples("z", 100.0)])
    engine = RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=2,
            min_clients=2,
            round_timeout=timedelta(seconds=5),
            join_timeout=timedelta(seconds=1),
        ),
    )
    final = engine.run()
    assert final is not None and [(m.clients_ok, m.clients_failed) for m in engine.history] == [
        (1, 1),
        (1, 1),
    ]
    torch.testing.assert_close(final["w"], glob["w"] + 0.5 + 0.5, rtol=0, atol=0)  # "z" never counted


def test_a_fit_task_carries_the_clients_uplink_codec_and_feedback():
    policy = CodecPolicy(default=CodecSpec.parse("int8"), error_feedback="none")
    ins = FitIns(round=3, config={"lr": 0.1})
    told = ClientInfo("a", codecs=("int8",))
    task, codec = protocol.fit_task(policy, told, ins)
    assert codec == CodecSpec.parse("int8")
    assert task.config["lr"] == 0.1 and task_uplink_codec(task.config) == codec
    assert task.config["uplink_feedback"] == "none" and ins.config == {"lr": 0.1}  # the given task unchanged
    # A client that did not advertise the codec's family gets none, and its task says so.
    task, codec = protocol.fit_task(policy, ClientInfo("b", codecs=()), ins)
    assert codec == CodecSpec.NONE and task_uplink_codec(task.config) == CodecSpec.NONE


def test_a_client_downloads_what_its_task_names_and_what_its_differences_need():
    ins = FitIns(round=1, download=("a",), expected={"b": TensorSpec.of(BASE)["w"]})
    int8 = CodecSpec.parse("int8")
    assert protocol.download_names(ins, lossless_downlink=True, codec=CodecSpec.NONE) == {"a"}
    assert protocol.download_names(ins, lossless_downlink=True, codec=int8) == {"a", "b"}
    assert protocol.download_names(ins, lossless_downlink=False, codec=int8) is None  # everything


def test_the_update_form_is_decided_by_the_downlink_and_the_clients_rank():
    """A difference stays one: over an exact downlink as sent, over a lossy one shifted by the
    shadow's offset from the round's model (a late one as sent: its client's own change); one
    taken against the model at the client's own rank is kept from that model (the svd merge
    adds the pair at that rank in its products)."""
    bounds, sent = UpdateBounds(), OrderedDict(w=torch.tensor([1.0, 2.0, 3.0]))
    diff = torch.tensor([0.5, 0.25, -1.0])
    exact = Downlink().prepare(sent)
    check = protocol.update_check(exact, bounds, delta=True)
    assert check.keeps_delta and torch.equal(check.add("w", diff), diff)
    assert not protocol.update_check(exact, bounds, delta=False).keeps_delta  # values stay values
    downlink = Downlink(CodecSpec.parse("int8"))
    downlink.prepare(sent)
    moved = OrderedDict(w=torch.tensor([1.3, 2.0, 2.9]))
    lossy = downlink.prepare(moved)  # the shadow trails the model by what int8 lost
    assert lossy.offset is not None and not torch.equal(lossy.base["w"], moved["w"])
    torch.testing.assert_close(lossy.offset["w"], lossy.base["w"] - moved["w"], rtol=0, atol=0)
    check = protocol.update_check(lossy, bounds, delta=True)
    kept = check.add("w", diff)
    assert check.keeps_delta and check.shifts and torch.equal(kept, diff + lossy.offset["w"])
    # The value it stands for is what adding it back to the shadow gave, within a rounding.
    torch.testing.assert_close(moved["w"] + kept, lossy.base["w"] + diff, rtol=0, atol=1e-6)
    late = protocol.update_check(lossy, bounds, delta=True, late=True)
    assert late.keeps_delta and not late.shifts and torch.equal(late.add("w", diff), diff)
    res = FitRes(ClientInfo("c"), OrderedDict(w=kept), 3, delta=True)
    torch.testing.assert_close(protocol.without_offset(res, lossy.offset).state["w"], diff, rtol=0, atol=1e-7)
    ranked = OrderedDict(w=torch.tensor([10.0, 20.0, 30.0]))
    check = protocol.update_check(exact, bounds, delta=True, ranked=ranked)
    assert check.keeps_delta and not check.shifts and check.base is ranked
    assert torch.equal(check.add("w", diff), diff)


def test_a_tensor_the_model_lacks_comes_as_it_is():
    """SCAFFOLD's control deltas are not in the downloaded model: a lossy uplink sends them as
    they are (client/uplink.py) and the coordinator takes them so."""
    check = protocol.UpdateCheck(BASE, UpdateBounds(), delta=True)
    extra = torch.tensor([0.125, -4.0])
    assert torch.equal(check.add("scaffold.c_delta.w", extra), extra)
