"""Message phases: the ring protocol (``apps/ring_app.py``) in simulation and over gRPC, with
a client that drops between its two phases; sums checked by hand; deployment == simulation."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch

from fedgrid.aggregation.selection import Sampling
from fedgrid.determinism import intra_op_threads
from fedgrid.server.engine import RoundEngine
from fedgrid.server.parts import Schedule
from fedgrid.server.remote_fleet import RemoteFleet
from fedgrid.server.serve import Coordinator
from fedgrid.simulation.fleet import InProcessFleet

from harness import THREADS, start_client

sys.path.insert(0, str(Path(__file__).parents[1] / "support" / "apps"))
import linear_app  # noqa: E402
import ring_app  # noqa: E402

CLIENTS, ROUNDS, SEED, DROPPER = 4, 2, 3, 2
NAMES = [f"linear-{i}/{CLIENTS}" for i in range(CLIENTS)]


def hand_sums(ring: list[str], sent_share: list[str], server_round: int) -> dict[str, list[float]]:
    """What each client of ``ring`` that sent its share should report: the sum of its ring
    neighbours' vectors, of the neighbours that sent theirs, in ring order."""
    out = {}
    for name in sent_share:
        total = torch.zeros(ring_app.DIM, dtype=torch.float64)
        for other in ring:  # the relay delivers in the phase's (ring) order
            if other in sent_share and name in ring_app.neighbours(ring, other):
                total = total + ring_app.vector(other, server_round)
        out[name] = total.tolist()
    return out


def check_protocol(strategy: ring_app.RingStrategy) -> None:
    dropper = NAMES[DROPPER]
    # Round 1: all four in the ring and all sent their share; the dropper is gone before "sum".
    assert strategy.rings[1] == NAMES
    want = hand_sums(NAMES, NAMES, 1)
    del want[dropper]
    assert {n: got for n, (got, _) in strategy.report[1].items()} == want
    # Its neighbours still received its vector: it was sent before it dropped.
    left, right = ring_app.neighbours(NAMES, dropper)
    assert want[left] != hand_sums(
        [n for n in NAMES if n != dropper], [n for n in NAMES if n != dropper], 1
    ).get(left)
    # Round 2: a ring of three, without it.
    ring2 = [n for n in NAMES if n != dropper]
    assert strategy.rings[2] == ring2
    assert {n: got for n, (got, _) in strategy.report[2].items()} == hand_sums(ring2, ring2, 2)
    assert strategy.dropped == {dropper}


def engine(strategy: ring_app.RingStrategy, fleet, min_clients: int) -> RoundEngine:  # type: ignore[no-untyped-def]
    return RoundEngine(
        strategy=strategy,
        fleet=fleet,
        schedule=Schedule(
            rounds=ROUNDS,
            min_clients=min_clients,
            round_timeout=timedelta(seconds=60),
            join_timeout=timedelta(seconds=60),
        ),
    )


def simulate() -> tuple[ring_app.RingStrategy, list]:
    clients = [
        ring_app.sim_client_gone_after_share(i, CLIENTS, SEED)
        if i == DROPPER
        else ring_app.client(i, CLIENTS, SEED)
        for i in range(CLIENTS)
    ]
    strategy = ring_app.RingStrategy(sampling=Sampling(seed=SEED))
    strategy.initialize(initial_state=initial())
    with intra_op_threads(THREADS):
        eng = engine(strategy, InProcessFleet(clients), CLIENTS)
        eng.run()
    return strategy, eng.history


def initial():  # type: ignore[no-untyped-def]
    torch.manual_seed(SEED)
    return linear_app.model().state_dict()


def test_ring_in_simulation_checks_out_by_hand_with_a_client_gone_between_phases():
    strategy, history = simulate()
    check_protocol(strategy)
    r1 = history[0]
    assert (r1.extra["share_ok"], r1.extra["share_failed"], r1.extra["sum_ok"], r1.extra["sum_failed"]) == (
        4,
        0,
        3,
        1,
    )
    assert r1.extra["ring_ok"] == 1.0 and history[1].extra["ring_ok"] == 1.0
    assert (r1.clients_ok, r1.clients_failed) == (3, 0)  # the dropper was not asked to fit
    assert message_bytes(history) == EXPECTED_BYTES


VEC = ring_app.DIM * 8
#: Payload bytes per round and phase: (share up, share down, sum up, sum down). Round 1: 4
#: clients send 2 vectors each and receive 2 each; 3 sums go to the server, which relays none.
EXPECTED_BYTES = [(8 * VEC, 8 * VEC, 3 * VEC, 0), (6 * VEC, 6 * VEC, 3 * VEC, 0)]


def message_bytes(history: list) -> list[tuple[float, ...]]:
    return [
        tuple(m.extra[k] for k in ("share_bytes_up", "share_bytes_down", "sum_bytes_up", "sum_bytes_down"))
        for m in history
    ]


def test_ring_over_grpc_with_a_client_crashing_between_phases_equals_simulation(tmp_path):
    sim_strategy, _ = simulate()
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=0.5))
    coordinator = Coordinator("127.0.0.1:0", fleet, max_workers=8).start()
    procs = []
    try:
        for i in range(CLIENTS):
            app = "ring_app:client_drops_after_share" if i == DROPPER else "ring_app:client"
            procs.append(
                start_client(
                    coordinator.address,
                    tmp_path / f"c{i}.log",
                    "--app",
                    app,
                    "--partition",
                    f"{i}/{CLIENTS}",
                    "--seed",
                    str(SEED),
                )
            )
        strategy = ring_app.RingStrategy(sampling=Sampling(seed=SEED))
        strategy.initialize(initial_state=initial())
        fleet.wait_for_clients(
            min_clients=CLIENTS, timeout=timedelta(seconds=60)
        )  # then round 2 runs with the three left
        with intra_op_threads(THREADS):
            eng = engine(strategy, fleet, CLIENTS - 1)
            final = eng.run()
        for i, proc in enumerate(procs):
            assert proc.wait(timeout=60) == (17 if i == DROPPER else 0), (tmp_path / f"c{i}.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        coordinator.stop(grace=0.5)
        fleet.close()
    check_protocol(strategy)
    assert strategy.report == sim_strategy.report
    assert final is not None
    for name, tensor in final.items():
        assert torch.equal(tensor, sim_strategy.global_state[name]), name
    r1 = eng.history[0]
    assert (r1.extra["share_ok"], r1.extra["sum_ok"], r1.extra["sum_failed"]) == (4, 3, 1)
    assert message_bytes(eng.history) == EXPECTED_BYTES


def test_message_rpcs_refuse_bad_input_with_a_named_status_and_change_nothing():
    import threading

    import grpc

    from fedgrid.proto import fedgrid_pb2 as pb
    from fedgrid.proto import fedgrid_pb2_grpc as pb_grpc
    from fedgrid.proto.tls import session_metadata
    from fedgrid.types import TO_ALL, MessageIns

    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    coordinator = Coordinator("127.0.0.1:0", fleet, max_workers=4).start()
    channel = grpc.insecure_channel(coordinator.address)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        a = stub.Join(pb.JoinRequest(name="a", num_examples=1), timeout=10)
        b = stub.Join(pb.JoinRequest(name="b", num_examples=1), timeout=10)
        infos = fleet.wait_for_clients(min_clients=2, timeout=timedelta(seconds=10))
        peers = tuple(i.client_id for i in infos)
        outcome = {}
        phase = threading.Thread(
            target=lambda: outcome.update(
                o=fleet.message_round(
                    server_round=1,
                    phase="keys",
                    assignments=[(i, MessageIns(round=1, phase="keys", peers=peers)) for i in infos],
                    timeout=timedelta(seconds=30),
                )
            )
        )
        phase.start()
        task = stub.PollTask(
            pb.PollRequest(client_id=a.client_id, wait_s=5),
            metadata=session_metadata(a.session_token),
            timeout=10,
        ).task
        assert (task.kind, task.phase, tuple(task.peers)) == (pb.MESSAGE, "keys", peers)

        def send(who, *envelopes, token=None, task_id=None):
            return stub.SendMessages(
                pb.SendMessagesRequest(
                    client_id=who.client_id, task_id=task_id or task.task_id, messages=list(envelopes)
                ),
                metadata=session_metadata(token or who.session_token),
                timeout=10,
            )

        def refused(code, words, *envelopes, **kw):
            snapshot = (dict(fleet.current_round.results), fleet.current_round.bytes_up)
            try:
                send(a, *envelopes, **kw)
            except grpc.RpcError as exc:
                assert exc.code() == code and words in exc.details(), (exc.code(), exc.details())
            else:
                raise AssertionError("accepted")
            assert (dict(fleet.current_round.results), fleet.current_round.bytes_up) == snapshot

        env = pb.Envelope
        refused(
            grpc.StatusCode.INVALID_ARGUMENT, "is not a peer of this phase", env(peer="nobody", payload=b"x")
        )
        refused(
            grpc.StatusCode.INVALID_ARGUMENT, "cannot address itself", env(peer=a.client_id, payload=b"x")
        )
        refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            "two messages to recipient",
            env(peer=b.client_id, payload=b"1"),
            env(peer=b.client_id, payload=b"2"),
        )
        refused(
            grpc.StatusCode.INVALID_ARGUMENT, "at most 65536", env(peer=b.client_id, payload=b"x" * 65537)
        )
        refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            "excludes messages to named peers",
            env(peer=TO_ALL, payload=b"x"),
            env(peer=b.client_id, payload=b"y"),
        )
        refused(
            grpc.StatusCode.UNAUTHENTICATED,
            "bad session token",
            env(peer=b.client_id, payload=b"x"),
            token="forged",
        )
        refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            "is not open",
            env(peer=b.client_id, payload=b"x"),
            task_id="other-task",
        )
        # Before the phase closes there is nothing to receive yet; then a's messages count once.
        early = stub.ReceiveMessages(
            pb.ReceiveMessagesRequest(client_id=a.client_id, task_id=task.task_id, wait_s=0),
            metadata=session_metadata(a.session_token),
            timeout=10,
        )
        assert not early.ready
        assert send(a, env(peer=b.client_id, payload=b"hello b")).bytes_accepted == 7
        refused(grpc.StatusCode.ALREADY_EXISTS, "already accepted", env(peer=b.client_id, payload=b"again"))
        # A model phase's RPCs are refused for a message task.
        with_download = None
        try:
            list(
                stub.DownloadModel(
                    pb.DownloadRequest(client_id=a.client_id, task_id=task.task_id),
                    metadata=session_metadata(a.session_token),
                    timeout=10,
                )
            )
        except grpc.RpcError as exc:
            with_download = (exc.code(), "has no model to download" in exc.details())
        assert with_download == (grpc.StatusCode.FAILED_PRECONDITION, True)
        send(b, env(peer=TO_ALL, payload=b"hi all"))
        phase.join(timeout=30)
        # The round may commit before its clients fetch the last phase's inboxes (a SecAgg+
        # round commits right after its unmask phase): they are kept until the next commit.
        fleet.committed(1)
        got = {}
        for who in (a, b):
            reply = stub.ReceiveMessages(
                pb.ReceiveMessagesRequest(client_id=who.client_id, task_id=task.task_id, wait_s=5),
                metadata=session_metadata(who.session_token),
                timeout=10,
            )
            got[who.client_id] = (reply.ready, reply.total, [(m.peer, m.payload) for m in reply.messages])
        assert got == {
            a.client_id: (True, 1, [(b.client_id, b"hi all")]),
            b.client_id: (True, 1, [(a.client_id, b"hello b")]),
        }
        assert [len(r.messages) for r in outcome["o"].results] == [1, 1] and outcome["o"].failures == []
        fleet.committed(2)  # the next round's commit: round 1's inboxes go
        try:
            stub.ReceiveMessages(
                pb.ReceiveMessagesRequest(client_id=a.client_id, task_id=task.task_id, wait_s=0),
                metadata=session_metadata(a.session_token),
                timeout=10,
            )
        except grpc.RpcError as exc:
            gone = (exc.code(), "is not a message phase of this round" in exc.details())
        assert gone == (grpc.StatusCode.FAILED_PRECONDITION, True)
    finally:
        channel.close()
        coordinator.stop(grace=0.5)
        fleet.close()
