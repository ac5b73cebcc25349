"""The frame every page shares: page config, the sidebar, the state database.

The sidebar is drawn here with `st.page_link`, once for all pages, and Streamlit's own
page list is hidden (`[client] showSidebarNavigation = false`): `st.navigation` with a
`pages/` folder makes the sidebar depend on which URL was hit first after a restart.

The favicon is the page's Material icon from a local SVG (webui/icons/): given as
":material/name:", Streamlit's browser side would fetch it from fonts.gstatic.com, and the
app reaches no host but its own.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st
from sqlalchemy.engine import Engine, make_url

from sae_dist.db import get_engine
from sae_dist.errors import UserError
from sae_dist.paths import default_db_url

# (page file relative to app.py, label, Material icon), in sidebar order.
PAGES = (
    ("app.py", "Overview", ":material/dashboard:"),
    ("pages/1_Train.py", "Train", ":material/rocket_launch:"),
    ("pages/2_Monitor.py", "Monitor", ":material/speed:"),
    ("pages/3_Queue.py", "Queue", ":material/list:"),
    ("pages/4_Training_runs.py", "Training runs", ":material/monitoring:"),
    ("pages/5_Benchmarks.py", "Benchmarks", ":material/bar_chart:"),
    ("pages/6_Sweeps.py", "Sweeps", ":material/grid_view:"),
)
APP_ROOT = Path(__file__).resolve().parents[1]
ICONS = Path(__file__).resolve().parent / "icons"

REFRESH_SECONDS = 3
"""How often the live parts of a page (fragments) re-read the database."""


def page_frame(title: str, icon: str) -> Engine:
    """Set up a page (config, sidebar) and return the state database's engine.

    Stops the page with one clear error when the database cannot be opened.
    """
    st.set_page_config(page_title=f"{title} · sae-dist", page_icon=favicon(icon), layout="wide")
    url = default_db_url()
    sidebar(url)
    try:
        return get_engine(url)
    except UserError as error:
        st.error(str(error), title="The state database cannot be opened")
        st.stop()


def favicon(icon: str) -> str:
    """The local SVG file (a path) drawing the Material icon ":material/name:"; an emoji or
    a path is kept as it is (Streamlit serves neither from another host)."""
    if not icon.startswith(":material/"):
        return icon
    path = ICONS / f"{icon.removeprefix(':material/').rstrip(':')}.svg"
    if not path.is_file():
        raise ValueError(f"no local favicon for {icon}: add {path.relative_to(APP_ROOT)}")
    return str(path)


def sidebar(db_url: str) -> None:
    """Links to every page, then where the data comes from."""
    with st.sidebar:
        st.markdown("### sae-dist")
        for path, label, icon in PAGES:
            st.page_link(path, label=label, icon=icon, width="stretch")
        st.divider()
        shown = make_url(db_url).render_as_string(hide_password=True)
        st.caption(f"State database: `{shown}`")
