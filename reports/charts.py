"""Plotly figures as HTML fragments; the page inlines plotly.js once (no CDN, works offline)."""

from __future__ import annotations

from functools import cache
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

#: Plotly options for every figure: no link out to plotly's cloud, no logo.
CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["sendDataToCloud"]}


@cache
def plotly_js() -> str:
    """The full plotly.js bundle, inlined once per page."""
    return get_plotlyjs()


def to_div(fig: go.Figure, div_id: str) -> str:
    fig.update_layout(margin={"l": 60, "r": 20, "t": 40, "b": 50}, template="plotly_white")
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=CONFIG)


def _lines(series: list[dict[str, Any]], y: str, label: str, fmt: str) -> go.Figure:
    """One trace per entry of ``series`` (``legend``, ``iterations`` and the values at ``y``),
    against iteration; the hover names the entry."""
    fig = go.Figure()
    for line in series:
        fig.add_trace(
            go.Scatter(
                x=line["iterations"],
                y=line[y],
                mode="lines+markers",
                name=line["legend"],
                marker={"size": 4},
                hovertemplate=(
                    f"step %{{x}}<br>{label} %{{y:{fmt}}}<extra>%{{fullData.name}}</extra>"
                ),
            )
        )
    return fig


def loss_curves(title: str, runs: list[dict[str, Any]], div_id: str) -> str:
    """One trace per run: loss against iteration; hover shows every run's value at a step."""
    fig = _lines(runs, "losses", "loss", ".6g")
    fig.update_layout(
        title=title,
        xaxis_title="iteration",
        yaxis_title="lm loss",
        hovermode="x unified",
        height=360,
    )
    return to_div(fig, div_id)


def grad_norms(title: str, runs: list[dict[str, Any]], div_id: str) -> str:
    """Grad norm per step, one trace per run."""
    fig = _lines(runs, "grad_norms", "grad norm", ".6g")
    fig.update_layout(
        title=title,
        xaxis_title="iteration",
        yaxis_title="grad norm",
        hovermode="x unified",
        height=300,
        legend={"orientation": "h", "y": -0.3},
    )
    return to_div(fig, div_id)


def relative_differences(
    title: str,
    series: list[dict[str, Any]],
    band: float | None,
    div_id: str,
    step_bands: list[dict[str, Any]] = (),
) -> str:
    """Per-step relative difference of several candidates against their baseline, one trace
    each (``legend``, ``iterations``, ``rel_diff``), the tolerance band shaded; ``step_bands``:
    bands that change from step to step (``legend``, ``iterations``, ``band``: the noise rule's),
    each a shaded area up to its edge."""
    fig = _lines(series, "rel_diff", "rel. diff", ".3e")
    for edge in step_bands:
        fig.add_trace(
            go.Scatter(
                x=edge["iterations"],
                y=edge["band"],
                mode="lines",
                name=edge["legend"],
                line={"dash": "dash", "width": 1},
                fill="tozeroy",
                opacity=0.3,
                hovertemplate="step %{x}<br>band %{y:.3e}<extra>%{fullData.name}</extra>",
            )
        )
    if band is not None:
        fig.add_hrect(
            y0=-band,
            y1=band,
            fillcolor="green",
            opacity=0.12,
            line_width=0,
            annotation_text=f"tolerance ±{band:g}",
            annotation_position="top left",
        )
    fig.update_layout(
        title=title,
        xaxis_title="iteration",
        yaxis_title="(candidate - baseline) / |baseline|",
        height=320,
        legend={"orientation": "h", "y": -0.3},
    )
    return to_div(fig, div_id)


def benchmark_bars(title: str, lines: list[dict[str, Any]], div_id: str) -> str:
    """Median time per op, one bar group per op, one colour per path, whiskers to q1/q3."""
    paths = sorted({row["path"] for line in lines for row in line["rows"]})
    fig = go.Figure()
    for path in paths:
        xs, ys, lo, hi = [], [], [], []
        for line in lines:
            for row in line["rows"]:
                if row["path"] == path:
                    xs.append(line["label"])
                    ys.append(row["median"])
                    lo.append(row["median"] - row["q1"])
                    hi.append(row["q3"] - row["median"])
        fig.add_trace(
            go.Bar(
                x=xs,
                y=ys,
                name=path,
                error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
                hovertemplate="%{x}<br>median %{y:.4g} s<extra>" + path + "</extra>",
            )
        )
    fig.update_layout(
        title=title, barmode="group", yaxis_title="seconds (median, q1-q3)", height=380
    )
    return to_div(fig, div_id)
