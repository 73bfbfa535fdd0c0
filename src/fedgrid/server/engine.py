"""The round engine: one loop for every strategy and every fleet.

Each round: wait for enough live clients, let the strategy choose clients and tasks, run
them on the fleet, let the strategy aggregate results and failures, evaluate, then commit:
checkpoint (with a ``StateStore``), SQLite history, ``metrics.jsonl``. A round is either
committed whole or redone whole after a restart, so none is applied twice.

The server-side evaluation (``evaluate_fn``) of a coordinator runs beside the next round on a
snapshot of the model (``server/evaluation.py``, ``eval_in_background``); its loss and metrics
land in the row of the round they measure when they are ready: that row of the history is
replaced and ``metrics.jsonl`` rewritten with it (the next checkpoint's history holds it too).
A stop abandons an evaluation still running; the last round's is waited for before the run ends.

A round can fail instead (``server/round_failures.py``). One whose new strategy state holds
NaN or Inf (``NonFiniteAggregateError``: finite updates can still overflow) goes back to the
state it began with, writes no checkpoint, is emitted as ``round_failed`` and recorded with
``round_failed: 1``, and the run goes on. One whose results were all lost (with
``round_retries``: its clients or regions died, left or went silent) goes back the same way,
emits ``round_failed`` with the reason, and runs again under the same number, never committed
empty. A disk that refuses a commit (``StorageError``) stops the run; the last good
checkpoint stays. The state a round goes back to waits on disk (``server/rollback.py``), and
the NaN check and the checkpoint read the strategy's own tensors (``Strategy.state_view``), so
a round holds no second copy of the model (issue 40).

Whatever the strategy, a round's metrics hold its workers' goodput
(``fedgrid.telemetry``: seconds of compute, felt communication and waiting summed
over its fit results, and their utilization).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fedgrid.aggregation.base import Strategy
from fedgrid.aggregation.updates import as_model
from fedgrid.errors import (
    ConfigError,
    InterruptedRunError,
    NonFiniteAggregateError,
    PrivacyBudgetError,
    RoundLostError,
    StorageError,
)
from fedgrid.events import EventLog
from fedgrid.fleet.base import Fleet, Quorum, RoundOutcome
from fedgrid.server.disk import storage_errors
from fedgrid.server.evaluation import Evaluator
from fedgrid.server.late_merge import late_to_merge
from fedgrid.server.parts import RoundRules, RunIO, Schedule
from fedgrid.server.privacy import restore_privacy
from fedgrid.server.rollback import RollbackPoint
from fedgrid.server.round_failures import ROUND_FAILED, LostRounds, check_not_lost, first_non_finite
from fedgrid.telemetry import goodput_metrics
from fedgrid.textsafe import escape
from fedgrid.types import EVALUATE, FIT, ClientInfo, FitRes, ModelState, RoundMetrics, check_phase_name

__all__ = [
    "RoundEngine",
    "ROUND_FAILED",
    "first_non_finite",
]  # the last two: server/round_failures.py


@dataclass
class _Tally:
    """What a round's phases add up to, for its ``RoundMetrics``."""

    loss: float | None = None
    accuracy: float | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    clients_ok: int = 0
    clients_failed: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def add_bytes(self, outcome: RoundOutcome) -> None:  # type: ignore[type-arg]
        self.bytes_up += outcome.bytes_up
        self.bytes_down += outcome.bytes_down

    def add_fit(self, outcome: RoundOutcome[FitRes], *, late: int | None) -> None:
        """A fit phase's counts; ``late``: the late results merged (a quorum's round), else ``None``."""
        # Every strategy's rounds: the workers' seconds are sums, not a strategy's weighted means.
        self.extra.update(goodput_metrics(outcome.results))
        self.extra.update(outcome.extra)
        if outcome.cancelled:
            self.extra["clients_cancelled"] = len(outcome.cancelled)
        if late is not None:
            self.extra["late_merged"] = float(late)
            self.extra["clients_waiting"] = float(len(outcome.waiting))
        self.add_bytes(outcome)
        self.clients_ok, self.clients_failed = len(outcome.results), len(outcome.failures)
        # The examples trained on: a region's weight upstream.
        self.extra["examples"] = float(sum(r.num_examples for r in outcome.results))
        # Regions (fedgrid.region) report their LAN links' bytes: summed, not averaged.
        for r in outcome.results:
            for key in ("lan_bytes_up", "lan_bytes_down"):
                if key in r.metrics and r.client.region:
                    for name in (key, f"{key}.{r.client.region}"):
                        self.extra[name] = self.extra.get(name, 0.0) + float(r.metrics[key])


log = logging.getLogger(__name__)


class RoundEngine:
    """Drives ``schedule.rounds`` rounds of ``strategy`` on ``fleet``.

    Args:
        strategy: decides tasks and aggregation; ``initialize`` already called.
        fleet: reaches the clients.
        schedule: how many rounds, when a round may start, how long it may take (``Schedule``).
        rules: quorum, influence caps and privacy of the fit rounds (``RoundRules``;
            ``build_parts`` builds them from a ``Config``). Default: every round waits for all,
            influence caps on, no privacy.
        io: server-side evaluation, the run directory, the round callback, durable state,
            events and the stop signal (``RunIO``). Default: none of them.
    """

    def __init__(
        self,
        *,
        strategy: Strategy,
        fleet: Fleet,
        schedule: Schedule,
        rules: RoundRules = RoundRules(),
        io: RunIO = RunIO(),
    ) -> None:
        self.strategy = strategy
        self.influence = rules.influence
        self.privacy = rules.privacy
        self.quorum = rules.quorum
        self.fleet = fleet
        self.rounds = schedule.rounds
        self.min_clients = schedule.min_clients
        self.round_timeout = schedule.round_timeout
        self.join_timeout = schedule.join_timeout
        if schedule.eval_every < 1:
            raise ValueError(f"eval_every must be at least 1, got {schedule.eval_every}")
        self.evaluate_fn = io.evaluate_fn
        self.eval_every = schedule.eval_every
        self.events = io.events if io.events is not None else EventLog()
        self.evaluator = (
            None
            if io.evaluate_fn is None
            else Evaluator(
                io.evaluate_fn, self._land_eval, background=io.eval_in_background, events=self.events
            )
        )
        # Guards the history and metrics.jsonl: an evaluation lands on its own thread.
        self._rows = threading.Lock()
        self._eval_pending: dict[int, tuple[float, dict[str, float]]] = {}
        # Rounds whose background evaluation has not landed: their rows reach the trackers when it
        # does (one point per round and figure; an abandoned or failed evaluation leaves none).
        self._eval_running: set[int] = set()
        self.writer = io.writer
        self.on_round = io.on_round
        self.finish_timeout = schedule.finish_timeout
        self.store = io.store
        self.history: list[RoundMetrics] = []
        self.lost_rounds = LostRounds(schedule.round_retries, fleet, self.events)
        self._stop = threading.Event()
        # Set from outside (``io.stop``): the run ends before its next round, the open one finishes.
        self._finish_early = io.stop if io.stop is not None else threading.Event()
        self._first: int | None = None

    def stop(self) -> None:
        """Abandons the open round (to be redone on restart) and ends ``run`` without finishing the run."""
        self._stop.set()
        self.fleet.interrupt()

    def resume(self) -> int:
        """Loads the last committed round, if any (once: ``run`` calls it when nobody did);
        returns the first round to run. A coordinator calls it before it serves, so that
        the run id it prints and hands to joining clients is the restored one."""
        if self._first is None:
            self._first = self._resume()
        return self._first

    def _resume(self) -> int:
        if self.store is None:
            return 1
        ckpt = self.store.load_latest()
        if ckpt is None:
            return 1
        self.strategy.load_state_dict(ckpt.strategy)
        self.fleet.load_state_dict(ckpt.fleet)
        restore_privacy(self.privacy, ckpt.privacy, ckpt.path.name)  # a budget is never reset
        self.influence.load_state_dict(ckpt.influence)
        self.history = [RoundMetrics.from_json(m) for m in ckpt.history]
        self.store.sync_history(ckpt.history)
        log.info("resuming after round %d (checkpoint %s)", ckpt.round, ckpt.path.name)
        self.events.emit("resumed", round=ckpt.round)
        return ckpt.round + 1

    def commit(self, metrics: RoundMetrics) -> None:
        """Makes the round of ``metrics`` durable and visible: checkpoint (with a store),
        history, ``metrics.jsonl``, ``on_round``. ``run_round`` then ``commit`` is one round;
        ``run`` is the driver that loops them (a regional coordinator drives its own).

        A failed round (``ROUND_FAILED`` in its metrics) goes to the history and metrics but
        writes no checkpoint, and emits ``round_failed`` instead of ``round_committed``.

        Raises:
            StorageError: the disk refused the checkpoint, the journal or ``metrics.jsonl``
                (``server/disk.py``); the last good checkpoint stays."""
        failed = bool(metrics.extra.get(ROUND_FAILED))
        with self._rows:
            landed = self._eval_pending.pop(metrics.round, None)
            if landed is not None:  # its evaluation finished before the round committed
                metrics = _with_eval(metrics, *landed)
            self.history.append(metrics)
            with storage_errors(self.writer.dir if self.writer is not None else "the run directory"):
                self._commit_files(metrics, failed)
        if failed:
            self.events.emit("round_failed", round=metrics.round, reason="non-finite aggregate")
        else:
            self.events.emit("round_committed", round=metrics.round)
        if self.on_round is not None:
            self.on_round(metrics)

    def _commit_files(self, metrics: RoundMetrics, failed: bool) -> None:
        """The checkpoint (not of a failed round), then the fleet's cleanup, then ``metrics.jsonl``."""
        if self.store is not None and not failed:
            self.events.emit("checkpoint_writing", round=metrics.round)
            self.store.save(
                server_round=metrics.round,
                strategy=self.strategy.state_view(),  # written out as the strategy holds it, no copy
                fleet=self.fleet.state_dict(),
                history=[m.to_json() for m in self.history],
                privacy=self.privacy.state_dict() if self.privacy is not None else None,
                influence=self.influence.state_dict(),
            )
            self.events.emit("checkpoint_written", round=metrics.round)
        self.fleet.committed(metrics.round)
        if self.writer is not None:
            self.writer.write_round(metrics, track=metrics.round not in self._eval_running)

    def run_round(self, server_round: int) -> RoundMetrics:
        """Runs one round, the phases the strategy declares in order (``Strategy.phases``:
        fit, evaluate, message phases), up to, not including, its commit.

        Raises:
            InterruptedRunError: ``stop`` was called; nothing of the round was applied.
            RoundLostError: (with ``round_retries``) every result of its fit phase was lost;
                nothing of the round was applied.
            StorageError: the fleet's disk refused an update; nothing of the round was applied.
            ValueError: the strategy declared an invalid or repeated phase name.
        """
        start = time.monotonic()
        phases = [check_phase_name(p) for p in self.strategy.phases(server_round=server_round)]
        if len(set(phases)) != len(phases):
            raise ValueError(f"round {server_round}: the strategy declared a phase twice: {phases}")
        clients = self.fleet.wait_for_clients(min_clients=self.min_clients, timeout=self.join_timeout)
        tally = _Tally()
        # What a failed or abandoned round goes back to: on disk, not a second model in memory.
        with RollbackPoint(self.strategy, self.store.dir if self.store is not None else None) as before:
            try:
                for phase in phases:
                    if phase == FIT:
                        self._fit(server_round, clients, tally)
                    elif phase == EVALUATE:
                        self._evaluate(server_round, clients, tally)
                    else:
                        self._messages(server_round, phase, clients, tally)
                    # The model first, before a later phase sends it to clients ...
                    self._check_finite(server_round, phase, self.strategy.global_state)
                # ... then everything the checkpoint would hold (optimizer moments overflow too),
                # as the strategy holds it (no copy).
                self._check_finite(server_round, "the end of the round", self.strategy.state_view())
            except (InterruptedRunError, RoundLostError, StorageError, PrivacyBudgetError):
                # Stopped, lost or refused after a phase had aggregated (fit, before evaluate): the
                # state in memory goes back to the committed one, which a graceful stop writes out.
                before.restore(self.strategy)
                raise
            except NonFiniteAggregateError as exc:
                before.restore(self.strategy)
                log.error("%s; the previous global model is kept and the run goes on", exc)
                tally.extra[ROUND_FAILED] = 1.0
            evaluates = server_round % self.eval_every == 0 or server_round >= self.rounds
            metrics = RoundMetrics(
                round=server_round,
                loss=tally.loss,
                accuracy=tally.accuracy,
                bytes_up=tally.bytes_up,
                bytes_down=tally.bytes_down,
                wall_s=time.monotonic() - start,
                clients_ok=tally.clients_ok,
                clients_failed=tally.clients_failed,
                extra=tally.extra,
            )
            if self.evaluator is not None and evaluates:  # a central test set, when the task has one, wins
                if self.evaluator.background:
                    with self._rows:
                        self._eval_running.add(server_round)
                try:
                    self.evaluator.submit(server_round, self.strategy.global_state, stop=self._stop)
                except InterruptedRunError:  # an inline evaluation given up: the round is abandoned
                    before.restore(self.strategy)
                    raise
        if self.evaluator is not None and evaluates and not self.evaluator.background:
            with self._rows:
                landed = self._eval_pending.pop(server_round, None)
            if landed is not None:
                metrics = _with_eval(metrics, *landed)
        return metrics

    def _land_eval(self, server_round: int, loss: float, metrics: dict[str, float]) -> None:
        """An evaluation's figures into the row of the round they measure: the committed row is
        replaced (and ``metrics.jsonl`` rewritten), or they wait for its commit."""
        with self._rows:
            self._eval_running.discard(server_round)
            at = next((i for i, m in enumerate(self.history) if m.round == server_round), None)
            if at is None:
                self._eval_pending[server_round] = (loss, metrics)
                return
            self.history[at] = _with_eval(self.history[at], loss, metrics)
            if self.writer is not None:
                try:
                    with storage_errors(self.writer.dir):
                        self.writer.update_round(self.history[at], [m.to_json() for m in self.history])
                except StorageError as exc:  # the row keeps its figures in memory and the next checkpoint
                    log.warning("round %d: its evaluation could not be written: %s", server_round, exc)
        log.info("round %d: evaluated: loss %.4g%s", server_round, loss, _accuracy_text(metrics))

    def play_round(self, server_round: int) -> RoundMetrics:
        """``run_round``, run again under the same number while all its results are lost (at most
        ``round_retries`` times in a row; ``server/round_failures.py``), not yet committed.

        Raises:
            RoundLostError: lost more than ``round_retries`` times in a row.
            InterruptedRunError, StorageError: as ``run_round``.
        """
        return self.lost_rounds.run(self.run_round, server_round)

    @staticmethod
    def _check_finite(server_round: int, phase: str, state: Any) -> None:
        bad = first_non_finite(state)
        if bad is not None:
            raise NonFiniteAggregateError(
                f"round {server_round} failed: after {phase}, the strategy state's {bad} holds NaN or Inf"
            )

    def _check_stop(self, server_round: int) -> None:
        if self._stop.is_set():
            raise InterruptedRunError(f"round {server_round} abandoned: the coordinator is stopping")

    def _fit(self, server_round: int, clients: list[ClientInfo], tally: "_Tally") -> None:
        assignments = self.strategy.configure_round(server_round=server_round, clients=clients)
        # What the clients download: e.g. SCAFFOLD adds its control variate.
        sent = self.strategy.downlink_state(server_round=server_round)
        quorum: dict[str, Quorum] = {}
        if self.quorum is not None:
            self._check_quorum(server_round, len(assignments), len(clients))
            quorum = {"quorum": self.quorum}
        if self.privacy is not None:  # stops the run before a round over budget is run
            self.privacy.check_budget(server_round, selected=len(assignments), live=len(clients))
        outcome = self.fleet.fit_round(
            server_round=server_round,
            global_state=sent,
            assignments=assignments,
            timeout=self.round_timeout,
            target=self.strategy.round_target(num_live=len(clients), num_assigned=len(assignments)),
            **quorum,
        )
        self._check_stop(server_round)
        if self.lost_rounds.retries:  # nothing came back: the round runs again (server/round_failures.py)
            check_not_lost(server_round, outcome, assigned=len(assignments), late=len(outcome.late))
        # (Updates that came back and are refused below are their clients' failures, not a loss.)
        outcome = self.influence.bound(server_round, outcome, sent, events=self.events)
        self._report_fit(server_round, outcome)
        late = self._late(server_round, outcome) if self.quorum is not None else []
        results = outcome.results + late
        if self.privacy is not None:  # clipped and noised after the influence caps (server/privacy.py)
            results, dp_metrics = self.privacy.apply(server_round, results, sent, live=len(clients))
            tally.extra.update(dp_metrics)
        if not getattr(self.strategy, "accepts_deltas", False):
            # It reads results as models (docs/updates.rst); a late one: current + its difference.
            results = [as_model(sent, r) for r in results]
        agg_metrics = self.strategy.aggregate(
            server_round=server_round, results=results, failures=outcome.failures
        )
        tally.loss = agg_metrics.get("train_loss")
        tally.extra.update(agg_metrics)
        tally.add_fit(outcome, late=len(late) if self.quorum is not None else None)

    def _report_fit(self, server_round: int, outcome: RoundOutcome[FitRes]) -> None:
        """Logs a closed fit phase's failures and what goes to aggregation; emits ``aggregating``."""
        for failure in outcome.failures:
            log.warning(
                "round %d: client %s failed: %s",
                server_round,
                escape(failure.client.name or failure.client.client_id),
                escape(failure.reason),
            )
        log.info(
            "round %d: aggregating %d updates (%d failures)",
            server_round,
            len(outcome.results),
            len(outcome.failures),
        )
        self.events.emit(
            "aggregating", round=server_round, updates=len(outcome.results), failures=len(outcome.failures)
        )

    def _check_quorum(self, server_round: int, selected: int, live: int) -> None:
        """A quorum larger than the first round's selection can never be reached (later
        rounds may select fewer: clients still on a late task are not selected).

        Raises:
            ConfigError: naming both numbers and the keys that set them.
        """
        assert self.quorum is not None
        if server_round == self.resume() and self.quorum.min_quorum > selected:
            raise ConfigError(
                "min_quorum",
                f"a quorum of {self.quorum.min_quorum} is larger than round {server_round}'s selection "
                f"of {selected} clients (fraction_fit / min_fit_clients / clients_per_round of "
                f"{live} selectable clients): lower min_quorum or select more clients",
            )

    def _late(self, server_round: int, outcome: RoundOutcome[FitRes]) -> list[FitRes]:
        """The late results to merge into ``server_round`` (``server/late_merge.py``)."""
        assert self.quorum is not None
        return late_to_merge(self.quorum, server_round, outcome, self.events)

    def _evaluate(self, server_round: int, clients: list[ClientInfo], tally: "_Tally") -> None:
        evaluations = self.strategy.configure_evaluate(server_round=server_round, clients=clients)
        if not evaluations:
            return
        evaluated = self.fleet.evaluate_round(
            server_round=server_round,
            global_state=self.strategy.global_state,
            assignments=evaluations,
            timeout=self.round_timeout,
        )
        self._check_stop(server_round)
        fed = self.strategy.aggregate_evaluate(
            server_round=server_round, results=evaluated.results, failures=evaluated.failures
        )
        tally.extra.update({f"federated_{k}": v for k, v in fed.items()})
        tally.extra["clients_evaluated"] = len(evaluated.results)
        tally.add_bytes(evaluated)
        tally.loss, tally.accuracy = fed.get("loss", tally.loss), fed.get("accuracy")

    def _messages(self, server_round: int, phase: str, clients: list[ClientInfo], tally: "_Tally") -> None:
        assignments = self.strategy.configure_messages(
            server_round=server_round, phase=phase, clients=clients
        )
        outcome = self.fleet.message_round(
            server_round=server_round, phase=phase, assignments=assignments, timeout=self.round_timeout
        )
        self._check_stop(server_round)
        for failure in outcome.failures:
            log.warning(
                "round %d, phase %s: client %s failed: %s",
                server_round,
                phase,
                escape(failure.client.name or failure.client.client_id),
                escape(failure.reason),
            )
        metrics = self.strategy.receive_messages(
            server_round=server_round, phase=phase, results=outcome.results, failures=outcome.failures
        )
        tally.extra.update(metrics)
        tally.extra[f"{phase}_ok"] = len(outcome.results)
        tally.extra[f"{phase}_failed"] = len(outcome.failures)
        tally.extra[f"{phase}_bytes_up"] = outcome.bytes_up
        tally.extra[f"{phase}_bytes_down"] = outcome.bytes_down
        tally.add_bytes(outcome)

    def run(self) -> ModelState | None:
        """Runs the remaining rounds, tells clients the run ended, writes the final model.

        Returns the final model, or ``None`` when ``stop`` interrupted the run (the state
        of the last committed round stays on disk for a restart, and the model of that
        round, when there is one, is written to the run directory all the same).
        """
        first = self.resume()
        if self.writer is not None:
            with storage_errors(self.writer.dir):
                self.writer.reset_metrics([m.to_json() for m in self.history])
        server_round = first
        try:
            for server_round in range(first, self.rounds + 1):
                if self._stop.is_set() or self._finish_early.is_set():
                    self._stopped()
                    return None
                self.commit(self.play_round(server_round))
        except InterruptedRunError as exc:
            log.info("%s", exc)
            self._stopped()
            return None
        except PrivacyBudgetError as exc:  # the run is over: its last committed round is final
            log.warning("%s", exc)
            self.events.emit("privacy_budget_reached", round=server_round, reason=str(exc))
        except StorageError as exc:
            # One line (the caller's): the path and the free space. Clients hear UNAVAILABLE and
            # retry; the last good checkpoint stays, and a restart resumes from it.
            self.events.emit("round_failed", round=server_round, reason=str(exc), retry=False)
            self.fleet.interrupt()
            raise
        if self.evaluator is not None and not self.evaluator.wait(self._stop):  # the last round's figures
            self._stopped()
            return None
        self.fleet.finish(timeout=self.finish_timeout)
        if self.writer is not None:
            self.writer.write_model(self.strategy.global_state)
        self.events.emit("finished", rounds=self.rounds)
        return self.strategy.global_state

    def _stopped(self) -> None:
        """A stopped run leaves the model of its last committed round in the run directory."""
        if self.writer is not None and self.history:
            self.writer.write_model(self.strategy.global_state)


def _with_eval(row: RoundMetrics, loss: float, metrics: dict[str, float]) -> RoundMetrics:
    """``row`` with a server-side evaluation's figures: its loss, accuracy and other metrics."""
    return dataclasses.replace(
        row,
        loss=loss,
        accuracy=metrics.get("accuracy"),
        extra={**row.extra, **{k: v for k, v in metrics.items() if k != "accuracy"}},
    )


def _accuracy_text(metrics: dict[str, float]) -> str:
    accuracy = metrics.get("accuracy")
    return "" if accuracy is None else f", accuracy {accuracy:.4f}"
