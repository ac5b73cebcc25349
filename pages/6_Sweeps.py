"""Sweeps: many SAEs trained in one job from one activation stream.

The list of sweeps (status, SAEs done, running and failed, the job), then one sweep: its grid's
final figures (each swept setting a column), L0 against FVU with the Pareto frontier, and the
SAEs' curves overlaid (redrawn every few seconds while the sweep runs). Each SAE is a training
run: its link opens it on the Training runs page.
Queries and charts: `sae_dist.analytics.sweeps`.
"""

from datetime import datetime

import streamlit as st

from sae_dist.analytics import pareto, queries, run_compare, sweep_curves, sweeps
from sae_dist.db import get_engine
from webui.sidebar import REFRESH_SECONDS, page_frame
from webui.widgets import view_columns

engine = page_frame("Sweeps", ":material/grid_view:")
RUNS_PAGE = "pages/4_Training_runs.py"
QUEUE_PAGE = "pages/3_Queue.py"
NUMBER = st.column_config.NumberColumn
db_url = engine.url.render_as_string(hide_password=False)


# Keyed by what changes when new rows land: a finished SAE is read once, a live one once per step.
@st.cache_data(max_entries=512, show_spinner=False)
def load_steps(db_url: str, run_id: int, last_step: int, last_update: datetime | None):
    return queries.run_step_metrics(get_engine(db_url), run_id, run_compare.STEP_COLUMNS)


st.title("Sweeps", anchor=False)
st.caption("A sweep trains many SAEs in one job, each batch read once and fed to all of them. "
           "Each SAE is a training run of its own.")
listed = sweeps.list_sweeps(engine)
if not listed:
    st.info("Queue one from the Train page (turn on *Sweep: many SAEs in one job*), or with "
            "`python -m scheduler submit --train run.toml --sweep k=16,32,64`.", title="No sweep yet")
    st.stop()

st.dataframe(sweeps.list_rows(listed), hide_index=True,
             column_config={"Sweep": NUMBER(format="%d"), "Job": NUMBER(format="%d")})
by_id = {s["id"]: s for s in listed}
requested = st.query_params.get("sweep", "")
if st.session_state.get("sweep_pick") not in by_id:  # first visit, or a link naming a sweep
    st.session_state["sweep_pick"] = int(requested) if requested.isdigit() and int(requested) in by_id \
        else listed[0]["id"]


def remember_pick() -> None:
    st.query_params["sweep"] = str(st.session_state["sweep_pick"])


with st.container(horizontal=True, vertical_alignment="bottom"):
    picked = st.selectbox("Sweep", list(by_id), key="sweep_pick", on_change=remember_pick, width=420,
                          format_func=lambda i: f"{i} · {by_id[i]['name']} · {by_id[i]['status']}")
    st.button("Refresh", key="sweep_refresh", icon=":material/refresh:", help="Read the sweep's SAEs again")
running = by_id[picked]["status"] == "RUNNING"


@st.fragment(run_every=REFRESH_SECONDS if running else None)
def sweep_view(sweep_id: int) -> None:
    """One sweep; a fragment redrawn every few seconds while it runs (its SAEs' rows grow)."""
    sweep = sweeps.load_sweep(engine, sweep_id)
    if sweep is None:
        st.warning("This sweep is no longer in the database.")
        return
    if running and sweep["status"] != "RUNNING":
        st.rerun()  # it just ended: redraw the page once (the list's counts too), without the timer
    header(sweep)
    runs = sweep["runs"]
    if not runs:
        st.info("No SAE of this sweep has started yet: their runs appear here once the job starts them.")
        return
    evaluations = queries.latest_evaluations(engine)
    points = sweeps.sweep_points(runs, evaluations)
    shown, note = sweeps.curve_runs(runs, points)
    colors = sweeps.sae_colors(shown)  # one colour per SAE on every chart and in the grid
    grid(sweep, evaluations, colors)
    pareto_plot(runs, points, colors)
    curves(shown, note, colors)


def header(sweep: dict) -> None:
    st.subheader(f"Sweep {sweep['id']} · {sweep['name']}", anchor=False)
    with st.container(horizontal=True, vertical_alignment="center"):
        st.badge(sweep["status"])
        if sweep["job_id"] is not None:
            st.page_link(QUEUE_PAGE, label=f"Job {sweep['job_id']}", icon=":material/list:",
                         query_params={"job": str(sweep["job_id"])})
        st.caption(f"Swept: {', '.join(sweep['keys']) or '—'} · started {sweeps.utc_text(sweep['created_at'])} · "
                   f"{sweep['world_size']} device{'s' if sweep['world_size'] != 1 else ''} · `{sweep['run_dir']}`")
    if sweep["placement"]:
        st.caption(f"Placement: {sweep['placement'].get('reason', '—')}.")
    if sweep["error"]:
        st.error(sweep["error"], title="The sweep stopped with an error")


def grid(sweep: dict, evaluations: dict, colors: dict) -> None:
    st.markdown("**The grid**")
    rows = sweeps.grid_rows(sweep["keys"], sweep["runs"], evaluations, colors)
    st.dataframe(rows, hide_index=True, column_config={
        "Colour": st.column_config.ImageColumn("Colour", help="Its colour on the charts (none: not overlaid)"),
        "Run": NUMBER(format="%d"), "FVU": NUMBER(format="%.4f"), "L0": NUMBER(format="%.1f"),
        "Dead fraction": NUMBER(format="percent")})
    many = len(sweep["runs"]) > sweeps.MAX_CURVES
    with st.expander(f"Each SAE's run ({len(sweep['runs']):,})") if many else st.container():
        with st.container(horizontal=True):  # each SAE's run, as every run link in the app opens it
            for run in sweep["runs"]:
                st.page_link(RUNS_PAGE, label=run["point"], icon=":material/monitoring:",
                             query_params={"run": str(run["id"])})


def pareto_plot(runs: list[dict], points: list[dict], colors: dict) -> None:
    chart = sweeps.pareto_chart(points, colors)
    if chart is None:
        st.caption("L0 against FVU: no SAE has measured both yet.")
        return
    st.altair_chart(chart, on_select="rerun", key="sweep_pareto", selection_mode=pareto.SELECTION,
                    alt="L0 against FVU of the sweep's SAEs, with the Pareto frontier")
    st.caption(pareto.caption(points, len(runs), len(runs) + 1))
    clicked = pareto.picked_run(st.session_state.get("sweep_pareto"))
    if clicked is not None:
        name = next((r["point"] for r in runs if r["id"] == clicked), str(clicked))
        st.page_link(RUNS_PAGE, label=f"Open {name} (run {clicked})", icon=":material/open_in_new:",
                     query_params={"run": str(clicked)})


def curves(shown: list[dict], note: str | None, colors: dict) -> None:
    st.markdown("**Curves, every SAE overlaid**" if note is None else "**Curves overlaid**")
    if note is not None:
        st.caption(note)
    named = sweeps.labelled(shown)
    series = [(r, load_steps(db_url, r["id"], r["last_step"], r["last_update"])) for r in named]
    st.markdown(run_compare.key_html(named, colors), unsafe_allow_html=True)
    view_columns(sweep_curves.curve_views(series, run_compare.COMPARE_METRICS, run_compare.color_scale(named, colors)))

sweep_view(picked)
