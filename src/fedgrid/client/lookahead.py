"""Overlapped DiLoCo's steps after an upload (``ClientAlgorithm.lookahead``, tau), as a mixin of
the trainer (``TorchClient``): they train in a background thread while the runtime uploads, polls
and downloads, the next fit waits for them and counts them, and every such thread is stopped and
joined at interpreter exit."""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol

import torch

from fedgrid.client.algorithm_hooks import ClientAlgorithm, FitContext, Trainer
from fedgrid.client.algorithm_math import train_only
from fedgrid.client.timeline import COMPUTE, Timeline
from fedgrid.seeding import derive_seed
from fedgrid.types import FitIns, ModelState

__all__ = ["LookaheadMixin"]


@dataclass(eq=False)
class _Lookahead:
    """The steps a client trains after an upload (``ClientAlgorithm.lookahead``) and what they gave.

    Attributes:
        algorithm: the algorithm of the task whose upload they follow.
        round: that task's round.
        steps: the steps asked for.
        seen: examples they trained on.
        loss_sum: the sum of their example losses.
        compute_s: seconds they took.
        state: the state they reached, until handed to the algorithm's ``resume``.
        error: what they raised, if they failed.
        thread: the background thread running them, until joined.
        stop: set at interpreter exit: the steps end at the next step's start.
    """

    algorithm: str
    round: int
    steps: int
    seen: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    state: ModelState | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)


#: Lookaheads training in background threads now. At interpreter exit each stops at its next
#: step and is joined: a daemon thread still inside torch's C++ code while the interpreter
#: finalizes aborts the process ("terminate called without an active exception").
_RUNNING: set[_Lookahead] = set()
_RUNNING_LOCK = threading.Lock()


@atexit.register
def _stop_lookaheads() -> None:
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for job in running:
        job.stop.set()
    for job in running:
        thread = job.thread
        if thread is not None:
            thread.join(timeout=30.0)


class _Host(Trainer, Protocol):
    """What ``LookaheadMixin`` uses of the trainer it is mixed into (``TorchClient``'s own)."""

    name: str
    seed: int
    _lookahead: _Lookahead | None
    _background_lookahead: ClassVar[bool]

    @property
    def timeline(self) -> Timeline: ...

    def algorithm(self, name: str) -> ClientAlgorithm: ...

    def wait_lookahead(self) -> None: ...

    def _train(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        seed: int,
        epochs: int,
        steps: int,
        time_s: float = 0.0,
        after_backward: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> tuple[float, int]: ...

    def _reduce_totals(self, loss_sum: float, seen: int) -> tuple[float, int]: ...

    def _state(self) -> ModelState: ...


class LookaheadMixin:
    """The steps a trainer trains after an upload, on the same model and optimizer, while the
    network works (``TorchClient``'s docstring): their start, the wait for them, and their
    count in the client's state. They train through the trainer's own ``_train``."""

    #: Whether the lookahead runs in a background thread (``False``: before ``fit`` returns, as a
    #: multi-process trainer needs: its ranks' collectives must run in the same order on each).
    _background_lookahead: ClassVar[bool] = True
    _lookahead: _Lookahead | None = None

    @staticmethod
    def _time_left(budget: float, done: _Lookahead | None) -> float:
        """A fit's time budget less what its lookahead took (``budget`` 0: none): above 0 even
        when the lookahead took it all, since a budgeted fit trains at least one step."""
        if not budget:
            return 0.0
        return max(budget - (done.compute_s if done is not None else 0.0), sys.float_info.min)

    def _start_lookahead(
        self: _Host,
        algorithm: ClientAlgorithm,
        ctx: FitContext,
        ins: FitIns,
        *,
        trained: list[str],
        steps: int,
        time_s: float = 0.0,
    ) -> None:
        """Trains ``steps`` more steps of ``algorithm`` after the upload of task ``ins``, or
        ``time_s`` > 0 seconds of steps (at least one) instead: in a background thread, or now
        when ``_background_lookahead`` is false."""
        job = _Lookahead(algorithm=algorithm.name, round=ins.round, steps=steps)
        # Seeded by the task that just ended: the next one's round is not known yet (a worker
        # of an asynchronous run may skip rounds), and a step number must fix every batch.
        seed = derive_seed(ins.config.get("seed", 0), ins.round, self.seed, self.name, "lookahead")

        def run() -> None:
            began = time.monotonic()
            try:
                with self.timeline.span(COMPUTE):
                    self.model.train()
                    with train_only(self.model, trained) as params:
                        optimizer = algorithm.optimizer(trainer=self, params=params, ctx=ctx)
                        named = OrderedDict(
                            (n, p) for n, p in self.model.named_parameters() if p.requires_grad
                        )
                        loss_sum, seen = self._train(
                            optimizer,
                            seed=seed,
                            epochs=0,
                            steps=steps,
                            time_s=time_s,
                            after_backward=lambda: algorithm.after_backward(params=named),
                            stop=job.stop,
                        )
                        job.loss_sum, job.seen = self._reduce_totals(loss_sum, seen)
                    job.state = self._state()
            except BaseException as exc:  # handed to the next fit, which fails naming it
                job.error = exc
            finally:
                with _RUNNING_LOCK:
                    _RUNNING.discard(job)
            job.compute_s = time.monotonic() - began

        self._lookahead = job
        if not self._background_lookahead:
            run()
            return
        job.thread = threading.Thread(target=run, name=f"fedgrid-lookahead-{self.name}", daemon=True)
        with _RUNNING_LOCK:
            _RUNNING.add(job)
        job.thread.start()

    @property
    def lookahead_running(self) -> bool:
        """Whether steps after an upload are training in the background now (``TorchClient``'s docstring)."""
        job = self._lookahead
        thread = None if job is None else job.thread
        return thread is not None and thread.is_alive()

    def wait_lookahead(self: _Host) -> None:
        """Waits for the steps that train after an upload (``TorchClient``'s docstring) and hands the
        state they reached to their algorithm (``ClientAlgorithm.resume``); returns at once
        when none run. ``fit``, ``evaluate``, ``state_dict`` and ``load_state_dict`` call it."""
        job = self._lookahead
        if job is None:
            return
        if job.thread is not None:
            job.thread.join()
            job.thread = None
        if job.state is not None or job.error is not None:
            self.algorithm(job.algorithm).resume(state=job.state)
            job.state = None

    def _take_lookahead(self: _Host, algorithm: str) -> _Lookahead | None:
        """The finished lookahead, for the next fit of ``algorithm`` to count (``None`` if none,
        or if it followed another algorithm's task).

        Raises:
            RuntimeError: the lookahead failed (its replica is dropped).
        """
        self.wait_lookahead()
        job, self._lookahead = self._lookahead, None
        if job is not None and job.error is not None:
            raise RuntimeError(
                f"client {self.name!r}: the {job.steps} inner steps after round {job.round}'s upload "
                f"(sync_delay_steps) failed: {type(job.error).__name__}: {job.error}; the replica is dropped, "
                "so the coordinator sends the whole model after this failed round"
            ) from job.error
        return job if job is not None and job.algorithm == algorithm else None

    def _lookahead_state(self) -> dict[str, Any] | None:
        """A finished lookahead's count, for the client's state (``None``: none, or it failed):
        a restored client counts it as this one would."""
        job = self._lookahead
        if job is None or job.error is not None:
            return None
        return {
            "algorithm": job.algorithm,
            "round": job.round,
            "steps": job.steps,
            "seen": job.seen,
            "loss_sum": job.loss_sum,
            "compute_s": job.compute_s,
        }

    def _restore_lookahead(self, ahead: Mapping[str, Any] | None) -> None:
        """Restores what ``_lookahead_state`` returned."""
        self._lookahead = None if ahead is None else _Lookahead(**ahead)
