"""``fedgrid report``: plots of run directories, as PNG files and one self-contained HTML page.

It reads what every run writes (``fedgrid.runlog``): ``metrics.jsonl`` for accuracy, loss,
bytes up and down and clients ok / failed per round, ``config.toml`` for the table, and,
where a coordinator wrote one, ``events.jsonl`` (``fedgrid.events``) for a client x round
participation heatmap. Several runs are overlaid, one colour each.

The series plotted are computed apart from the drawing (``Run.series``, ``participation``)
so that a test compares them with ``metrics.jsonl`` rather than with pixels. Plots use
matplotlib's object API on the Agg canvas (no pyplot, no display, no global backend).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import tomllib

from fedgrid.errors import FedgridError

__all__ = [
    "ReportError",
    "Run",
    "load_run",
    "load_runs",
    "participation",
    "figures",
    "write_report",
    "METRICS",
    "PLOTS",
]

#: The metrics ``fedgrid report`` plots, in the order of the page.
METRICS = ("accuracy", "loss", "bytes_up", "bytes_down", "clients_ok", "clients_failed")
#: PNG file -> (title, the metrics it holds).
PLOTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "accuracy.png": ("Accuracy per round", ("accuracy",)),
    "loss.png": ("Loss per round", ("loss",)),
    "bytes.png": ("Bytes per round", ("bytes_up", "bytes_down")),
    "clients.png": ("Clients per round", ("clients_ok", "clients_failed")),
}
_STYLE = {"bytes_up": "-", "bytes_down": "--", "clients_ok": "-", "clients_failed": "--"}
# Heatmap cells: 0 no event, 1 failed (reported a failure or broke its upload), 2 update accepted.
_FAILED, _OK = 1, 2
_COLORS = ["#eeeeee", "#d62728", "#2ca02c"]


class ReportError(FedgridError, ValueError):
    """A run directory that cannot be reported on; the message names the file (and line)."""


@dataclass
class Run:
    """One run directory, read.

    Attributes:
        label: the legend's name (the directory's name, or ``--label``).
        path: the directory.
        rows: ``metrics.jsonl``, one dict a round.
        config: ``config.toml`` (empty when the run has none).
        events: ``events.jsonl`` as dicts (empty: a simulation, which writes none).
    """

    label: str
    path: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """Rounds and values of ``metric``, from the rows that have it as a number."""
        points = [
            (int(r["round"]), float(r[metric]))
            for r in self.rows
            if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)
        ]
        return [p[0] for p in points], [p[1] for p in points]

    def missing(self) -> list[str]:
        """The plotted metrics that no round of this run has."""
        return [m for m in METRICS if not self.series(m)[0]]

    def final(self, metric: str) -> float | None:
        """The last value of ``metric`` (``None``: never recorded)."""
        values = self.series(metric)[1]
        return values[-1] if values else None

    def total(self, metric: str) -> float | None:
        values = self.series(metric)[1]
        return sum(values) if values else None


def _json_lines(path: Path, *, torn_tail_ok: bool) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file. A coordinator killed mid-write may leave a torn
    last line in ``events.jsonl``: skipped there (``torn_tail_ok``); any other bad line is
    an error naming the file and the line."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if torn_tail_ok and number == len(lines):
                break
            raise ReportError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ReportError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        out.append(obj)
    return out


def load_run(path: str | os.PathLike[str], label: str | None = None) -> Run:
    """Reads the run directory ``path``.

    Raises:
        ReportError: no such directory, no ``metrics.jsonl``, a malformed line (file and
            line number), a row without an integer ``round``, no rounds at all, or an
            unreadable ``config.toml``.
    """
    d = Path(path)
    if not d.is_dir():
        raise ReportError(f"{d}: no such directory")
    metrics = d / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{d}: no metrics.jsonl (not a run directory)")
    rows = _json_lines(metrics, torn_tail_ok=False)
    for number, row in enumerate(rows, 1):
        if not isinstance(row.get("round"), int) or isinstance(row.get("round"), bool):
            raise ReportError(f"{metrics}: row {number} has no integer 'round' (got {row.get('round')!r})")
    if not rows:
        raise ReportError(f"{metrics}: no rounds recorded")
    config: dict[str, Any] = {}
    if (d / "config.toml").is_file():
        try:
            config = tomllib.loads((d / "config.toml").read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ReportError(f"{d / 'config.toml'}: not valid TOML ({exc})") from None
    events = _json_lines(d / "events.jsonl", torn_tail_ok=True) if (d / "events.jsonl").is_file() else []
    return Run(
        label=label if label is not None else (d.resolve().name or str(d)),
        path=d,
        rows=rows,
        config=config,
        events=events,
    )


def load_runs(paths: Sequence[str], labels: Sequence[str] | None = None) -> list[Run]:
    """``load_run`` of each path; ``labels`` (one per path) name them in the legend. Two
    directories of the same name (``a/run``, ``b/run``) are labelled by the paths given.

    Raises:
        ReportError: see ``load_run``; also a count of labels that is not the count of runs.
    """
    if labels and len(labels) != len(paths):
        raise ReportError(
            f"{len(labels)} --label for {len(paths)} run directories: give one per run, in order"
        )
    runs = [load_run(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    if not labels and len({r.label for r in runs}) < len(runs):
        for run, given in zip(runs, paths):
            run.label = str(given)
    return runs


def participation(run: Run) -> tuple[list[str], list[int], list[list[int]]] | None:
    """The client x round participation of a coordinator's run, from its per-client events:
    (client names, rounds, cells) with cells[i][j] 2 when client i's update of round j was
    accepted, 1 when it reported a failure or broke its upload and was not accepted, 0 when
    it has no event that round. ``None`` when the run has no per-client round events
    (a simulation). Clients are named by their ``client_joined`` name, else their id;
    evaluation rounds' uploads are left out (the heatmap shows training)."""
    names: dict[str, str] = {}
    cells: dict[tuple[str, int], int] = {}
    for e in run.events:
        kind, client = e.get("event"), e.get("client")
        if kind == "client_joined" and isinstance(client, str):
            names[client] = str(e.get("name") or client)
        if not isinstance(client, str) or not isinstance(e.get("round"), int):
            continue
        key = (client, e["round"])
        if kind == "update_accepted" and not e.get("evaluate"):
            cells[key] = _OK
        elif kind in ("failure_reported", "upload_broken"):
            cells[key] = max(cells.get(key, 0), _FAILED)
    if not cells:
        return None
    # Rows by name: a client that rejoined (a new session id) keeps its row.
    by_name: dict[tuple[str, int], int] = {}
    for (client, rnd), value in cells.items():
        key = (names.get(client, client), rnd)
        by_name[key] = max(by_name.get(key, 0), value)
    clients = sorted({c for c, _ in by_name})
    rounds = sorted({int(r["round"]) for r in run.rows} | {r for _, r in by_name})
    grid = [[by_name.get((c, r), 0) for r in rounds] for c in clients]
    return clients, rounds, grid


def _plain(text: str) -> str:
    """``text`` shown as is by matplotlib: a ``$`` would start mathtext (and a bad formula raises)."""
    return text.replace("$", r"\$")


def figures(runs: Sequence[Run]) -> dict[str, Any]:
    """The figures of a report, by PNG file name: the overlaid plots of ``PLOTS`` that
    some run has data for, then ``participation-N.png`` for each run N (1-based, in
    argument order) with per-client events. Each line's data is ``Run.series``."""
    import matplotlib.figure  # noqa: F401 - without the optional extra it fails here, whatever the runs hold

    out: dict[str, Any] = {}
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for name, (title, metrics) in PLOTS.items():
        if not any(run.series(m)[0] for run in runs for m in metrics):
            continue
        out[name] = _metric_figure(name, title, metrics, runs, colors)
    for number, run in enumerate(runs, 1):
        grid = participation(run)
        if grid is None:
            continue
        out[f"participation-{number}.png"] = _participation_figure(run, grid)
    return out


def _metric_figure(
    name: str, title: str, metrics: Sequence[str], runs: Sequence[Run], colors: Sequence[str]
) -> Any:
    """The figure ``name`` of ``PLOTS``: ``metrics`` per round, one line per run (``bytes.png``:
    one panel per metric; the others: every metric on one panel). Several runs: the legend names
    them; one run: its name is in the title, and the legend names the metrics where a panel has
    more than one. Accuracy is a percentage (as on the status page), counts have integer ticks."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, MaxNLocator, PercentFormatter

    single = len(runs) == 1
    fig = Figure(figsize=(7.5, 3.2 * len(metrics) if name == "bytes.png" else 4.0), layout="constrained")
    axes = (
        fig.subplots(len(metrics), 1, squeeze=False)[:, 0]
        if name == "bytes.png"
        else [fig.subplots()] * len(metrics)
    )
    for ax, metric in zip(axes, metrics):
        for run, color in zip(runs, colors):
            xs, ys = run.series(metric)
            if xs:
                shared = len(metrics) > 1 and name != "bytes.png"
                suffix = f" ({metric.replace('_', ' ')})" if shared else ""
                ax.plot(
                    xs,
                    ys,
                    _STYLE.get(metric, "-"),
                    color=color,
                    marker="o",
                    markersize=3,
                    label=metric.replace("_", " ") if single else _plain(run.label + suffix),
                )
        ylabel = metric.replace("_", " ") if len(set(axes)) > 1 else title.split(" per")[0].lower()
        ax.set_xlabel("round")
        ax.set_ylabel(ylabel + " (%)" if metric == "accuracy" else ylabel)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if metric.startswith(("bytes", "clients")):
            ax.set_ylim(bottom=0)  # a count: its zero is meaningful
        if metric.startswith("clients"):
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # no 0.25 of a client
        if metric.startswith("bytes"):
            ax.yaxis.set_major_formatter(EngFormatter(unit="B"))
        if metric == "accuracy":
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    for ax in dict.fromkeys(axes):
        if ax.lines and not (single and len(ax.lines) == 1):
            ax.legend(fontsize="small")
    fig.suptitle(f"{title}: {_plain(runs[0].label)}" if single else title)
    return fig


def _participation_figure(run: Run, grid: tuple[list[str], list[int], list[list[int]]]) -> Any:
    """``run``'s participation grid (``participation``): a cell per client and round."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    clients, rounds, cells = grid
    fig = Figure(
        figsize=(max(6.5, 0.35 * len(rounds) + 4.0), max(2.5, 0.3 * len(clients) + 1.5)),
        layout="constrained",
    )
    ax = fig.subplots()
    ax.imshow(cells, aspect="auto", interpolation="nearest", vmin=0, vmax=_OK, cmap=ListedColormap(_COLORS))
    ax.set_xticks(range(len(rounds)), [str(r) for r in rounds])
    ax.set_yticks(range(len(clients)), [_plain(c) for c in clients])
    ax.set_xlabel("round")
    ax.set_title(_plain(f"{run.label}: participation per client"), fontsize="medium")
    fig.legend(
        handles=[
            Patch(color=c, label=t) for c, t in zip(_COLORS[::-1], ("update accepted", "failed", "no event"))
        ],
        loc="outside right upper",
        fontsize="small",
    )
    return fig


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _number(value: float | None, kind: str) -> str:
    if value is None:
        return "&ndash;"
    if kind == "percent":  # accuracy, a percentage as on the plots and the status page
        return f"{value * 100:.2f}%" if math.isfinite(value) else str(value)
    if kind == "bytes":
        return f"{value / 1e6:,.3f} MB"
    if kind == "int":
        return f"{int(value):,}"
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def _html(runs: Sequence[Run], pngs: Mapping[str, bytes], notes: Sequence[str]) -> str:
    e = html.escape
    head = [
        "run",
        "rounds",
        "final accuracy",
        "final loss",
        "bytes up (total)",
        "bytes down (total)",
        "wall s (total)",
        "clients ok (total)",
        "clients failed (total)",
        "directory",
    ]
    rows = []
    for run in runs:
        cells = [
            e(run.label),
            str(len(run.rows)),
            _number(run.final("accuracy"), "percent"),
            _number(run.final("loss"), "f"),
            _number(run.total("bytes_up"), "bytes"),
            _number(run.total("bytes_down"), "bytes"),
            _number(run.total("wall_s"), "f"),
            _number(run.total("clients_ok"), "int"),
            _number(run.total("clients_failed"), "int"),
            e(str(run.path)),
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    images = "\n".join(
        f'<figure><img alt="{e(name)}" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'
        f"<figcaption>{e(name)}</figcaption></figure>"
        for name, data in pngs.items()
    )
    note_html = "".join(f"<li>{e(n)}</li>" for n in notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fedgrid report: {e(", ".join(r.label for r in runs))}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:right}}
td:first-child,td:last-child{{text-align:left}}img{{max-width:100%}}figure{{margin:1.5em 0}}</style></head>
<body><h1>fedgrid report</h1>
<table><thead><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
{f"<ul>{note_html}</ul>" if notes else ""}
{images}
</body></html>
"""


def write_report(runs: Sequence[Run], out: str | os.PathLike[str]) -> tuple[list[Path], list[str]]:
    """Writes the PNGs of ``figures(runs)`` and ``report.html`` (the same PNGs embedded,
    the table of final numbers, the notes) into ``out``.

    Returns:
        The files written, and the notes: each metric a run lacks, which is not plotted.
    """
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    notes = [
        f"{run.label}: no {', '.join(run.missing())} recorded; not plotted" for run in runs if run.missing()
    ]
    pngs = {name: _png(fig) for name, fig in figures(runs).items()}
    written = []
    for name, data in pngs.items():
        (d / name).write_bytes(data)
        written.append(d / name)
    (d / "report.html").write_text(_html(runs, pngs, notes), encoding="utf-8")
    written.append(d / "report.html")
    return written, notes
