"""Experiment trackers: each round's metrics mirrored to TensorBoard or MLflow.

``metrics.jsonl`` stays the source of truth; a tracker is a copy for the tools people
already watch. ``RunWriter`` (``fedgrid.runlog``) feeds every tracker the same row it
appends to ``metrics.jsonl``, so ``fedgrid simulate`` and ``fedgrid coordinator`` report
alike. The config key ``tracker`` names them, comma-separated:

- ``tensorboard``: event files in ``RUN_DIR/tensorboard/`` (``torch.utils.tensorboard``;
  extra ``fedgrid[tensorboard]``), one scalar per metric with the round as the step.
- ``mlflow``: one MLflow run named after the run directory, the config as params and
  the metrics per round (``step=round``), where ``MLFLOW_TRACKING_URI`` and
  ``MLFLOW_EXPERIMENT_NAME`` point (extra ``fedgrid[mlflow]``).

A missing package is a ``ConfigError`` before any work starts (``Config`` checks it). A
tracker that fails while logging is logged once and the run goes on: a dashboard that is
down must not stop training.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedgrid.errors import ConfigError

__all__ = [
    "TRACKERS",
    "Tracker",
    "TensorBoardTracker",
    "MLflowTracker",
    "Trackers",
    "parse_trackers",
    "build_trackers",
    "scalars",
]

log = logging.getLogger(__name__)

#: tracker name -> (the module it needs, the fedgrid extra that installs it).
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
}
#: MLflow's log_params takes at most 100 params a call.
_MLFLOW_PARAMS_PER_CALL = 100


def _missing(name: str) -> ConfigError:
    module, extra = TRACKERS[name]
    return ConfigError(
        "tracker",
        f"{name} needs the {module} package, which is not installed: pip install 'fedgrid[{extra}]'",
    )


def parse_trackers(spec: str) -> tuple[str, ...]:
    """The tracker names of ``spec`` (``"tensorboard,mlflow"``; empty: none), checked.

    Raises:
        ConfigError: an unknown or repeated name, or one whose package is not installed.
    """
    names = tuple(part.strip() for part in spec.split(",") if part.strip())
    for name in names:
        if name not in TRACKERS:
            raise ConfigError("tracker", f"unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
        # find_spec, not an import: checking a config must not load TensorBoard or MLflow.
        if importlib.util.find_spec(TRACKERS[name][0]) is None:
            raise _missing(name)
    if len(set(names)) != len(names):
        raise ConfigError("tracker", f"a tracker is named twice in {spec!r}")
    return names


def scalars(row: Mapping[str, object]) -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` row that a tracker logs: every numeric key but
    ``round`` (the step); ``None`` (e.g. no accuracy) and text are left out."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class Tracker(ABC):
    """One destination of per-round metrics. ``log_round`` gets each ``metrics.jsonl`` row."""

    name = ""

    def resume(self, rows: Sequence[Mapping[str, object]]) -> None:
        """The rows already committed when the run starts (a resumed coordinator's); default: ignored."""

    @abstractmethod
    def log_round(self, row: Mapping[str, object]) -> None:
        """Logs one round's row (its ``round`` is the step)."""

    def close(self) -> None:
        """Flushes and ends (the run is over or stopped)."""


class TensorBoardTracker(Tracker):
    """TensorBoard event files in ``RUN_DIR/tensorboard/``, flushed after every round.

    A resumed run purges the steps after the last committed round (a round redone after a
    restart is not shown twice) and appends the rest to the same directory.

    Raises:
        ConfigError: ``tensorboard`` is not installed.
    """

    name = "tensorboard"

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard") from None
        self._writer_cls = SummaryWriter
        self.log_dir = Path(run_dir) / "tensorboard"
        self._writer: Any = None
        self._purge_step: int | None = None

    def resume(self, rows: Sequence[Mapping[str, object]]) -> None:
        if rows:
            self._purge_step = int(rows[-1]["round"]) + 1  # type: ignore[call-overload]

    def log_round(self, row: Mapping[str, object]) -> None:
        if self._writer is None:  # opened at the first round: resume has said where to purge from
            self._writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=self._purge_step)
        step = int(row["round"])  # type: ignore[call-overload]
        for key, value in scalars(row).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MLflowTracker(Tracker):
    """One MLflow run: the config as params, each round's metrics with ``step=round``.

    The run is named after the run directory and goes where MLflow's own settings say
    (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``). Inside an MLflow run that the
    calling program started it is a nested run. A resumed coordinator starts a new MLflow
    run holding the committed rounds again, so each MLflow run is a whole history.

    Raises:
        ConfigError: ``mlflow`` is not installed.
    """

    name = "mlflow"

    def __init__(self, run_dir: str | os.PathLike[str], config: Mapping[str, object]) -> None:
        try:
            import mlflow
        except ImportError:
            raise _missing("mlflow") from None
        self._mlflow = mlflow
        self.run_name = Path(run_dir).resolve().name
        self._params = {k: v for k, v in config.items() if v is not None}
        self._active = False

    def _start(self) -> None:
        if self._active:
            return
        self._mlflow.start_run(run_name=self.run_name, nested=self._mlflow.active_run() is not None)
        self._active = True
        items = list(self._params.items())
        for i in range(0, len(items), _MLFLOW_PARAMS_PER_CALL):
            self._mlflow.log_params(dict(items[i : i + _MLFLOW_PARAMS_PER_CALL]))

    def resume(self, rows: Sequence[Mapping[str, object]]) -> None:
        for row in rows:
            self.log_round(row)

    def log_round(self, row: Mapping[str, object]) -> None:
        self._start()
        # MLflow stores NaN and infinities, but its UI and comparisons choke on them; a
        # failed round's non-finite loss stays in metrics.jsonl.
        values = {k: v for k, v in scalars(row).items() if math.isfinite(v)}
        self._mlflow.log_metrics(values, step=int(row["round"]))  # type: ignore[call-overload]

    def close(self) -> None:
        if self._active:
            self._active = False
            self._mlflow.end_run()


class Trackers:
    """The trackers of one run, fed together. A tracker that raises is logged once (the
    first error, with its traceback) and tried again at the next round; ``close`` says how
    many of its calls failed. ``metrics.jsonl`` has every round whatever they do."""

    def __init__(self, trackers: Sequence[Tracker] = ()) -> None:
        self.trackers = list(trackers)
        self.errors: dict[str, int] = {}

    def _each(self, what: str, call: Any) -> None:
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception:  # noqa: BLE001 - a tracker reports on the run and must never stop it
                count = self.errors.get(tracker.name, 0)
                self.errors[tracker.name] = count + 1
                if count == 0:
                    log.exception(
                        "tracker %s: %s failed; training goes on and metrics.jsonl keeps every round "
                        "(later errors of this tracker are counted, not logged)",
                        tracker.name,
                        what,
                    )

    def resume(self, rows: Sequence[Mapping[str, object]]) -> None:
        self._each("resume", lambda t: t.resume(rows))

    def log_round(self, row: Mapping[str, object]) -> None:
        self._each(f"logging round {row.get('round')}", lambda t: t.log_round(row))

    def close(self) -> None:
        self._each("close", lambda t: t.close())
        for name, count in self.errors.items():
            log.warning(
                "tracker %s: %d call(s) failed in this run; metrics.jsonl has every round", name, count
            )


def build_trackers(spec: str, run_dir: str | os.PathLike[str], config: Mapping[str, object]) -> Trackers:
    """The trackers ``spec`` names for the run in ``run_dir`` with ``config`` (its params).

    Raises:
        ConfigError: see ``parse_trackers``; also when a package is there but fails to import.
    """
    made: list[Tracker] = []
    for name in parse_trackers(spec):
        made.append(TensorBoardTracker(run_dir) if name == "tensorboard" else MLflowTracker(run_dir, config))
    return Trackers(made)
