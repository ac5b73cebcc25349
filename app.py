"""Overview: every training run in the state database, refreshed live.

Run with `streamlit run app.py`; the state database is `$SAE_DIST_HOME/state.db`
(or `$SAE_DIST_DB_URL`). Logic lives in `sae_dist.analytics`; this page only lays it out.
"""

from datetime import datetime, timezone

import streamlit as st

from sae_dist.analytics import queries
from sae_dist.analytics.format import runs_table
from webui.sidebar import REFRESH_SECONDS, page_frame

engine = page_frame("Overview", ":material/dashboard:")

st.title("Overview", anchor=False)
st.caption("Sparse autoencoders trained on this machine, newest first; updated every "
           f"{REFRESH_SECONDS} s.")


@st.fragment(run_every=REFRESH_SECONDS)
def runs_overview() -> None:
    runs = queries.list_runs(engine)
    if not runs:
        st.info("Start one from a terminal in the repository; it appears here as it starts.",
                title="No training run yet")
        st.code("python -m sae_dist train --devices cpu:2 --steps 200", language="bash")
        return

    statuses = [run["status"] for run in runs]
    with st.container(horizontal=True):
        for status in ("RUNNING", "COMPLETED", "FAILED"):
            st.metric(status.capitalize(), statuses.count(status), border=True)

    st.dataframe(
        runs_table(runs, datetime.now(timezone.utc)),
        hide_index=True,
        alt="Training runs with their status, progress and latest metrics",
        column_config={
            "id": st.column_config.NumberColumn("Run", format="%d", width=45),
            "name": st.column_config.TextColumn("Name", width=190, pinned=True),
            "status": st.column_config.TextColumn("Status", width=100),
            "steps": st.column_config.TextColumn("Steps", width=110),
            "progress": st.column_config.ProgressColumn(
                "Progress", min_value=0.0, max_value=1.0, format="percent", width=110),
            "FVU": st.column_config.TextColumn("FVU", width=65),
            "L0": st.column_config.TextColumn("L0", width=45),
            "samples/s": st.column_config.TextColumn("Samples/s", width=80),
            "world size": st.column_config.NumberColumn("World size", format="%d", width=75),
            "backend": st.column_config.TextColumn("Backend", width=70),
            "devices": st.column_config.TextColumn("Devices", width=120),
            "started": st.column_config.DatetimeColumn(
                "Started (UTC)", format="YYYY-MM-DD HH:mm", timezone="UTC", width=130),
            "last update": st.column_config.TextColumn("Last update", width=90),
        },
    )
    st.caption("FVU, L0 and samples/s are a finished run's final values, else the latest "
               "logged ones; — means not measured.")

    for run in runs:
        if run["status"] == "RUNNING":
            st.page_link("pages/4_Training_runs.py", label=f"Watch run {run['id']} ({run['name']})",
                         icon=":material/play_circle:", query_params={"run": str(run["id"])})


runs_overview()
