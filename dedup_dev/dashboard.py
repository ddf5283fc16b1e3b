"""The Grafana dashboard's panels drawn with matplotlib from a Prometheus's data.

No Grafana runs here, so the picture of ``compose/grafana/dashboards/dedup.json``
in docs/operations.md is drawn by :func:`render`: each panel's targets go to
Prometheus's ``/api/v1/query_range`` over the given time range, and each panel
becomes one subplot where the dashboard's ``gridPos`` puts it, with the panel's
title, its targets' ``legendFormat`` and its unit (``s`` as ms or s).
tests/integration/test_prometheus.py renders it on every run.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

# Grafana's grid: 24 columns, rows of 30 px; drawn here as this many inches.
COLUMNS = 24
INCHES_PER_COLUMN = 0.6
INCHES_PER_ROW = 0.42
# Room around each panel (inches) for its title, tick labels and axis label.
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 0.75, 0.2, 0.35, 0.5
HEADER = 0.5
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with each ``$name`` of ``variables`` replaced, longest names first."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${name}", variables[name])
    return expr


def query_range(
    prometheus: str, expr: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    """The range vector (``metric``, ``values``) Prometheus answers for ``expr``."""
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
    url = f"{prometheus.rstrip('/')}/api/v1/query_range?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 (a URL we were given)
        body = json.loads(answer.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus at {prometheus} refused {expr!r}: {body}")
    return list(body["data"]["result"])


def legend(template: str, metric: Mapping[str, str]) -> str:
    """Grafana's ``legendFormat``: ``{{label}}`` replaced by the series' label value."""
    return LEGEND_LABEL.sub(lambda m: metric.get(m[1], ""), template) or str(dict(metric))


def _seconds(value: float, _position: object = None) -> str:
    if value == 0:
        return "0"
    if abs(value) < 1:
        return f"{value * 1000:g} ms"
    return f"{value:g} s"


def draw_panel(
    ax: Axes,
    panel: Mapping[str, Any],
    series: list[tuple[str, list[float], list[float]]],
    span: float,
) -> None:
    """One panel: its series as lines over ``span`` seconds, its title, its unit on the y axis."""
    for label, times, values in series:
        ax.plot(times, values, label=label, linewidth=1.2, marker=".", markersize=3)
    ax.set_title(panel["title"], fontsize=9, loc="left")
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    if unit == "s":
        ax.yaxis.set_major_formatter(FuncFormatter(_seconds))
    ax.set_xlim(0, span)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds into the run", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=6, loc="upper left")
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")


def render(
    dashboard: Mapping[str, Any],
    prometheus: str,
    start: float,
    end: float,
    out: Path,
    *,
    variables: Mapping[str, str],
    step: float = 1.0,
) -> Figure:
    """Draw every panel of ``dashboard`` from ``prometheus`` between ``start`` and ``end``.

    ``start`` and ``end`` are Unix times; ``variables`` replace the dashboard's
    ``$name`` variables in each query (Grafana's own ones too, such as
    ``__rate_interval``).  The PNG is written to ``out``; the figure, one axes
    per panel in the dashboard's order, is returned.
    """
    panels = list(dashboard["panels"])
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width, height = COLUMNS * INCHES_PER_COLUMN, rows * INCHES_PER_ROW + HEADER
    figure = Figure(figsize=(width, height), dpi=80)
    figure.suptitle(f"{dashboard['title']} (drawn by matplotlib from Prometheus)", fontsize=11)
    for panel in panels:
        pos = panel["gridPos"]
        left = pos["x"] * INCHES_PER_COLUMN + PAD_LEFT
        top = HEADER + pos["y"] * INCHES_PER_ROW + PAD_TOP
        w = pos["w"] * INCHES_PER_COLUMN - PAD_LEFT - PAD_RIGHT
        h = pos["h"] * INCHES_PER_ROW - PAD_TOP - PAD_BOTTOM
        ax = figure.add_axes((left / width, 1 - (top + h) / height, w / width, h / height))
        series = []
        for target in panel["targets"]:
            expr = substitute(target["expr"], variables)
            for result in query_range(prometheus, expr, start, end, step):
                points = [(float(t) - start, float(v)) for t, v in result["values"]]
                times = [t for t, _ in points]
                # NaN (a quantile over no new observations) leaves a gap, as in Grafana.
                values = [v if math.isfinite(v) else math.nan for _, v in points]
                label = legend(target.get("legendFormat", ""), result["metric"])
                series.append((label, times, values))
        draw_panel(ax, panel, series, end - start)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return figure
