"""``build_report``: read the inputs, build every section, render one self-contained HTML file."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2
from megatron_npu.reports import (
    bench_view,
    charts,
    compare_view,
    diff,
    locate_view,
    parity_view,
    summary_view,
)
from megatron_npu.reports.errors import ReportInputError
from megatron_npu.reports.formatting import number, status_class
from megatron_npu.reports.inputs import ResultSet, load

from megatron_npu.files import write_private


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["status_class"] = status_class
    env.filters["num"] = number
    return env


def _asset(name: str) -> str:
    return files(__package__).joinpath("templates", name).read_text(encoding="utf-8")


def context(rs: ResultSet, base: ResultSet | None = None) -> dict[str, Any]:
    """Everything the template shows, computed from the records."""
    bench_lines = bench_view.lines(rs.benches)
    return {
        "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "sources": rs.sources,
        "kinds": rs.kinds(),
        "banner": summary_view.banner(rs, bench_view.flag_counts(bench_lines)),
        "skipped": rs.skipped,
        "parity_rows": parity_view.matrix_rows(rs.parity),
        "parity_filters": parity_view.filter_values(parity_view.matrix_rows(rs.parity)),
        "coverage": parity_view.coverage_rows(rs.parity) if rs.parity else [],
        "comparisons": [
            compare_view.comparison_section(c, i) for i, c in enumerate(rs.comparisons)
        ],
        "headline": compare_view.headline(rs.comparisons),
        "locates": [locate_view.section(r, i) for i, r in enumerate(rs.locates)],
        "bench_lines": bench_lines,
        "bench_charts": bench_view.charts_by_device(bench_lines),
        "baseline_path": bench_view.BASELINE_PATH,
        "provenance": {
            "parity": summary_view.parity_provenance(rs),
            "compare": summary_view.compare_provenance(rs),
            "benchmark": summary_view.benchmark_provenance(rs),
            "info": summary_view.info_provenance(rs),
        },
        "diff": diff.diff(base, rs) if base is not None else None,
        "shift_share": diff.SHIFT_SHARE,
        "css": _asset("report.css"),
        "js": _asset("report.js"),
        "plotly_js": charts.plotly_js(),
    }


def render(rs: ResultSet, base: ResultSet | None = None) -> str:
    return _environment().get_template("report.html.j2").render(**context(rs, base))


def build_report(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    diff_base: Sequence[str | Path] | None = None,
) -> Path:
    """Write one self-contained HTML report of ``inputs`` to ``output`` and return its path.

    ``inputs``: parity results folders, ``compare`` output folders (or their results.json),
    pytest-benchmark JSON files, ``megatron-npu info --json`` files, in any mix. With
    ``diff_base`` (the older result set) the page opens with what changed. Inputs that cannot be
    used are listed on the page with the reason; a path that does not exist raises
    :class:`ReportInputError`. The file is written atomically, mode 0640 as the parity records it
    is made from (:func:`megatron_npu.files.write_private`).
    """
    if diff_base is not None and not diff_base:
        raise ReportInputError("diff_base needs at least one path")
    out = Path(output)
    if out.is_dir():
        raise ReportInputError(f"output {str(out)!r} is a directory; name the .html file")
    new = load(inputs)
    base = load(diff_base) if diff_base is not None else None
    html = render(new, base)
    write_private(out, html)
    return out
