"""What an admitted client can do to the model is bounded: an independent client speaking
the wire protocol (no SDK) claims too much weight, sends differences on a lossless task,
names another run, joins under a name that forges log lines, or sends an update too far
from the global model. Each is refused with INVALID_ARGUMENT naming the rule and the
numbers, and changes nothing: the membership, the open round, the global model."""

from __future__ import annotations

import logging
from collections import OrderedDict

import grpc
import pytest
import torch

from fedgrid.client.api import Client, FitOutput
from fedgrid.config import load_config
from fedgrid.fleet.bounds import UpdateBounds
from fedgrid.proto import fedgrid_pb2 as pb
from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
from fedgrid.proto import serde
from fedgrid.proto.tls import session_metadata
from fedgrid.server.influence import Influence
from fedgrid.simulation.run import run_simulation

from attacks import Poisoner, Step, run_federation, simulate
from harness import InProcessCoordinator

HUGE = 2**64 - 1  # the largest uint64 a header can carry
INJECTION = "\n[FAKE] round 9 committed\x1b[31m"


class Probe:
    """A joined wire-level client with the round's task open."""

    def __init__(self, server: InProcessCoordinator, *, num_examples: int = 10) -> None:
        self.server = server
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.joined = self.stub.Join(pb.JoinRequest(name="probe", num_examples=num_examples), timeout=10)
        server.open_round()
        self.md = session_metadata(self.joined.session_token)
        reply = self.stub.PollTask(
            pb.PollRequest(client_id=self.joined.client_id, wait_s=5), metadata=self.md, timeout=10
        )
        assert reply.WhichOneof("reply") == "task"
        self.task = reply.task
        self.snap = self.snapshot()

    def upload(self, state, **header):
        fields = {"run_id": self.joined.run_id, "num_examples": 5, **header}
        info = serde.StreamInfo(
            task_id=self.task.task_id, round=self.task.round, client_id=self.joined.client_id, **fields
        )
        return self.stub.UploadUpdate(
            iter(list(serde.encode_model(state, info, chunk_size=16))), metadata=self.md, timeout=10
        )

    def refused(self, state, **header) -> str:
        with pytest.raises(grpc.RpcError) as err:
            self.upload(state, **header)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert self.snapshot() == self.snap  # nothing changed
        return err.value.details()

    def snapshot(self):
        fleet = self.server.fleet
        rnd = fleet.current_round
        return (
            fleet.state_dict(),
            rnd.task_id,
            rnd.closed,
            sorted(rnd.results),
            sorted(rnd.failures),
            sorted(rnd.uploading),
            rnd.bytes_up,
            rnd.downlink.for_client(None)[0].payloads(),
        )

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def server(small_state):
    s = InProcessCoordinator(small_state, bounds=UpdateBounds(max_update_norm=3.0))
    yield s
    s.stop()


@pytest.fixture
def probe(server):
    p = Probe(server)
    yield p
    p.close()


def _shifted(state, by: float = 0.5):
    return OrderedDict((k, v + by if v.is_floating_point() else v) for k, v in state.items())


def _accepted_once(probe, state, good) -> None:
    """After the refusals, the honest update is the one counted, bit for bit."""
    assert probe.upload(good).accepted
    outcome = probe.server.wait_round()
    assert len(outcome.results) == 1 and outcome.failures == []
    assert outcome.results[0].num_examples == 5
    for name, tensor in good.items():
        assert torch.equal(outcome.results[0].state[name], tensor)


def test_weight_above_the_join_report_or_the_maximum_is_refused(probe, small_state):
    good = _shifted(small_state)
    assert "the update claims 11, the client reported 10 at join" in probe.refused(good, num_examples=11)
    assert f"num_examples: {HUGE} claimed, over the maximum of 1000000000" in probe.refused(
        good, num_examples=HUGE
    )
    _accepted_once(probe, small_state, good)


def test_update_over_the_norm_bound_is_refused_naming_the_norm(probe, small_state):
    far = _shifted(small_state)
    far["layer.bias"] = small_state["layer.bias"] + 2.0  # the bias alone: sqrt(12 * 0.25 + 4 * 4) = sqrt(19)
    details = probe.refused(far)
    assert "update norm 4.3589 is over max_update_norm 3" in details and "'layer.bias'" in details
    huge = OrderedDict(
        (k, torch.full_like(v, 3e38) if v.is_floating_point() else v) for k, v in small_state.items()
    )
    # Refused at the first tensor (12 values of 3e38), before the rest is read; float64 squares do not overflow.
    assert "update norm 1.03923e+39 is over max_update_norm 3" in probe.refused(huge)
    _accepted_once(probe, small_state, _shifted(small_state))  # norm 2: within the bound


def test_delta_on_a_lossless_task_is_refused(probe, small_state):
    details = probe.refused(_shifted(small_state, 0.0), delta=True)  # zeros as differences: the model itself
    assert (
        "delta: the upload says delta=True, the task's uplink codec 'none' sends whole values (delta=False)"
        in details
    )
    _accepted_once(probe, small_state, _shifted(small_state))


def test_another_runs_id_is_refused_naming_both(probe, small_state):
    run_id = probe.server.fleet.run_id
    details = probe.refused(_shifted(small_state), run_id="f" * 32)
    assert f"run_id: the upload names run '{'f' * 32}', this coordinator runs '{run_id}'" in details
    assert f"this coordinator runs '{run_id}'" in probe.refused(_shifted(small_state), run_id="")
    _accepted_once(probe, small_state, _shifted(small_state))


@pytest.mark.parametrize(
    "request_fields, message",
    [
        ({"name": "site" + INJECTION}, "name: character 4 is '\\n'; only printable characters"),
        ({"name": "site\x1b[31m"}, "name: character 4 is '\\x1b'"),
        ({"name": "x" * 129}, "name: 129 characters, at most 128 printable characters allowed"),
        ({"name": "ok", "region": "eu\u202ewest"}, "region: character 2 is '\\u202e'"),
        ({"name": "ok", "region": "r" * 65}, "region: 65 characters, at most 64"),
        (
            {"name": "ok", "num_examples": HUGE},
            f"num_examples: {HUGE} reported at join, must be in 0..1000000000",
        ),
        (
            {"name": "ok", "capabilities": pb.Capabilities(codecs=["none", "int8\n"])},
            "codec name: character 4 is '\\n'",
        ),
        (
            {"name": "ok", "capabilities": pb.Capabilities(device="cuda" + INJECTION)},
            "device: 'cuda\\n[FAKE] round 9 committed",
        ),
        (
            {"name": "ok", "capabilities": pb.Capabilities(device="A100")},
            "device: 'A100' is not a device type (lowercase letters",
        ),
        (
            {"name": "ok", "capabilities": pb.Capabilities(num_accelerators=2**32 - 1)},
            "num_accelerators: 4294967295 reported, must be in 0..1024",
        ),
        (
            {"name": "ok", "capabilities": pb.Capabilities(memory_bytes=2**64 - 1)},
            f"memory_bytes: {2**64 - 1} reported, must be in 0..{1 << 50} (1 PiB)",
        ),
    ],
)
def test_join_with_a_bad_label_or_count_is_refused(server, request_fields, message):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(pb.JoinRequest(**request_fields), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()
        assert server.fleet.membership.records == {}
        # A name in any script is fine: only what moves the cursor or ends a line is not.
        assert stub.Join(pb.JoinRequest(name="Zürich-站点 7", num_examples=3), timeout=10).client_id


def test_client_text_reaches_the_log_escaped(probe, small_state, caplog):
    details = probe.refused(_shifted(small_state), metrics={"loss" + INJECTION: 1.0})
    assert "metric name: character 4 is '\\n'" in details
    with caplog.at_level(logging.DEBUG, logger="fedgrid"):
        probe.stub.ReportFailure(
            pb.ReportFailureRequest(
                client_id=probe.joined.client_id, task_id=probe.task.task_id, reason="fit failed" + INJECTION
            ),
            metadata=probe.md,
            timeout=10,
        )
        outcome = probe.server.wait_round()
        probe.stub.Leave(
            pb.LeaveRequest(client_id=probe.joined.client_id, reason="bye" + INJECTION),
            metadata=probe.md,
            timeout=10,
        )
    assert [f.reason for f in outcome.failures] == [
        "client reported: fit failed" + INJECTION
    ]  # the data is kept as sent
    lines = [r.getMessage() for r in caplog.records]
    mentions = [line for line in lines if "[FAKE]" in line]
    assert len(mentions) == 2, lines  # the failure report and the leave
    for line in lines:
        assert "\n" not in line and "\x1b" not in line, line
    assert any("'fit failed\\n[FAKE] round 9 committed\\x1b[31m'" in line for line in mentions)


def test_long_client_text_is_cut_in_the_log(probe, caplog):
    with caplog.at_level(logging.INFO, logger="fedgrid"):
        probe.stub.Leave(
            pb.LeaveRequest(client_id=probe.joined.client_id, reason="z" * 1000),
            metadata=probe.md,
            timeout=10,
        )
    line = next(r.getMessage() for r in caplog.records if "left" in r.getMessage())
    assert "z" * 200 + "'...(+800 chars)" in line and "z" * 201 not in line


# Influence bounded by default (issue 26): what an admitted client can do with a claim or an update
# that passes every per-upload check, deployed over gRPC and simulated, with the same bits.

HONEST = (("honest-1", 1), ("honest-2", 2))


def _honest(**kw):
    return [Step(name, k, **kw) for name, k in HONEST]


def _same(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)


#: The claim caps alone: the steer step (-0.1 against the honest +0.01 and +0.02) points away
#: from the round's median update, and the direction check refuses it at the defaults.
CAPS = Influence(min_update_cosine=-1, max_deviation_ratio=0)


def test_a_claim_of_1e9_buys_exactly_what_a_claim_of_1e8_buys():
    runs = {
        claim: run_federation([*_honest(claim=700), Poisoner("liar", "steer", claim=claim)], influence=CAPS)
        for claim in (10**9, 10**8)
    }
    assert _same(runs[10**9].model(), runs[10**8].model())
    for claim, run in runs.items():
        assert all(m.extra["claims_capped"] == 1.0 and m.clients_ok == 3 for m in run.engine.history)
        assert [(e["name"], e["claimed"], e["cap"]) for e in run.seen("claim_capped")] == [
            ("liar", claim, 1400)
        ] * 3
    # The liar holds 1400 / 2800 of the weight (max_weight_share; 7000 / 8400 at the ratio cap
    # alone): bounded, not nothing (plain FedAvg; see the median below).
    simulated = run_federation(
        [*_honest(claim=700), Poisoner("liar", "steer", claim=10**9)], deployed=False, influence=CAPS
    )
    assert _same(simulated.model(), runs[10**9].model())  # the simulation caps the same way
    uncapped = {
        claim: run_federation(
            [*_honest(claim=700), Poisoner("liar", "steer", claim=claim)],
            deployed=False,
            influence=Influence(
                max_weight_ratio=0, max_weight_share=0, min_update_cosine=-1, max_deviation_ratio=0
            ),
        ).model()
        for claim in (10**9, 10**8)
    }
    assert not _same(uncapped[10**9], uncapped[10**8])  # without the cap, the claim decides


def test_a_step_pointing_away_is_refused_by_default_in_a_deployment_and_in_simulation():
    """At the defaults the steer step (cosine -1 with the round's median update) is refused in
    every round, with the same bits over gRPC and in simulation: the model is the honest two's."""
    liar = Poisoner("liar", "steer", claim=10**9)
    deployed = run_federation([*_honest(claim=700), liar])
    assert [
        (m.clients_ok, m.clients_failed, m.extra["updates_refused"]) for m in deployed.engine.history
    ] == [(2, 1, 1.0)] * 3
    refused = deployed.seen("update_refused")
    assert [(e["name"], e["cosine"]) for e in refused] == [("liar", pytest.approx(-1.0))] * 3
    alone = run_federation(_honest(claim=700), deployed=False).model()
    assert _same(deployed.model(), alone)
    simulated = run_federation([*_honest(claim=700), Poisoner("liar", "steer", claim=10**9)], deployed=False)
    assert _same(simulated.model(), alone)


class ConstantLiar(Client):
    """Claims 10**9 examples (at Join too) and uploads the model 0.123 everywhere."""

    def __init__(self, inner: Client) -> None:
        self.inner, self.name, self.region = inner, inner.name, inner.region

    @property
    def num_examples(self) -> int:
        return 10**9

    def fit(self, state, ins):
        out = OrderedDict(
            (n, torch.full_like(v, 0.123) if v.is_floating_point() else v) for n, v in state.items()
        )
        return FitOutput(out, 10**9, {"loss": 0.0})

    def evaluate(self, state, config):
        return self.inner.evaluate(state, config)


def test_a_constant_model_claiming_1e9_ends_within_0_1_of_clean_at_the_defaults():
    """The issue's case: digits, three clients, one claiming 10**9 and uploading a constant
    model. At the ratio cap alone it holds 84% of each round and the model ends at chance; the
    share cap (0.5) leaves it half of a round, and an in-range constant model is within 2x of
    the honest updates' distance, so the caps alone ended at 0.446 against 0.958 clean. The
    median update's checks (``min_update_cosine``, ``max_deviation_ratio``) refuse it in every
    round after the first (observed: 0.914; seeds 1 and 2: 0.847 against 0.930, 0.930 against
    0.958); a round of the caps alone is the first round's harm, not a 0.1 margin."""
    config = {"clients": 3, "rounds": 5, "seed": 0, "threads": 1}
    liar = {"wrap": lambda i, c: ConstantLiar(c) if i == 2 else c}
    clean = simulate(load_config(overrides=config))
    attacked = simulate(load_config(overrides=config), **liar)
    caps_only = {"min_update_cosine": -1.0, "max_deviation_ratio": 0.0}
    capped = simulate(load_config(overrides={**config, **caps_only}), **liar)
    ratio_only = simulate(load_config(overrides={**config, **caps_only, "max_weight_share": 0}), **liar)
    assert all(m.extra.get("updates_refused") is None for m in clean)  # the honest two: nothing refused
    assert [m.extra.get("updates_refused") for m in attacked] == [None, 1.0, 1.0, 1.0, 1.0]
    assert clean[-1].accuracy > 0.9 and attacked[-1].accuracy >= clean[-1].accuracy - 0.1
    # Before: the share cap alone (observed 0.446) and the ratio cap alone (0.103).
    assert all(m.extra["claims_capped"] == 1.0 for m in capped)
    assert capped[-1].accuracy < clean[-1].accuracy - 0.3 and ratio_only[-1].accuracy < 0.2


def test_under_median_a_claim_of_1e9_changes_nothing():
    median = {"options": {"aggregator": "median"}, "deployed": False, "influence": CAPS}
    typical = run_federation([*_honest(), Poisoner("liar", "steer", claim=3)], **median)
    greedy = run_federation([*_honest(), Poisoner("liar", "steer", claim=10**9)], **median)
    assert _same(typical.model(), greedy.model())  # integer buffers too: the liar sent 10**6 steps
    steps = 7
    for _ in range(3):  # the honest clients send the round's steps back, the liar 10**6: counted once each
        steps = round((2 * steps + 10**6) / 3)
    assert int(greedy.model()["steps"]) == steps == 703706
    deployed = run_federation(
        [*_honest(), Poisoner("liar", "steer", claim=10**9)], options=median["options"], influence=CAPS
    )
    assert _same(deployed.model(), greedy.model())


@pytest.mark.parametrize("attack", ["scale", "huge"])
def test_a_scaled_or_3e38_update_is_refused_by_default(attack):
    run = run_federation([*_honest(), Poisoner("attacker", attack)])
    assert [(m.clients_ok, m.clients_failed, m.extra["updates_refused"]) for m in run.engine.history] == [
        (2, 1, 1.0)
    ] * 3
    refused = run.seen("update_refused")
    assert [e["name"] for e in refused] == ["attacker"] * 3
    distance = 4 * (1000 * 0.05 if attack == "scale" else 3e38)  # 16 floating values: a norm of 4 x the step
    assert all(e["distance"] == pytest.approx(distance, rel=1e-5) and e["ratio"] == 10.0 for e in refused)
    # The round's failure names the numbers; the attacker stays joined (its summary, not an error).
    assert run.rounds == {"honest-1": 3, "honest-2": 3, "attacker": 3}
    # The model is that of the two honest clients alone, bit for bit, in a deployment and in simulation.
    alone = run_federation(_honest(), deployed=False)
    assert _same(run.model(), alone.model())
    assert _same(
        run_federation([*_honest(), Poisoner("attacker", attack)], deployed=False).model(), alone.model()
    )


def test_honest_clients_survive_refusals_under_a_tight_norm_bound_and_the_run_completes():
    # honest-2 steps 0.5 from round 2 on: 0.5 * sqrt(12) over w alone, over max_update_norm 1; its
    # uploads are refused, it reports each as its round's failure and takes the next task.
    clients = [Step("honest-1", 1), Step("honest-2", 2, far=0.5, far_from=2), Step("honest-3", 3)]
    run = run_federation(clients, rounds=4, bounds=UpdateBounds(max_update_norm=1.0))
    assert [m.round for m in run.engine.history] == [1, 2, 3, 4]
    assert [(m.clients_ok, m.clients_failed) for m in run.engine.history] == [(3, 0), (2, 1), (2, 1), (2, 1)]
    assert run.rounds == {"honest-1": 4, "honest-2": 1, "honest-3": 4}  # every client ran to the end
    assert [e.round for e in run.errors["honest-2"]] == [2, 3, 4]
    assert all("update norm 1.73205 is over max_update_norm 1" in e.detail for e in run.errors["honest-2"])
    assert run.errors["honest-1"] == run.errors["honest-3"] == []


def test_the_median_updates_checks_refuse_no_honest_update_of_a_heterogeneous_run():
    """Honest digits clients, 10 of them on ``dirichlet:0.1`` (most hold two or three labels):
    their updates' cosines with the round's median update went down to -0.14, their distances
    from it within 1.92x of the lower median; nothing is refused, and the run is the same run
    as without the checks, within 0.02 (observed: 0.825 both, bit for bit). Label-disjoint
    clients (``shards:2``) are the documented trade-off (docs/failures.rst)."""
    config = {"rounds": 5, "seed": 0, "threads": 1, "progress": False, "partition": "dirichlet:0.1"}
    checked = run_simulation(load_config(overrides=config))[1]
    unchecked = run_simulation(
        load_config(overrides={**config, "min_update_cosine": -1.0, "max_deviation_ratio": 0.0})
    )[1]
    assert [(m.clients_ok, m.extra.get("updates_refused")) for m in checked] == [(10, None)] * 5
    assert checked[-1].accuracy >= unchecked[-1].accuracy - 0.02 and unchecked[-1].accuracy > 0.7
