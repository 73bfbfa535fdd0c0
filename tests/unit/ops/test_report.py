"""``fedgrid report``: the series handed to matplotlib are ``metrics.jsonl``'s numbers, the
files are PNGs and one self-contained HTML page, and bad run directories get one-line
errors (file and line named) and exit code 2."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedgrid.cli import main
from fedgrid.ops.report import PLOTS, ReportError, figures, load_run, load_runs, participation
from fedgrid.runlog import read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """Two real 3-round simulations of the default digits task, at two learning rates."""
    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("fast", "0.1"), ("slow", "0.02")):
        assert (
            main(
                [
                    "simulate",
                    "--rounds",
                    "3",
                    "--lr",
                    lr,
                    "--threads",
                    "1",
                    "--progress",
                    "false",
                    "--out",
                    str(root / name),
                ]
            )
            == 0
        )
    return root / "fast", root / "slow"


def _lines(fig) -> dict[str, tuple[list[float], list[float]]]:
    """Every plotted line of ``fig`` by its label, as the numbers matplotlib holds."""
    out = {}
    for ax in fig.axes:
        for line in ax.lines:
            key = f"{ax.get_ylabel()}|{line.get_label()}"
            assert key not in out
            out[key] = (list(map(float, line.get_xdata())), list(map(float, line.get_ydata())))
    return out


def test_plotted_series_are_the_metrics_of_each_run(runs):
    fast, slow = runs
    figs = figures(load_runs([str(fast), str(slow)]))
    assert list(figs) == list(PLOTS)  # simulations write no events: no heatmap
    rows = {run.name: read_metrics(run) for run in runs}
    assert all(len(r) == 3 for r in rows.values())

    def series(name: str, metric: str) -> tuple[list[float], list[float]]:
        return [float(r["round"]) for r in rows[name]], [float(r[metric]) for r in rows[name]]

    assert _lines(figs["accuracy.png"]) == {f"accuracy (%)|{n}": series(n, "accuracy") for n in rows}
    assert _lines(figs["loss.png"]) == {f"loss|{n}": series(n, "loss") for n in rows}
    assert _lines(figs["bytes.png"]) == {
        f"{m.replace('_', ' ')}|{n}": series(n, m) for n in rows for m in ("bytes_up", "bytes_down")
    }
    assert _lines(figs["clients.png"]) == {
        f"clients|{n} ({m.replace('_', ' ')})": series(n, m)
        for n in rows
        for m in ("clients_ok", "clients_failed")
    }
    assert series("fast", "accuracy") != series("slow", "accuracy")  # two different runs, not one twice
    assert series("fast", "clients_ok")[1] == [10.0, 10.0, 10.0]


def test_report_writes_pngs_and_one_self_contained_html(runs, tmp_path, capsys):
    fast, slow = runs
    out = tmp_path / "report"
    assert main(["report", str(fast), str(slow), "--out", str(out)]) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(PLOTS)
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    page = (out / "report.html").read_text()
    embedded = [
        base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    ]
    assert embedded == [(out / name).read_bytes() for name in PLOTS]  # the same images, in the page's order
    assert re.findall(r'(?:src|href)="(?!data:)', page) == [] and "http" not in page  # nothing external
    for run in runs:
        final = read_metrics(run)[-1]
        row = re.search(rf"<tr><td>{run.name}</td><td>3</td><td>([^<]*)</td><td>([^<]*)</td>", page)
        assert row is not None and row.groups() == (f"{final['accuracy'] * 100:.2f}%", f"{final['loss']:.4f}")
    assert "report.html" in capsys.readouterr().out


def test_labels_name_the_runs_and_are_escaped_in_html(runs, tmp_path):
    fast, slow = runs
    out = tmp_path / "report"
    label = "<script>alert('x')</script> $5"
    assert (
        main(["report", str(fast), str(slow), "--label", label, "--label", "slow lr", "--out", str(out)]) == 0
    )
    page = (out / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; $5" in page
    figs = figures(load_runs([str(fast), str(slow)], [label, "slow lr"]))
    # "$" is escaped for matplotlib (no mathtext), shown as typed.
    assert [line.get_label() for line in figs["accuracy.png"].axes[0].lines] == [
        label.replace("$", r"\$"),
        "slow lr",
    ]


def test_same_directory_names_are_told_apart_by_path(runs, tmp_path):
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    shutil.copytree(runs[0], a)
    shutil.copytree(runs[1], b)
    assert [r.label for r in load_runs([str(a), str(b)])] == [str(a), str(b)]


def test_label_count_must_match(runs, capsys):
    assert main(["report", str(runs[0]), str(runs[1]), "--label", "one", "--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedgrid report: error: 1 --label for 2 run directories: give one per run, in order"]
    assert not Path("unused").exists()


def _copy_with_rows(src: Path, dst: Path, text: str) -> Path:
    shutil.copytree(src, dst)
    (dst / "metrics.jsonl").write_text(text)
    return dst


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda src, d: d / "nowhere", "{d}/nowhere: no such directory"),
        (
            lambda src, d: (d / "empty").mkdir() or d / "empty",
            "{d}/empty: no metrics.jsonl (not a run directory)",
        ),
        (
            lambda src, d: _copy_with_rows(src, d / "bad", '{"round": 1}\n\n{"round": 2\n'),
            "{d}/bad/metrics.jsonl:3: not valid JSON (Expecting ',' delimiter)",
        ),
        (
            lambda src, d: _copy_with_rows(src, d / "list", '{"round": 1}\n[1, 2]\n'),
            "{d}/list/metrics.jsonl:2: expected a JSON object, got list",
        ),
        (
            lambda src, d: _copy_with_rows(src, d / "noround", '{"round": 1}\n{"loss": 0.5}\n'),
            "{d}/noround/metrics.jsonl: row 2 has no integer 'round' (got None)",
        ),
        (lambda src, d: _copy_with_rows(src, d / "none", ""), "{d}/none/metrics.jsonl: no rounds recorded"),
    ],
    ids=["missing", "no-metrics", "malformed", "not-object", "no-round", "no-rounds"],
)
def test_bad_run_directories_exit_2_with_one_line(runs, tmp_path, capsys, make, message):
    bad = make(runs[0], tmp_path)
    out = tmp_path / "report"
    assert main(["report", str(runs[0]), str(bad), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"fedgrid report: error: {message.format(d=tmp_path)}"]
    assert not out.exists()  # nothing written for a bad argument


def test_no_run_directory_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report"])
    assert exc.value.code == 2
    assert "RUN_DIR" in capsys.readouterr().err


def test_a_run_without_accuracy_plots_what_it_has(runs, tmp_path, capsys):
    rows = read_metrics(runs[0])
    text = "".join(json.dumps({**r, "accuracy": None}) + "\n" for r in rows)
    bare = _copy_with_rows(runs[0], tmp_path / "bare", text)
    out = tmp_path / "only"
    assert main(["report", str(bare), "--out", str(out)]) == 0
    assert capsys.readouterr().err.splitlines() == ["fedgrid report: bare: no accuracy recorded; not plotted"]
    assert sorted(p.name for p in out.glob("*.png")) == sorted(set(PLOTS) - {"accuracy.png"})
    assert "bare: no accuracy recorded; not plotted" in (out / "report.html").read_text()
    # Beside a run that has it, the accuracy plot holds that run's line only.
    figs = figures(load_runs([str(bare), str(runs[1])]))
    assert [line.get_label() for line in figs["accuracy.png"].axes[0].lines] == [runs[1].name]
    assert [line.get_label() for line in figs["loss.png"].axes[0].lines] == ["bare", runs[1].name]


def _event(event: str, **fields) -> str:
    return json.dumps({"t": 1.0, "event": event, **fields}) + "\n"


def _coordinator_run(src: Path, dst: Path) -> Path:
    """A run directory with the events a coordinator writes: alice trains every round; bob
    fails round 2, breaks an upload in round 3 then delivers it; carol joins for round 3
    under a second session id (a restart) after her first session's round 1."""
    shutil.copytree(src, dst)
    (dst / "events.jsonl").write_text(
        "".join(
            [
                _event("started", run_id="r", address="127.0.0.1:1", threads=1),
                _event("client_joined", client="c1", name="alice", region=""),
                _event("client_joined", client="c2", name="bob", region=""),
                _event("client_joined", client="c3", name="carol", region=""),
                _event("round_opened", round=1, task="t1", clients=3, evaluate=False, phase="fit"),
                _event("update_accepted", round=1, client="c1", evaluate=False, accepted=1, expected=3),
                _event("update_accepted", round=1, client="c2", evaluate=False, accepted=2, expected=3),
                _event("update_accepted", round=1, client="c3", evaluate=False, accepted=3, expected=3),
                _event(
                    "update_accepted", round=1, client="c3", evaluate=True, accepted=1, expected=1
                ),  # evaluation: not training
                _event("update_accepted", round=2, client="c1", evaluate=False, accepted=1, expected=2),
                _event("failure_reported", round=2, client="c2", reason="out of memory"),
                _event("client_joined", client="c9", name="carol", region=""),
                _event("update_accepted", round=3, client="c1", evaluate=False, accepted=1, expected=3),
                _event("upload_broken", round=3, client="c2", chunks=2),
                _event("update_accepted", round=3, client="c2", evaluate=False, accepted=2, expected=3),
                _event("update_accepted", round=3, client="c9", evaluate=False, accepted=3, expected=3),
                '{"t": 2.0, "event": "round_comm',  # torn by a kill mid-write
            ]
        )
    )
    return dst


def test_participation_heatmap_from_events(runs, tmp_path):
    run = load_run(_coordinator_run(runs[0], tmp_path / "coordinator"))
    clients, rounds, cells = participation(run)  # type: ignore[misc]
    assert clients == ["alice", "bob", "carol"] and rounds == [1, 2, 3]
    assert cells == [[2, 2, 2], [2, 1, 2], [2, 0, 2]]
    figs = figures([run])
    assert list(figs) == [*PLOTS, "participation-1.png"]
    ax = figs["participation-1.png"].axes[0]
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), np.array(cells))
    assert [t.get_text() for t in ax.get_yticklabels()] == clients
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3"]
    assert participation(load_run(runs[0])) is None


def test_malformed_event_line_is_named(runs, tmp_path, capsys):
    d = _coordinator_run(runs[0], tmp_path / "coordinator")
    lines = (d / "events.jsonl").read_text().splitlines(keepends=True)
    (d / "events.jsonl").write_text("".join(lines[:4] + ["not json\n"] + lines[4:]))
    with pytest.raises(ReportError, match=re.escape(f"{d}/events.jsonl:5: not valid JSON")):
        load_run(d)


def test_an_unwritable_out_is_one_line(runs, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["report", str(runs[0]), "--out", str(tmp_path / "file")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"fedgrid report: error: cannot write {tmp_path / 'file'}: File exists"
    ]


def test_one_runs_report_goes_beside_it_with_integer_counts_a_percentage_and_named_lines(runs, tmp_path):
    """The newcomer's report: written into the run's folder (not ./report), the clients plot in
    whole clients, accuracy a percentage as on the status page, and a legend that names what the
    lines are (the run's name goes in the title)."""
    run = shutil.copytree(runs[0], tmp_path / "demo")
    assert main(["report", str(run)]) == 0
    assert sorted(p.name for p in (run / "report").glob("*.png")) == sorted(PLOTS)
    figs = figures(load_runs([str(run)]))
    clients = figs["clients.png"].axes[0]
    ticks = [t for t in clients.get_yticks() if clients.get_ylim()[0] <= t <= clients.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert [line.get_label() for line in clients.lines] == ["clients ok", "clients failed"]
    assert [t.get_text() for t in clients.get_legend().get_texts()] == ["clients ok", "clients failed"]
    accuracy = figs["accuracy.png"].axes[0]
    assert accuracy.get_ylabel() == "accuracy (%)" and accuracy.get_legend() is None
    assert accuracy.yaxis.get_major_formatter()(0.5, 0) == "50.0%"
    assert figs["accuracy.png"].get_suptitle() == "Accuracy per round: demo"
