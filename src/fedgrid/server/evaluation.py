"""The server-side evaluation of each round's model, off the round's path.

A coordinator evaluates the model of a round beside the next round: ``Evaluator.submit``
takes a snapshot of the model (a copy of its tensors, so that the next aggregate does not
change what is measured) and evaluates it on a thread of its own while the clients train.
When it is done, ``land(round, loss, metrics)`` puts its figures in the row of the round it
measured (``RoundEngine``: ``metrics.jsonl``'s row of that round is rewritten with them).

At most one evaluation runs at a time, so at most one snapshot is held: a round whose
evaluation would start while the previous one still runs waits for it first. A stop
abandons the one running (the built-in evaluation gives up between its batches once the
process is stopping, ``fedgrid.interrupts.stopping``): that round's row keeps no figures of it.

``background=False`` evaluates inline, before ``submit`` returns (a simulation: its rounds
and their printed lines stay in order, and nothing competes with its clients for the cores).
The figures are the same either way: the evaluation is a function of the snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from fedgrid.errors import InterruptedRunError
from fedgrid.events import EventLog
from fedgrid.types import ModelState

__all__ = ["EvaluateFn", "Evaluator"]

log = logging.getLogger(__name__)

EvaluateFn = Callable[[ModelState], "tuple[float, dict[str, float]]"]
#: Where an evaluation's figures go: ``(round, loss, metrics)``.
Land = Callable[[int, float, "dict[str, float]"], None]


class Evaluator:
    """Runs ``fn`` on each submitted round's model, on a thread (``background``) or inline.

    Args:
        fn: the evaluation, ``state -> (loss, metrics)``.
        land: called with each evaluation's figures, on the evaluating thread.
        background: evaluate beside the next round (a coordinator) or before ``submit`` returns.
        events: ``evaluating`` and ``evaluated`` go there (with ``round`` and, once done, ``seconds``).
    """

    def __init__(self, fn: EvaluateFn, land: Land, *, background: bool, events: EventLog) -> None:
        self.fn = fn
        self.land = land
        self.background = background
        self.events = events
        self._thread: threading.Thread | None = None

    def submit(self, server_round: int, state: ModelState, *, stop: threading.Event) -> None:
        """Evaluates ``state`` as round ``server_round``'s model; in the background, first waits
        for the evaluation still running (or for ``stop``)."""
        if not self.background:
            self._evaluate(server_round, state)
            return
        if not self.wait(stop):
            return
        snapshot = {name: tensor.detach().clone() for name, tensor in state.items()}
        self._thread = threading.Thread(
            target=self._evaluate,
            args=(server_round, snapshot),
            name=f"fedgrid-evaluate-{server_round}",
            daemon=True,
        )
        self._thread.start()

    def wait(self, stop: threading.Event | None = None) -> bool:
        """Waits for the running evaluation; ``False`` when ``stop`` was set first (it is
        abandoned: a stopping process does not wait for it)."""
        thread = self._thread
        while thread is not None and thread.is_alive():
            if stop is not None and stop.is_set():
                return False
            thread.join(0.05)
        return True

    def _evaluate(self, server_round: int, state: ModelState) -> None:
        began = time.monotonic()
        self.events.emit("evaluating", round=server_round)
        try:
            loss, metrics = self.fn(state)
        except InterruptedRunError as exc:  # the process is stopping: the row keeps no figures
            if not self.background:  # inline: the round is abandoned with it (RoundEngine)
                raise
            log.info("round %d: server-side evaluation abandoned: %s", server_round, exc)
            return
        except Exception as exc:
            if self.background:  # a thread's failure would go unseen: said, and the run goes on
                log.exception("round %d: server-side evaluation failed: %s", server_round, exc)
                return
            raise
        seconds = time.monotonic() - began
        self.land(server_round, loss, metrics)
        self.events.emit("evaluated", round=server_round, loss=loss, seconds=round(seconds, 3))
