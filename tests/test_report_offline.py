"""The html benchmark report stands alone: it loads nothing (no CDN: the vega JavaScript is
inlined), draws its charts in Chromium opened from file:// with every other request
aborted, without a console error, and is readable at 1,280 px (a wide table scrolls in its own
box; the page does not)."""

from __future__ import annotations

import json
import re

import pytest

from sae_dist.analytics import bench_report as report
from sae_dist.analytics import offline_vega
from test_bench_reliability import point, run_row
from webui.browser import CHROMIUM, CHROMIUM_ARGS

# What would make a browser fetch something: an element or a style pointing at a file.
LOADS = re.compile(r"<(?:script|img|iframe|embed|object|source|video|audio)\b[^>]*\bsrc\s*=|<link\b|@import|url\(",
                   re.IGNORECASE)


def points() -> list[dict]:
    """A benchmark on 1, 2 and 4 devices, the 2-device point under another process's load
    (the warning, the unreliable marks and the other-load table all have something to show)."""
    return [point(1, "ddp", 1000.0, cpu=0.0), point(2, "ddp", 1850.0, batch=512, cpu=60.0),
            point(2, "ceiling", 1990.0, batch=512, cpu=0.0), point(4, "ddp", 3500.0, batch=256, cpu=0.0),
            point(4, "ceiling", 3900.0, batch=256, cpu=0.0)]


def test_bundle_version_is_altairs_vega_lite_where_vl_convert_has_it():
    assert offline_vega.bundle_version("v6.4.1", ["5.8", "6.1", "6.4"]) == "6_4"
    assert offline_vega.bundle_version("6.1.0", ["6.1"]) == "6_1"
    assert offline_vega.bundle_version("v7.0.0", ["5.8", "6.4"]) is None  # vl-convert's latest


def test_a_spec_cannot_end_its_script_element():
    spec = {"title": "</script><script>alert(1)</script><!--", "n": 1}
    text = offline_vega.json_in_script(spec)
    assert "<" not in text and json.loads(text) == spec
    calls = offline_vega.embed_calls({"speedup": spec})
    assert calls.startswith('vegaEmbed("#speedup", ') and '"renderer": "svg"' in calls and '"actions": false' in calls
    assert offline_vega.script_safe('x = "</SCRIPT>"; y = a < b;') == 'x = "<\\/SCRIPT>"; y = a < b;'


def test_the_html_report_loads_nothing_and_wraps_its_tables():
    page = report.render(run_row(), points(), "html")
    # The html around the scripts (the inlined library's own text is the browser test's to judge).
    markup = re.sub(r"<script\b[^>]*>.*?</script>", "<script></script>", page, flags=re.DOTALL)
    assert markup.count("<script></script>") == 2 and not LOADS.search(markup), LOADS.search(markup)
    assert 'vegaEmbed("#speedup", ' in page and 'vegaEmbed("#efficiency", ' in page
    assert markup.count("<table>") == markup.count('<div class="table-wrap"><table>') == 3
    assert "window.vegaEmbed=" in page  # the library itself, inlined
    # md and csv are as they were: the spec in a fenced block, the same columns.
    md = report.render(run_row(), points(), "md")
    assert "```vega-lite" in md and "<script" not in md and "table-wrap" not in md
    assert report.render(run_row(), points(), "csv").splitlines()[0] == ",".join(report.CSV_FIELDS)


@pytest.mark.slow
def test_the_html_report_draws_its_charts_offline_in_chromium(tmp_path):
    """Opened from file:// with every other request aborted (and counted): both charts draw
    SVG marks, the console stays clean, and at 1,280 px the page does not scroll sideways."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package (scripts/setup.sh --test)")
    name = "</script><script>document.title='pwned'</script>"  # a hostile run name stays text
    path = tmp_path / "report.html"
    path.write_text(report.render(run_row(name=name), points(), "html"))
    blocked: list[str] = []
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                          else (blocked.append(route.request.url), route.abort()))
            page = context.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(path.as_uri())
            for chart in ("#speedup", "#efficiency"):
                page.wait_for_selector(f"{chart} svg .mark-group", timeout=30_000)
            marks = {chart: page.locator(f"{chart} svg").locator(
                "g[class*='mark-'] path, g[class*='mark-'] line, g[class*='mark-'] rect").count()
                for chart in ("#speedup", "#efficiency")}
            widths = page.evaluate("""() => ({page: document.documentElement.scrollWidth,
                view: window.innerWidth,
                tables: [...document.querySelectorAll('table')].map(t => ({
                    box: t.parentElement.className, overflow: getComputedStyle(t.parentElement).overflowX,
                    boxWidth: t.parentElement.clientWidth}))})""")
            title = page.title()
        finally:
            browser.close()
    assert not blocked, f"the report asked for: {blocked}"
    assert not problems, problems
    assert all(n >= 3 for n in marks.values()), marks
    assert widths["page"] <= widths["view"], widths  # no sideways scrolling of the page
    assert all(t["box"] == "table-wrap" and t["overflow"] == "auto" and t["boxWidth"] <= 1100
               for t in widths["tables"]), widths["tables"]
    assert title == f"sae-dist scaling benchmark 1: {name}"
