"""The embedding session (``fedgrid.client.connect`` / ``aconnect``) in a host program that owns
its loop, against real coordinators over gRPC on port 0: whole runs (``fedgrid coordinator``'s
``serve`` in a thread, its events and final model read back) and single rounds driven on a
``RemoteFleet`` (its outcomes and membership read directly)."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from fedgrid.cli import serve
from fedgrid.client import EvaluateOutput, FitOutput, Task, aconnect, connect
from fedgrid.client.state import load_client_state
from fedgrid.config import load_config
from fedgrid.errors import SessionError
from fedgrid.events import Event
from fedgrid.runlog import load_model
from fedgrid.types import EVALUATE, FIT, TO_SERVER, FitIns, MessageIns

from harness import THREADS, InProcessCoordinator, wait_until

ROUNDS = 3
SHIFT = 0.25  # what the host's "training" adds to every weight: the final model is initial + ROUNDS * SHIFT
EXAMPLES = 40


class Run:
    """``fedgrid coordinator`` (``serve``) in a thread on port 0, its events collected as they happen."""

    def __init__(self, out: Path, **overrides: Any) -> None:
        self.out, self.events, self.result = out, [], {}  # type: ignore[var-annotated]
        config = load_config(
            overrides={
                "listen": "127.0.0.1:0",
                "out": str(out),
                "rounds": ROUNDS,
                "min_clients": 1,
                "threads": THREADS,
                "seed": 0,
                **overrides,
            }
        )
        self.thread = threading.Thread(
            target=lambda: self.result.setdefault("final", serve(config, on_event=self.events.append)),
            daemon=True,
        )
        self.thread.start()
        wait_until(
            lambda: (out / "address").exists() and (out / "address").read_text().strip() != "",
            timeout=60,
            what="the coordinator's address",
        )
        self.address = (out / "address").read_text().strip()

    def seen(self, name: str) -> list[Event]:
        return [e for e in list(self.events) if e.event == name]

    def finish(self) -> dict[str, torch.Tensor]:
        """Waits for the run to end; its final model."""
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the coordinator did not finish"
        return load_model(self.out / "model.safetensors")


def shifted(state) -> "OrderedDict[str, torch.Tensor]":  # type: ignore[no-untyped-def]
    """The host program's training: a known change to every floating tensor."""
    return OrderedDict((k, v + SHIFT if v.is_floating_point() else v.clone()) for k, v in state.items())


def check_run(run: Run, session, globals_seen: list[dict[str, torch.Tensor]], *, atol: float = 1e-6) -> None:  # type: ignore[no-untyped-def]
    """Three rounds, each starting from the last one's result; the Leave heard; the final model as
    computed (within ``atol``: a lossy uplink codec's error)."""
    final = run.finish()
    assert [int(e["round"]) for e in run.seen("round_committed")] == [1, 2, 3]
    assert [(e["client"], e["reason"]) for e in run.seen("client_left")] == [
        (session.client_id, "the host program closed the session")
    ]
    assert len(run.seen("client_joined")) == 1  # one registration, never a second
    assert (
        session.left == "the host program closed the session" and session.leave_heard and not session.finished
    )
    assert len(globals_seen) == ROUNDS
    initial = globals_seen[0]
    for r in range(1, ROUNDS):  # round r + 1 trains from round r's aggregate: the host's result
        for name, tensor in initial.items():
            torch.testing.assert_close(globals_seen[r][name], tensor + r * SHIFT, rtol=0, atol=atol)
    assert set(final) == set(initial)
    for name, tensor in initial.items():
        torch.testing.assert_close(final[name], tensor + ROUNDS * SHIFT, rtol=0, atol=atol)
        assert not torch.equal(final[name], tensor)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_session_in_a_host_loop_trains_three_rounds_and_leaves(tmp_path, codec):
    run = Run(tmp_path / "run", codec=codec)
    reports, globals_seen = [], []
    state_path = tmp_path / "session-state.pt"
    with connect(
        run.address, name="host", num_examples=EXAMPLES, on_task=reports.append, state_path=state_path
    ) as session:
        for task in session.tasks():
            assert (
                task.kind == FIT
                and task.ins.round == task.round
                and task.config.get("uplink_codec", "none") == codec
            )
            globals_seen.append(OrderedDict((k, v.clone()) for k, v in task.state.items()))
            report = session.submit(
                FitOutput(shifted(task.state), num_examples=EXAMPLES, metrics={"loss": 1.0 / task.round})
            )
            assert report is not None and report.round == task.round
            if task.round == ROUNDS:  # the host program decides it has trained enough
                break
    # int8: one step of 1/127 of the largest change at most, error feedback carrying the rest to the next round
    check_run(run, session, globals_seen, atol=1e-6 if codec == "none" else 2 * SHIFT / 127)
    raw = sum(t.numel() * t.element_size() for t in globals_seen[0].values())
    assert all(r.bytes_up > raw if codec == "none" else r.bytes_up < 0.3 * raw for r in reports), (
        raw,
        reports,
    )
    assert [(r.round, r.kind, r.num_examples, r.loss) for r in reports] == [
        (1, FIT, EXAMPLES, 1.0),
        (2, FIT, EXAMPLES, 0.5),
        (3, FIT, EXAMPLES, pytest.approx(1 / 3)),
    ]
    assert all(r.bytes_up > 0 and r.bytes_down > 0 for r in reports) and session.rounds == ROUNDS
    saved = load_client_state(state_path, name="host")  # the uplink's residuals, for a restarted host program
    assert (
        saved is not None
        and (saved["run_id"], saved["round"]) == (session.run_id, ROUNDS)
        and list(saved["uplink"]) == [codec]
    )
    accepted = run.seen("update_accepted")
    assert [(int(e["round"]), e["client"]) for e in accepted] == [(r, session.client_id) for r in (1, 2, 3)]


def test_an_async_session_trains_evaluates_and_leaves(tmp_path):
    run = Run(tmp_path / "run", fraction_evaluate=1.0)
    globals_seen: list[dict[str, torch.Tensor]] = []
    kinds: list[tuple[int, str]] = []
    threads: set[str] = set()

    async def host() -> Any:
        loop_thread = threading.current_thread().name
        async with aconnect(
            run.address,
            name="async-host",
            num_examples=EXAMPLES,
            poll_wait_s=2.0,
            on_task=lambda report: threads.add(threading.current_thread().name),
        ) as session:
            async for task in session.tasks():
                kinds.append((task.round, task.kind))
                if task.kind == EVALUATE:
                    await session.submit(
                        EvaluateOutput(num_examples=7, metrics={"loss": 0.5, "accuracy": 0.75})
                    )
                    if task.round == ROUNDS:
                        break
                    continue
                globals_seen.append(OrderedDict((k, v.clone()) for k, v in task.state.items()))
                await session.submit(
                    FitOutput(shifted(task.state), num_examples=EXAMPLES, metrics={"loss": 0.1})
                )
        assert loop_thread not in threads  # the blocking calls ran off the event loop
        return session.session

    async def main() -> Any:
        return await host()

    session = asyncio.run(main())
    check_run(run, session, globals_seen)
    assert kinds == [(r, k) for r in (1, 2, 3) for k in (FIT, EVALUATE)]
    assert [int(e["round"]) for e in run.seen("update_accepted") if e["evaluate"]] == [1, 2, 3]
    assert len(threads) == 1 and next(iter(threads)).startswith(
        "fedgrid-session"
    )  # one worker: calls keep their order


@pytest.mark.parametrize(
    "error", [ValueError("the host loop broke"), KeyboardInterrupt()], ids=["exception", "ctrl-c"]
)
def test_an_exception_inside_the_with_leaves_and_fails_the_open_task(small_state, error):
    server = InProcessCoordinator(small_state, heartbeat_s=60.0)  # silence would take minutes to notice
    errors: list[tuple[BaseException, Task | None]] = []
    reason = "ValueError: the host loop broke" if isinstance(error, ValueError) else "KeyboardInterrupt"
    try:
        with pytest.raises(type(error)):
            with connect(
                server.address,
                name="crashing",
                num_examples=3,
                on_error=lambda *, error, task: errors.append((error, task)),
            ) as session:
                wait_until(
                    lambda: len(server.fleet.live_clients()) == 1, timeout=30, what="the session to join"
                )
                server.open_round(timeout_s=120)
                for task in session.tasks():
                    assert task.round == 1
                    raise error
        outcome = server.wait_round(timeout=30)
        assert outcome.results == [] and outcome.closed_by == "all"  # at once, not by the 120 s deadline
        assert [f.reason for f in outcome.failures] == [f"client left: {reason}"]
        assert server.fleet.live_clients() == []
        assert session.left == reason and session.leave_heard
        assert [(e, t.round if t else None) for e, t in errors] == [(error, 1)]
        with pytest.raises(SessionError, match="open session"):
            next(iter(session.tasks()))
    finally:
        server.stop()


def test_failures_reported_through_the_session_are_the_rounds_failures(small_state):
    server = InProcessCoordinator(small_state, heartbeat_s=60.0)
    errors: list[tuple[str, int]] = []
    try:
        with connect(
            server.address,
            name="flaky",
            num_examples=3,
            on_error=lambda *, error, task: errors.append((type(error).__name__, task.round)),
        ) as session:
            wait_until(lambda: len(server.fleet.live_clients()) == 1, timeout=30, what="the session to join")
            tasks = session.tasks()
            reasons = []

            server.open_round(server_round=1, timeout_s=120)  # 1: the host says why it cannot train
            next(tasks)
            session.report_failure("CUDA out of memory on batch 3")
            reasons.append(server.wait_round(timeout=30))

            server.open_round(server_round=2, timeout_s=120)  # 2: training diverged
            task = next(tasks)
            diverged = shifted(task.state)
            diverged["layer.weight"][0, 0] = float("nan")
            assert session.submit(FitOutput(diverged, num_examples=3)) is None
            reasons.append(server.wait_round(timeout=30))

            server.open_round(server_round=3, timeout_s=120)  # 3: the host moves on without an answer
            assert next(tasks).round == 3
            got: list[Task] = []
            asker = threading.Thread(target=lambda: got.append(next(tasks)), daemon=True)
            asker.start()  # asks for the next task: round 3's is reported failed, then it waits for round 4
            reasons.append(server.wait_round(timeout=30))

            server.open_round(server_round=4, timeout_s=120)  # 4: a result
            asker.join(timeout=30)
            assert [t.round for t in got] == [4]
            with pytest.raises(TypeError, match="round 4's fit task takes a FitOutput, got EvaluateOutput"):
                session.submit(EvaluateOutput(num_examples=3))
            with pytest.raises(ValueError, match="claims 9 examples, the session reported 3 at join"):
                session.submit(FitOutput(shifted(got[0].state), num_examples=9))
            assert (
                session.submit(FitOutput(shifted(got[0].state), num_examples=3)) is not None
            )  # still open after both
            fourth = server.wait_round(timeout=30)
            with pytest.raises(SessionError, match="no task is open"):
                session.submit(FitOutput(shifted(got[0].state), num_examples=3))
    finally:
        server.stop()
    assert [[f.reason for f in o.failures] for o in reasons] == [
        ["client reported: CUDA out of memory on batch 3"],
        ["client reported: InvalidUpdateError: tensor 'layer.weight': contains NaN"],
        ["client reported: the host program asked for the next task without answering round 3's fit task"],
    ]
    assert all(o.results == [] and o.closed_by == "all" for o in reasons)
    assert errors == [("InvalidUpdateError", 2), ("SessionError", 3)]
    assert [r.client.name for r in fourth.results] == ["flaky"] and fourth.failures == []
    for name, tensor in small_state.items():
        torch.testing.assert_close(
            fourth.results[0].state[name],
            tensor + SHIFT if tensor.is_floating_point() else tensor,
            rtol=0,
            atol=0,
        )


def test_a_session_in_a_background_thread_runs_to_the_end_of_the_run(tmp_path):
    run = Run(tmp_path / "run")
    box: dict[str, Any] = {}

    def host() -> None:
        try:
            with connect(run.address, name="worker-thread", num_examples=EXAMPLES) as session:
                box["session"] = session
                for task in session.tasks():  # ends when the coordinator says the run is over
                    session.submit(FitOutput(shifted(task.state), num_examples=EXAMPLES))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            box["error"] = exc

    thread = threading.Thread(target=host, name="host-loop", daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    session = box["session"]
    run.finish()
    assert session.finished and session.rounds == ROUNDS
    assert session.left is None and run.seen("client_left") == []  # the run ended it: no Leave owed
    assert [int(e["round"]) for e in run.seen("round_committed")] == [1, 2, 3]


def test_close_from_another_thread_ends_a_long_poll_and_leaves(small_state):
    server = InProcessCoordinator(small_state, heartbeat_s=60.0)
    box: dict[str, Any] = {}
    try:
        session = connect(server.address, name="stopped", num_examples=3, poll_wait_s=60.0)

        def host() -> None:
            try:
                with session:
                    box["tasks"] = list(session.tasks())  # blocks in a 60 s long poll: no round opens
            except BaseException as exc:  # noqa: BLE001 - asserted below
                box["error"] = exc

        thread = threading.Thread(target=host, daemon=True)
        thread.start()
        wait_until(
            lambda: server.fleet.polls_held(session.client_id) == 1 if session.client_id else False,
            timeout=30,
            what="the session's long poll",
        )
        session.close("the operator stopped the site")
        thread.join(timeout=15)  # far less than the poll's 60 s
        assert not thread.is_alive() and box == {"tasks": []}, box
        assert (
            server.fleet.live_clients() == []
            and session.left == "the operator stopped the site"
            and session.leave_heard
        )
    finally:
        server.stop()


class Echo:
    """A message handler: sends its phase's name to the coordinator."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, bytes]]] = []

    def exchange(self, ins: MessageIns) -> dict[str, bytes]:
        return {TO_SERVER: f"hello from {ins.phase}".encode()}

    def receive(self, ins: MessageIns, inbox) -> None:  # type: ignore[no-untyped-def]
        self.received.append((ins.phase, dict(inbox)))


@pytest.mark.parametrize("handler", [None, Echo()], ids=["refused", "handled"])
def test_message_phases_go_to_the_handler_or_are_refused_naming_the_phase(small_state, handler):
    from datetime import timedelta

    server = InProcessCoordinator(small_state, heartbeat_s=60.0)
    try:
        with connect(
            server.address, name="messenger", num_examples=3, poll_wait_s=2.0, messages=handler
        ) as session:
            waiting = threading.Thread(target=lambda: list(session.tasks()), daemon=True)
            waiting.start()  # message phases are run inside tasks(), never handed to the loop
            info = server.fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=30))[0]
            outcome = server.fleet.message_round(
                server_round=1,
                phase="advertise-keys",
                timeout=timedelta(seconds=60),
                assignments=[(info, MessageIns(round=1, phase="advertise-keys", peers=(info.client_id,)))],
            )
            if handler is None:
                assert outcome.results == [] and [f.reason for f in outcome.failures] == [
                    "client reported: NotImplementedError: this session has no handler for message phase 'advertise-keys': "
                    "pass connect(..., messages=...) an object with exchange() and receive()"
                ]
            else:
                assert [dict(r.messages) for r in outcome.results] == [
                    {TO_SERVER: b"hello from advertise-keys"}
                ]
                assert outcome.failures == []
                wait_until(
                    lambda: handler.received == [("advertise-keys", {})],
                    timeout=30,
                    what="the phase's (empty) inbox",
                )
        waiting.join(timeout=15)
        assert not waiting.is_alive() and server.fleet.live_clients() == []
    finally:
        server.stop()


def test_a_closed_session_refuses_use_and_a_bad_address_is_named():
    with pytest.raises(ValueError, match="has no port"):
        connect("localhost")
    session = connect("127.0.0.1:1", name="never")
    with pytest.raises(SessionError, match="open session"):
        next(iter(session.tasks()))
    session.close()
    with pytest.raises(SessionError, match="opens once"):
        session.open()
    assert session.left is None  # never joined: nothing to leave


def test_a_session_under_mutual_tls_is_its_certificates_identity(tmp_path, small_state):
    from datetime import timedelta

    from fedgrid.ops import pki
    from fedgrid.proto.tls import TLSFiles
    from fedgrid.server.remote_fleet import RemoteFleet
    from fedgrid.server.serve import Coordinator

    pki.init_ca(tmp_path)
    pki.issue(tmp_path, "coordinator", server=True)  # SANs localhost, 127.0.0.1
    pki.issue(tmp_path, "hospital-7")
    fleet = RemoteFleet(heartbeat_interval=timedelta(seconds=60))
    tls = TLSFiles(
        str(tmp_path / "ca.pem"), str(tmp_path / "coordinator.pem"), str(tmp_path / "coordinator.key")
    )
    coordinator = Coordinator("127.0.0.1:0", fleet, max_workers=4, tls=tls).start()
    outcome: list = []
    try:
        port = coordinator.address.rpartition(":")[2]
        with connect(
            f"127.0.0.1:{port}",
            name="ignored",
            num_examples=3,
            ca=str(tmp_path / "ca.pem"),
            cert=str(tmp_path / "hospital-7.pem"),
            key=str(tmp_path / "hospital-7.key"),
            server_name="localhost",
        ) as session:
            [info] = fleet.wait_for_clients(min_clients=1, timeout=timedelta(seconds=30))
            assert info.name == "hospital-7"  # the certificate names it, not name=
            rnd = threading.Thread(
                target=lambda: outcome.append(
                    fleet.fit_round(
                        server_round=1,
                        global_state=small_state,
                        assignments=[(info, FitIns(round=1))],
                        timeout=timedelta(seconds=60),
                    )
                )
            )
            rnd.start()
            task = next(iter(session.tasks()))
            assert session.submit(FitOutput(shifted(task.state), num_examples=3)) is not None
            rnd.join(timeout=30)
        assert [r.client.name for r in outcome[0].results] == ["hospital-7"]
        torch.testing.assert_close(
            outcome[0].results[0].state["layer.weight"], small_state["layer.weight"] + SHIFT, rtol=0, atol=0
        )
        assert session.leave_heard and fleet.live_clients() == []
        with pytest.raises(ValueError, match="session TLS: ca, cert and key go together; missing cert, key"):
            connect(coordinator.address, ca=str(tmp_path / "ca.pem"))
    finally:
        coordinator.stop(grace=0.5)
        fleet.close()


def test_an_async_session_reports_failures_and_leaves_on_an_exception(small_state):
    server = InProcessCoordinator(small_state, heartbeat_s=60.0)

    async def host() -> None:
        async with aconnect(server.address, name="async-flaky", num_examples=3, poll_wait_s=2.0) as session:
            await asyncio.to_thread(
                wait_until,
                lambda: len(server.fleet.live_clients()) == 1,
                timeout=30,
                what="the session to join",
            )
            await asyncio.to_thread(server.open_round, server_round=1, timeout_s=120)
            async for task in session.tasks():
                if task.round == 1:
                    await session.report_failure(MemoryError("batch of 512 does not fit"))
                    first.append(await asyncio.to_thread(server.wait_round, 30))
                    await asyncio.to_thread(server.open_round, server_round=2, timeout_s=120)
                    continue
                raise RuntimeError(f"the host's data pipeline broke in round {task.round}")

    first: list = []
    with pytest.raises(RuntimeError, match="data pipeline broke in round 2"):
        asyncio.run(host())
    try:
        second = server.wait_round(timeout=30)
        assert [[f.reason for f in o.failures] for o in (first[0], second)] == [
            ["client reported: MemoryError: batch of 512 does not fit"],
            ["client left: RuntimeError: the host's data pipeline broke in round 2"],
        ]
        assert all(o.results == [] and o.closed_by == "all" for o in (first[0], second))
        assert server.fleet.live_clients() == []
    finally:
        server.stop()


def test_a_host_overlaps_its_sync_with_submit_nowait(tmp_path):
    """Overlapped DiLoCo in a host loop: the result goes out and the next task comes in while
    the host trains on; at its merge step it waits on the handle, then takes that task."""
    run = Run(tmp_path / "run")
    globals_seen, reports = [], []
    with connect(run.address, name="host", num_examples=EXAMPLES) as session:
        for task in session.tasks():
            globals_seen.append(OrderedDict((k, v.clone()) for k, v in task.state.items()))
            sync = session.submit_nowait(
                FitOutput(shifted(task.state), num_examples=EXAMPLES, metrics={"loss": 1.0})
            )
            with pytest.raises(SessionError, match="no task is open"):
                session.submit(FitOutput(task.state, num_examples=EXAMPLES))  # answered already
            reports.append(sync.wait(timeout=60))  # the host's tau steps would run before this
            assert sync.done() and sync.waited_s >= 0
            assert sync.next_round == (task.round + 1 if task.round < ROUNDS else None)
    assert [r.round for r in reports if r is not None] == [1, 2, 3] and session.finished
    final = run.finish()
    for name, tensor in globals_seen[0].items():
        torch.testing.assert_close(final[name], tensor + ROUNDS * SHIFT, rtol=0, atol=1e-6)
