"""A user's trainer as a client of fedgrid's simulation: the same ``FederatedCallback``, the same
``Federation``, only the transport differs. Where a deployed callback's session talks gRPC to a
coordinator, a simulated one's hands each task over in this process::

    from fedgrid.integrations.simulated import TrainerClient, simulate
    from fedgrid.integrations.transformers import FederatedCallback

    def site(k):
        def train(connection):     # in the client's own thread
            trainer = Trainer(model=..., args=..., train_dataset=data[k],
                              callbacks=[FederatedCallback(connection)])
            trainer.train()
        return TrainerClient(train, name=f"site-{k}", num_examples=len(data[k]))

    final, history = simulate(load_config(overrides={"model": "hf:models/tiny-llama", ...}),
                              [site(0), site(1)])

Each ``TrainerClient`` runs its ``train`` in a thread of its own, started at its first task. The
simulation's fleet (``InProcessFleet``, sequential engine) calls ``fit``: the task goes to the
trainer's callback (``Federation``), which trains the round's steps and submits; ``fit`` returns
that result and the fleet uploads it as a deployed client's upload is accepted. One trainer runs
at a time, so the run is as deterministic as a deployment of one process per site: each client
keeps its own random generators (torch's CPU generator, ``random``'s and numpy's), swapped in
while it trains and out when it hands over, as each site's process has its own. An overlapped
sync (``sync_delay_steps``) hands its result over at the merge, after the tau steps trained while
it would travel: the same steps as deployed, one trainer at a time.

The run's end (``simulate``) ends every trainer's loop as the coordinator's end does: the
callback merges the newest global model it was sent (the final aggregate, when the run's
``fraction_evaluate`` sends it for evaluation) and the trainer's ``train`` returns.

On the sequential engine with the same ``threads`` the final model is bit-identical to a
deployment's (``tests/integration/test_hf_callback.py``).
"""

from __future__ import annotations

import logging
import queue
import random
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from fedgrid.client.api import Client, EvaluateOutput, FitOutput
from fedgrid.client.session import Task
from fedgrid.config import Config
from fedgrid.errors import SessionError
from fedgrid.integrations.federation import Connector, TaskSession
from fedgrid.simulation.run import run_simulation
from fedgrid.types import EVALUATE, FIT, EvaluateIns, FitIns, ModelState, RoundMetrics, Scalar

__all__ = ["TrainerClient", "simulate"]

log = logging.getLogger(__name__)

#: Seconds a simulated trainer may take to answer one task (a round's steps) or to end.
ANSWER_TIMEOUT_S = 600.0


class _Generators:
    """The process-wide random generators a trainer draws from (torch's CPU one, ``random``'s,
    numpy's when loaded): captured when a client hands over, put back when it takes over."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)


@dataclass(frozen=True)
class _Joined:
    """What the trainer's callback reported when it opened its session."""

    num_examples: int
    base_hash: str
    lora_rank: int


class _Handoff:
    """The simulated client's ``Connector`` and ``TaskSession`` (``fedgrid.integrations.federation``):
    tasks come from the fleet's ``fit``/``evaluate`` through one queue, answers go back through another."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rounds = 0
        self.joined: _Joined | None = None
        self.tasks_in: queue.Queue[Task | None] = queue.Queue()
        self.answers: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._own: _Generators | None = None  # the trainer's generators while it does not run

    # -- Connector
    def session(self, *, num_examples: int, base_hash: str, lora_rank: int) -> TaskSession:
        self.joined = _Joined(num_examples, base_hash, lora_rank)
        return self

    # -- TaskSession (the trainer's thread)
    def open(self) -> "_Handoff":
        return self

    def tasks(self) -> Iterator[Task]:
        while True:
            task = self.tasks_in.get()
            if task is None:  # the run is over
                return
            if self._own is not None:
                self._own.restore()
            yield task

    def _answer(self, kind: str, body: Any) -> None:
        self._own = _Generators()
        self.answers.put((kind, body))

    def submit(self, result: FitOutput | EvaluateOutput) -> None:
        if isinstance(result, FitOutput):
            self.rounds += 1
        self._answer("result", result)

    def submit_nowait(self, result: FitOutput) -> "_AtMerge":
        return _AtMerge(self, result)

    def report_failure(self, reason: str | BaseException) -> None:
        self._answer("failed", reason if isinstance(reason, str) else f"{type(reason).__name__}: {reason}")

    def close(self, reason: str = "the host program closed the session") -> None:
        self.answers.put(("closed", reason))


class _AtMerge:
    """An overlapped sync's result, handed to the fleet when the trainer merges (``wait``), after
    the tau steps a deployed client trains while its upload travels."""

    def __init__(self, handoff: _Handoff, result: FitOutput) -> None:
        self._handoff, self._result = handoff, result
        self._sent = False

    def wait(self, timeout: float | None = None) -> None:
        if not self._sent:
            self._sent = True
            self._handoff.submit(self._result)


class TrainerClient(Client):
    """A simulated client whose training is a user's trainer with a ``FederatedCallback``.

    Args:
        train: builds the trainer with ``FederatedCallback(connection)`` (Hugging Face's, TRL's
            or Lightning's) and trains (``trainer.train()``, ``trainer.fit(...)``); called once,
            in the client's thread, at its first task.
        name: the client's name (the fleet orders results by it).
        num_examples: examples this site holds, reported at join (the trainer's callback reports
            its training set's length; the two must agree).
        region: region label.
        timeout_s: seconds the trainer may take to answer one task.

    Attributes:
        connection: what the trainer's ``FederatedCallback`` takes in place of ``HOST:PORT``.
        error: what the trainer raised, if it failed.
    """

    def __init__(
        self,
        train: Callable[[Connector], Any],
        *,
        name: str,
        num_examples: int,
        region: str = "",
        timeout_s: float = ANSWER_TIMEOUT_S,
    ) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples must be at least 1, got {num_examples}")
        self.name, self.region = name, region
        self.timeout_s = timeout_s
        self._train, self._held = train, num_examples
        self.connection = _Handoff(name)
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._over: str | None = None  # why the trainer takes no more tasks

    @property
    def num_examples(self) -> int:
        return self._held

    def fit(self, state: ModelState, ins: FitIns) -> FitOutput:
        answer = self._ask(FIT, state, ins.config, ins)
        if not isinstance(answer, FitOutput):
            raise SessionError(f"{self.name}'s trainer answered a fit task with {type(answer).__name__}")
        joined = self.connection.joined
        if joined is not None and joined.num_examples != self._held:
            raise SessionError(
                f"{self.name}'s trainer reported {joined.num_examples} examples, its TrainerClient {self._held}"
            )
        return answer

    def evaluate(self, state: ModelState, config: Any) -> EvaluateOutput:
        """The callback keeps the model as the newest global one (merged at the trainer's end)
        and evaluates nothing, as a deployed callback answers an evaluation task."""
        answer = self._ask(EVALUATE, state, config, EvaluateIns(round=0, config=config))
        if not isinstance(answer, EvaluateOutput):
            raise SessionError(f"{self.name}'s trainer answered an evaluation with {type(answer).__name__}")
        return answer

    def finish(self) -> None:
        """The run is over: the trainer's callback merges the newest global model and the
        trainer's ``train`` returns.

        Raises:
            TimeoutError: the trainer did not end within ``timeout_s``.
        """
        if self._thread is None:
            return
        self.connection.tasks_in.put(None)
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(
                f"{self.name}'s trainer did not end within {self.timeout_s:g} s of the run's end"
            )

    # -- inside
    def _run(self) -> None:
        try:
            self._train(self.connection)
        except BaseException as exc:  # the round waiting on it fails with it
            self.error = exc
            self.connection.answers.put(("died", f"{type(exc).__name__}: {exc}"))
        else:
            self.connection.answers.put(("ended", "its train() returned"))

    def _ask(
        self, kind: str, state: ModelState, config: Any, ins: FitIns | EvaluateIns
    ) -> FitOutput | EvaluateOutput:
        """Hands a task to the trainer and waits for its answer, the fleet's generators kept aside."""
        if self._over is not None:
            raise SessionError(f"{self.name}'s trainer takes no more tasks: {self._over}")
        round_ = ins.round
        config_: dict[str, Scalar] = dict(config)
        task = Task(round_, kind, state, config_, ins, self.timeout_s, f"sim-{self.name}-{round_}-{kind}")
        outer = _Generators()
        self.connection.tasks_in.put(task)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"fedgrid-trainer-{self.name}", daemon=True
            )
            self._thread.start()
        try:
            while True:
                try:
                    what, body = self.connection.answers.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise TimeoutError(
                        f"{self.name}'s trainer did not answer round {round_}'s {kind} task within {self.timeout_s:g} s"
                    ) from None
                if what == "result":
                    return body  # type: ignore[no-any-return]
                if what == "failed":
                    raise SessionError(f"{self.name}'s trainer failed round {round_}: {body}")
                if what == "closed":  # its end follows
                    continue
                self._over = f"its trainer {'failed: ' if what == 'died' else 'ended: '}{body}"
                raise SessionError(f"{self.name} did not answer round {round_}: {self._over}")
        finally:
            outer.restore()


def simulate(
    config: Config, clients: Sequence[TrainerClient], **options: Any
) -> tuple[ModelState | None, list[RoundMetrics]]:
    """``run_simulation`` over ``clients`` (``config.clients`` becomes their number), then the
    end of every trainer (``TrainerClient.finish``). ``options`` go to ``run_simulation``.

    Returns:
        The final global model and the rounds' metrics, as ``run_simulation``.
    """
    try:
        return run_simulation(config, clients=clients, **options)
    finally:
        for client in clients:
            client.finish()
            if client.error is not None:
                log.warning("%s's trainer failed: %s", client.name, client.error)
