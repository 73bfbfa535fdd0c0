"""``fedgrid simulate``: a whole federation in this process, with a progress line."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from fedgrid.cli.support import SIMULATE_KEYS, add_config_flags, config_from
from fedgrid.config import Config
from fedgrid.interrupts import GracefulStop, say
from fedgrid.types import RoundMetrics

if TYPE_CHECKING:
    from fedgrid.client.progress import ProgressReport

__all__ = ["SimulateProgress", "add_parser", "run"]


def add_parser(sub: Any) -> argparse.ArgumentParser:
    sim = sub.add_parser("simulate", help="run a whole federation in this process")
    add_config_flags(sim, SIMULATE_KEYS)
    return sim


class SimulateProgress:
    """``fedgrid simulate``'s progress line after each round: round r/R, client updates per
    second, the latest accuracy and loss, and the time left (mean round time so far times
    the rounds left). On a terminal it is one line rewritten in place; otherwise one plain
    line per round.

    Args:
        rounds: the run's rounds.
        stream: where the line goes (stderr).
    """

    def __init__(self, rounds: int, stream: TextIO) -> None:
        self.rounds = rounds
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._walls: list[float] = []
        self._shown = False

    @staticmethod
    def line(m: RoundMetrics, rounds: int, eta_s: float) -> str:
        from fedgrid.simulation.run import clients_per_second

        acc = "-" if m.accuracy is None else f"{m.accuracy:.4f}"
        loss = "-" if m.loss is None else f"{m.loss:.4f}"
        minutes, seconds = divmod(int(round(eta_s)), 60)
        return (
            f"round {m.round}/{rounds} | {clients_per_second(m):.1f} clients/s | accuracy {acc} | loss {loss} | "
            f"ETA {minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
        )

    def clear(self) -> None:
        """Takes the in-place line away (before other output on the terminal)."""
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False

    def update(self, m: RoundMetrics) -> None:
        self._walls.append(m.wall_s)
        eta = sum(self._walls) / len(self._walls) * max(self.rounds - m.round, 0)
        text = self.line(m, self.rounds, eta)
        if self.tty:
            self.stream.write("\r" + text + "\033[K")
            self._shown = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def task(self, report: ProgressReport) -> None:
        """Inside a round (on a terminal only; ``fedgrid.client.progress``'s listener): the line
        shows the training client's steps, examples per second and the time its task has left."""
        if not self.tty:
            return
        self.stream.write(
            f"\rround {report.round}/{self.rounds} | training: {report.line().split(': ', 1)[1]}\033[K"
        )
        self._shown = True
        self.stream.flush()

    def close(self) -> None:
        """Ends the in-place line so that later output starts on a line of its own."""
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


def _header(config: Config) -> Callable[[str, str], None]:
    """The run's first line, printed once the engine is chosen (so auto's choice shows)."""
    import torch

    from fedgrid.simulation.tasks import get_dataset

    task = get_dataset(config.dataset)

    # An app's clients hold the data its own code splits (a `fedgrid new` app's data.py: IID);
    # the dataset and partition keys describe only the built-in clients, so they are not named then.
    data = (
        f"app {config.app} (its own data and split)"
        if config.app
        else f"dataset {config.dataset}, partition {config.partition or task.default_partition}"
    )

    def header(engine: str, why: str) -> None:
        chosen = f"engine {engine} ({why})" if config.engine == "auto" else f"engine {engine}"
        print(
            f"fedgrid simulate: {config.clients} clients, {config.rounds} rounds, {data}, "
            f"model {config.model or task.default_model}, {chosen}, seed {config.seed}, "
            f"{config.threads or torch.get_num_threads()} threads",
            flush=True,
        )

    return header


def _round_line(config: Config, progress: SimulateProgress | None) -> Callable[[RoundMetrics], None]:
    """One line per round (above the progress line, which it then redraws)."""

    def show(m: RoundMetrics) -> None:
        acc = "" if m.accuracy is None else f" accuracy {m.accuracy:.4f}"
        loss = "" if m.loss is None else f" loss {m.loss:.4f}"
        if progress is not None:
            progress.clear()
        print(
            f"round {m.round:3d}/{config.rounds}{loss}{acc} {m.clients_ok} clients ok, {m.clients_failed} failed  "
            f"up {m.bytes_up / 1e6:.2f} MB down {m.bytes_down / 1e6:.2f} MB  {m.wall_s:.2f}s",
            flush=True,
        )
        if progress is not None:
            progress.update(m)

    return show


def _final_line(config: Config, final_model: Any, history: Sequence[RoundMetrics]) -> None:
    if final_model is None:
        saved = f"; model of round {len(history)} in {config.out}/model.safetensors" if history else ""
        print(f"stopped after {len(history)} of {config.rounds} rounds{saved}; run directory {config.out}")
        return
    final = history[-1]
    metric = (
        f"final test accuracy {final.accuracy:.4f}"
        if final.accuracy is not None
        else f"final loss {final.loss}"
    )
    print(f"{metric}; run directory {config.out}")


def run(args: argparse.Namespace) -> int:
    """``fedgrid simulate``: the whole federation in this process (or across torchrun's ranks,
    each training its share of the clients: ``fedgrid.simulation.sharded``; rank 0 speaks for the run)."""
    from datetime import timedelta

    import torch.distributed as dist

    from fedgrid.client.parallel import torchrun_rank
    from fedgrid.client.progress import listen
    from fedgrid.simulation.run import run_simulation
    from fedgrid.simulation.tasks import check_config

    config = config_from(args, SIMULATE_KEYS)
    check_config(config)
    ranks = torchrun_rank()
    quiet = ranks is not None and ranks[0] != 0
    # The in-place line on a terminal only: elsewhere (a log file, a pipe) each round's own line
    # is the record, and a second line per round would say the same thing again.
    tty = sys.stderr.isatty()
    progress = (
        SimulateProgress(config.rounds, sys.stderr)
        if config.progress and tty and not quiet and not config.quiet
        else None
    )
    stop = threading.Event()

    def on_stop(signal_name: str) -> None:
        erase = (
            "\r\033[K" if progress is not None and progress.tty else ""
        )  # the in-place line, not into its stream
        say(f"{erase}{signal_name}: stopping (the open round is abandoned); a second one exits at once")
        stop.set()

    if ranks is not None:
        dist.init_process_group("gloo", timeout=timedelta(seconds=config.round_timeout_s))
    listen(progress.task if progress is not None else None)  # inside a round too (fedgrid.client.progress)
    with GracefulStop(on_stop, what="simulate"):
        try:
            final_model, history = run_simulation(
                config,
                on_round=None if quiet else _round_line(config, progress),
                on_start=None if quiet else _header(config),
                stop=stop,
            )
            if ranks is not None:
                # Every rank past the last collective before any tears gloo down: a rank that
                # exits while a peer's gather is in flight aborts that peer.
                dist.barrier()
        finally:
            listen(None)
            if progress is not None:
                progress.close()
            if ranks is not None:
                dist.destroy_process_group()
    if not quiet:
        _final_line(config, final_model, history)
    return 0
