"""A real coordinator run (``fedgrid coordinator`` and two ``fedgrid client`` processes)
with ``--tracker tensorboard``: its TensorBoard scalars equal its ``metrics.jsonl``, and
``fedgrid report`` draws its client x round participation from its ``events.jsonl``."""

from __future__ import annotations

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedgrid.cli import main
from fedgrid.ops.report import PLOTS, figures, load_run, participation
from fedgrid.runlog import read_metrics
from fedgrid.trackers import scalars

from harness import deploy


def test_coordinator_run_reports_participation_and_feeds_tensorboard(tmp_path):
    out = deploy(
        tmp_path,
        "coord",
        ["--rounds", "2", "--min-clients", "2", "--tracker", "tensorboard"],
        clients=2,
        seed=0,
    )
    rows = read_metrics(out)
    assert [(r["round"], r["clients_ok"], r["clients_failed"]) for r in rows] == [(1, 2, 0), (2, 2, 0)]

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(scalars(rows[0]))
    for tag in acc.Tags()["scalars"]:
        assert [(s.step, s.value) for s in acc.Scalars(tag)] == [
            (r["round"], float(np.float32(r[tag]))) for r in rows
        ], tag

    run = load_run(out)
    grid = participation(run)
    assert grid is not None
    clients, rounds, cells = grid
    assert len(clients) == 2 and rounds == [1, 2] and cells == [[2, 2], [2, 2]]
    assert list(figures([run])) == [*PLOTS, "participation-1.png"]
    report = tmp_path / "report"
    assert main(["report", str(out), "--out", str(report)]) == 0
    assert (report / "participation-1.png").read_bytes().startswith(b"\x89PNG")
    assert (report / "report.html").read_text().count("data:image/png;base64,") == len(PLOTS) + 1
