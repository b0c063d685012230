"""The generated report in a real browser (Debian's headless Chromium through playwright).

Checks what a reader relies on: no console errors, no network requests (the page must work
offline from file://), the parity table filters on a click, every loss-curve plot has one trace
per run, and the emulation label is shown wherever an emulated device ran. A screenshot is saved
as a test artefact (and copied to $REPORT_ARTIFACTS when set). CI installs chromium (.ci/run), so
this test fails rather than skips when the browser is missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import report_fixtures as fx
from megatron_npu.reports import build_report

BROWSER_ENV = "REPORT_CHROMIUM"
ARTIFACTS_ENV = "REPORT_ARTIFACTS"
#: generous: parsing the inlined plotly.js on a loaded 2-core CI machine can take many seconds
PAGE_TIMEOUT_MS = 180_000
#: the page must fit this width without a horizontal scroll of the body
PAGE_WIDTH = 1280


def _chromium() -> str:
    path = (
        os.environ.get(BROWSER_ENV) or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    if not path:
        pytest.fail(
            f"no chromium found: install Debian's chromium (.ci/run does) or set ${BROWSER_ENV}"
        )
    return path


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        yield b
        b.close()


class Opened:
    def __init__(self, browser, path: Path):
        self.url = path.resolve().as_uri()
        self.page = browser.new_page(viewport={"width": PAGE_WIDTH, "height": 1000})
        self.page.set_default_timeout(PAGE_TIMEOUT_MS)
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(self.url, wait_until="load")
        self.page.wait_for_function("window.Plotly !== undefined")

    def visible_rows(self) -> list[str]:
        return self.page.eval_on_selector_all(
            "#parity-table > tbody > tr.cell-row",
            "rows => rows.filter(r => !r.hidden).map(r => r.dataset.key)",
        )

    def screenshot(self, tmp_path: Path, name: str) -> Path:
        shot = tmp_path / name
        self.page.screenshot(path=str(shot), full_page=True)
        target = os.environ.get(ARTIFACTS_ENV)
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(target) / name)
        return shot


@pytest.fixture(scope="module")
def report(parity_runs, compare_dir, bench_file, info_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "report.html"
    return build_report([parity_runs["planted"], compare_dir, bench_file, info_file], out)


# its setup builds (or waits for the other xdist worker to build) every report input: real
# parity cells, a compare run and a benchmark run, about 75 s on a quiet machine and far more
# beside the suite's training runs; the limit covers the wait too
@pytest.mark.timeout(1800)
def test_report_in_chromium(browser, report, tmp_path):
    opened = Opened(browser, report)
    page = opened.page

    # every loss-curve plot: one trace per run of the comparison, named after it
    traces = page.eval_on_selector_all(
        ".loss-plot .js-plotly-plot", "plots => plots.map(p => p.data.map(t => t.name))"
    )
    assert len(traces) == 1
    assert [name.split(" ")[0] for name in traces[0]] == [r[0] for r in fx.RUNS]
    assert all(("[emulated]" in n) == r[2] for n, r in zip(traces[0], fx.RUNS, strict=True))
    # per curve rule: every candidate's relative difference overlaid in one chart; one chart
    # of every run's grad norms
    overlays = page.eval_on_selector_all(
        ".reldiff-plot",
        "divs => divs.map(d => [d.dataset.rule, "
        "d.querySelector('.js-plotly-plot').data.map(t => t.name)])",
    )
    assert sorted(rule for rule, _ in overlays) == ["approximate", "layout"]
    assert all(names and all(" vs " in n for n in names) for _, names in overlays)
    assert sum(len(names) for _, names in overlays) >= len(fx.RUNS) - 1
    grad = page.eval_on_selector_all(
        ".gradnorm-plot .js-plotly-plot", "plots => plots.map(p => p.data.map(t => t.name))"
    )
    assert len(grad) == 1 and [n.split(" ")[0] for n in grad[0]] == [r[0] for r in fx.RUNS]
    assert page.inner_text("#headline").startswith("Comparison passed")

    # the verdict matrix: a badge per cell, its detail on hover (title) and on a click, and no
    # cell cut off at 1280 px
    matrix = page.locator(".verdict-matrix")
    box = matrix.bounding_box()
    assert box["x"] + box["width"] <= PAGE_WIDTH
    clipped = page.eval_on_selector_all(
        ".verdict-matrix td, .verdict-matrix th",
        "cells => cells.filter(c => c.scrollWidth > c.clientWidth + 1).length",
    )
    assert clipped == 0
    cell = page.locator(".verdict-matrix td.verdict-cell:not(.empty)").first
    assert cell.get_attribute("title")
    detail = cell.locator(".verdict-detail")
    assert detail.is_hidden()
    cell.locator("summary").click()
    assert detail.is_visible() and detail.inner_text().strip()

    # Table 2: human column names with units, MFU in %, and no horizontal scroll at 1280 px
    headers = page.eval_on_selector_all(".table2 th", "ths => ths.map(t => t.innerText.trim())")
    assert "MFU % [95% CI]" in headers and "s/step [95% CI]" in headers
    assert not any("_" in h for h in headers)
    assert page.evaluate("document.documentElement.scrollWidth") <= PAGE_WIDTH
    table_box = page.locator(".table2").bounding_box()
    assert table_box["x"] + table_box["width"] <= PAGE_WIDTH
    page.locator("#table2").screenshot(path=str(tmp_path / "table2.png"))

    # the parity table filters on a click: the planted regression is the one error cell
    all_rows = opened.visible_rows()
    assert len(all_rows) == len(fx.PARITY_DEVICES) * len(fx.PARITY_DTYPES)
    page.click('button[data-status-filter="error"]')
    [error_row] = opened.visible_rows()
    assert error_row.endswith("|" + fx.PLANTED_CELL[0]) and f"|{fx.PLANTED_CELL[1]}|" in error_row
    page.click('button[data-status-filter=""]')
    assert opened.visible_rows() == all_rows
    page.select_option('select[data-filter="device"]', "npu-emulated")
    assert {k.rsplit("|", 1)[1] for k in opened.visible_rows()} == {"npu-emulated"}
    page.select_option('select[data-filter="device"]', "")
    # a cell opens to its metrics, tolerance and reason
    detail = page.locator(f'tr.cell-detail[data-for="{error_row}"]')
    assert detail.is_hidden()
    page.click(f'tr.cell-row[data-key="{error_row}"]')
    assert detail.is_visible()
    text = detail.inner_text()
    assert "cosine" in text and "tolerance" in text and "dual_hundredth" in text
    page.click('th:has-text("dtype")')  # sorting keeps each detail row under its cell
    assert (
        page.eval_on_selector(
            f'tr.cell-row[data-key="{error_row}"]', "r => r.nextElementSibling.dataset.for"
        )
        == error_row
    )

    # the emulation label wherever an emulated device ran, and nowhere else
    labelled = page.eval_on_selector_all(
        ".device",
        "els => els.map(e => [e.dataset.device, !!(e.nextElementSibling && "
        "e.nextElementSibling.classList.contains('emulated-label'))])",
    )
    assert any(device == "npu-emulated" for device, _ in labelled)
    assert all(flag == (device == "npu-emulated") for device, flag in labelled)

    shot = opened.screenshot(tmp_path, "report.png")
    assert shot.stat().st_size > 10_000
    assert opened.errors == []
    assert opened.requests == [opened.url]


def test_diff_report_in_chromium(browser, parity_runs, tmp_path):
    out = build_report(
        [parity_runs["planted"]], tmp_path / "diff.html", diff_base=[parity_runs["base"]]
    )
    opened = Opened(browser, out)
    rows = opened.page.eval_on_selector_all(
        "#diff-new_errors > tbody > tr", "rs => rs.map(r => r.dataset.key)"
    )
    assert len(rows) == 1 and rows[0].endswith("|" + fx.PLANTED_CELL[0])
    opened.page.locator("#diff").screenshot(path=str(tmp_path / "diff.png"))
    opened.screenshot(tmp_path, "diff-report.png")
    assert opened.errors == []
    assert opened.requests == [opened.url]
