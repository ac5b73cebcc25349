"""The app in a real browser, for the end-to-end tests and `scripts/bench_app.py`: Debian's
headless Chromium (`scripts/setup.sh --test` installs the `chromium` package; `playwright
install` cannot download here), the flags this machine's closed network needs, and when a page
counts as drawn. Imports neither Streamlit nor Playwright."""

from __future__ import annotations

from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
# No background fetches (the app must reach no other host), no sandbox as root, no GPU.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Every element the script sent is drawn: no placeholder of a component still loading (Streamlit
# loads a chart's code on first use and shows a skeleton meanwhile), and each chart has drawn its
# marks (Vega's SVG or canvas). At the end of a script run the charts are often not in the page yet.
ALL_DRAWN = """() => !document.querySelector('[data-testid="stSkeleton"]')
    && [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')]
        .every(chart => chart.querySelector('canvas, svg.marks'))"""
