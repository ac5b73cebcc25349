"""Training runs: one run in detail (its config, final or latest metrics, curves, evaluation,
per-rank stats), or several compared (overlaid curves, smoothing, config diff, L0 against FVU).

`?run=<id>` opens a given run; without it, the latest run that logged a step. `?view=Compare runs`
opens the comparison. A RUNNING run refreshes live.
"""

from datetime import datetime, timezone
from pathlib import Path

import streamlit as st

from sae_dist import format as fmt
from sae_dist.analytics import (
    cards,
    charts,
    compare_charts,
    config_diff,
    evaluation_view,
    monitor_views,
    pareto,
    queries,
    run_compare,
    run_export,
    samples,
    tables,
)
from sae_dist.analytics.smoothing import MAX_WEIGHT
from sae_dist.db import get_engine
from webui.sidebar import REFRESH_SECONDS, page_frame
from webui.widgets import card_row, chart_columns, command_hint, draw_view, events_toggle, stacked_charts

engine = page_frame("Training runs", ":material/monitoring:")
STALE_AFTER_S = 600  # a RUNNING run silent this long may have died without saying so
TRAIN_CURVES = ("loss", "fvu", "l0", "dead_fraction", "samples_per_s")
RECOVERY_CURVES = ("recovery_frac", "recovery_mean_cos")  # synthetic data, at checkpoints
RUN_TAB, COMPARE_TAB = "Run", "Compare runs"
RUNS_READ = 200  # the newest runs offered and drawn on the L0-FVU chart


# Keyed by what changes when new rows land, so a finished run is read once and a live one
# once per new logged step. The URL is in the key: one process may serve several databases.
# What is cached is what the charts plot (<= 2,000 rows a curve), not every logged step:
# thinning 20,000 steps x 7 curves and 160,000 rank rows took the page over a second a run.
@st.cache_data(max_entries=32, show_spinner=False)
def load_frames(db_url: str, run_id: int, last_step: int, last_update: datetime | None):
    metrics = queries.run_step_metrics(get_engine(db_url), run_id, (*TRAIN_CURVES, *RECOVERY_CURVES))
    return len(metrics["step"]), {m: charts.training_frame(metrics, m, charts.RUN_CURVE_POINTS)
                                  for m in (*TRAIN_CURVES, *RECOVERY_CURVES)}


@st.cache_data(max_entries=64, show_spinner=False)
def load_compared(db_url: str, run_id: int, last_step: int, last_update: datetime | None):
    return queries.run_step_metrics(get_engine(db_url), run_id, run_compare.STEP_COLUMNS)


# The rows of the six overlaid charts: summaries in the key carry each run's last step, so a
# rerun that changes nothing they draw (a click, a live run without a new step) reads no row.
@st.cache_data(max_entries=16, show_spinner=False)
def load_overlays(db_url: str, chosen: list[dict], x: str, weight: float, log: bool):
    series = [(r, load_compared(db_url, r["id"], r["last_step"], r["last_update"])) for r in chosen]
    return {m: run_compare.overlay_frame(series, m, x, weight, log) for m in run_compare.COMPARE_METRICS}


@st.cache_data(max_entries=32, show_spinner=False)
def load_rank_times(db_url: str, run_id: int, field: str, last_step: int,
                    last_update: datetime | None):
    # Bucketed by the database as on the Monitor: reading a 200,000-step run's 160,000 rank
    # rows to thin them here took 0.55 s of each new step's rerun, the buckets take 0.1 s.
    return samples.rank_times(get_engine(db_url), run_id, field, max_rows=charts.RANK_LINE_ROWS)


@st.cache_data(max_entries=32, show_spinner=False)
def load_rank_summary(db_url: str, run_id: int, last_step: int, last_update: datetime | None):
    return queries.rank_summary(get_engine(db_url), run_id)  # a GROUP BY over every rank row


def sync_url() -> None:
    st.query_params["run"] = str(st.session_state["run_pick"])


st.title("Training runs", anchor=False)
runs = queries.list_runs(engine, RUNS_READ)
if not runs:
    st.info("Start one from a terminal in the repository; it appears here as it starts.",
            title="No training run yet")
    command_hint("python -m sae_dist train --devices cpu:2 --steps 200")
    st.stop()

by_id = {run["id"]: run for run in runs}
db_url = engine.url.render_as_string(hide_password=False)
# Only the open tab runs; the tab is in the URL (`?view=`), so a comparison can be shared.
run_tab, compare_tab = st.tabs([RUN_TAB, COMPARE_TAB], key="view", bind="query-params")
# A run named in the URL (a link, a bookmark, a click on the L0-FVU chart) wins over the
# previous pick; the widget then keeps the URL in step, so a page can be shared. Not
# `bind="query-params"`: that puts the option's label in the URL (and the label holds the
# status, which changes). Without either, the latest run that logged a step.
requested = st.query_params.get("run", "")
opened = int(requested) if requested.isdigit() and int(requested) in by_id else None
run_id = None
if run_tab.open:
    if opened is not None and st.session_state.get("run_pick") != opened:
        st.session_state["run_pick"] = opened
    elif st.session_state.get("run_pick") not in by_id:
        st.session_state["run_pick"] = run_compare.default_run(runs)
    with run_tab:
        run_id = st.selectbox(
            "Run", list(by_id), key="run_pick", on_change=sync_url,
            format_func=lambda i: f"{i} · {by_id[i]['name']} · {by_id[i]['status']}",
        )
    st.query_params["run"] = str(run_id)
live = run_id is not None and by_id[run_id]["status"] == "RUNNING"


def evaluation_section(run_id: int) -> None:
    """The run's latest SAE evaluation (one indexed row: not cached)."""
    st.subheader("Evaluation", anchor=False)
    ev = evaluation_view.latest_evaluation(engine, run_id)
    if ev is None:
        st.info("Evaluate the run's exported SAE on held-out activations; the result appears here.",
                title="No evaluation yet")
        command_hint("python -m sae_dist evaluate RUN_DIR/sae --shards ACTIVATIONS_DIR")
        return
    st.caption(evaluation_view.rows_caption(ev))
    card_row(evaluation_view.evaluation_cards(ev))
    core = evaluation_view.core_table(ev)
    if core:
        with st.expander("SAEBench's core metrics, by their names"):
            st.dataframe(core, hide_index=True)
    recovery = evaluation_view.recovery_cards(ev)
    if recovery:
        st.caption("The planted dictionary recovered by the decoder: all planted features, then the "
                   "rarest tenth (by planted frequency).")
        for row in recovery:
            card_row(row)
    check_cards = evaluation_view.model_check_cards(ev["model_check"])
    if check_cards:
        card_row(check_cards)
    st.caption(evaluation_view.model_check_caption(ev["model_check"]))
    chart = evaluation_view.density_chart(ev["density"], ev["rows"])
    if chart is None:
        st.caption(f"Feature density: not measured ({fmt.MISSING})")
    else:
        st.altair_chart(chart, alt="Latents per bin of log10 firing frequency, never-firing latents apart")


@st.fragment(run_every=REFRESH_SECONDS if live else None)
def run_view(run_id: int, live: bool) -> None:
    run = queries.get_run_summary(engine, run_id)
    if run is None:
        st.warning(f"Run {run_id} is no longer in the database.")
        return
    if live and run["status"] != "RUNNING":
        st.rerun()  # it just ended: redraw the page once, without the timer
    run_header(run)
    logged, frames = load_frames(db_url, run_id, run["last_step"], run["last_update"])
    events = queries.run_events(engine, run_id)  # a few indexed rows: not cached
    show = events_toggle("runs_show_events", events)
    drawn = events if show else None
    training_curves(run, logged, frames, drawn)
    feature_recovery(run, frames)
    evaluation_section(run_id)
    ranks_section(run, db_url, drawn)
    with st.expander("Configuration and files"):
        st.markdown(f"Run directory: `{run['run_dir']}`  \n"
                    f"SAELens export: `{run['export_dir'] or fmt.MISSING}`  \n"
                    f"Started {fmt.fmt_time(run['started_at'])} · finished "
                    f"{fmt.fmt_time(run['finished_at'])} · scheduler job "
                    f"{run['job_id'] if run['job_id'] is not None else fmt.MISSING}")
        st.json(run["config"], expanded=True)
        download_buttons(run)


def download_buttons(run: dict) -> None:
    """The run as one JSON file (config, metrics, events, evaluation) and its SAE as a zip, each
    made when its button is clicked (an SAE can be large)."""
    safe = run_export.file_stem(run["name"], run["id"])
    with st.container(horizontal=True):
        st.download_button("Run as JSON", lambda: run_export.record_json(run_export.run_record(engine, run["id"])),
                           file_name=f"{safe}.json", mime="application/json", icon=":material/download:",
                           key="download_run", help="Config, every logged step's metrics, events and evaluation")
        if run["export_dir"] and Path(run["export_dir"]).is_dir():
            st.download_button("SAE as zip", lambda: run_export.sae_archive(run["export_dir"]),
                               file_name=f"{safe}-sae.zip", mime="application/zip", icon=":material/folder_zip:",
                               key="download_sae", help=f"The SAELens export folder {run['export_dir']}")


def run_header(run: dict) -> None:
    """Name, status, where it runs, progress, and why it stopped (or seems to have)."""
    now = datetime.now(timezone.utc)
    silent = None if run["last_update"] is None else (now - run["last_update"]).total_seconds()
    with st.container(horizontal=True, vertical_alignment="center"):
        st.subheader(run["name"], anchor=False, width="content")
        st.badge(run["status"], color=fmt.RUN_STATUS_COLORS.get(run["status"], "gray"))
        if run["job_id"] is not None:  # its scheduler job, both ways (the Queue links back)
            st.page_link("pages/3_Queue.py", label=f"Job {run['job_id']}", icon=":material/list:",
                         query_params={"job": str(run["job_id"])})
    when = (f"last metrics {fmt.fmt_ago(silent)}" if run["status"] == "RUNNING"
            else f"ended {fmt.fmt_time(run['finished_at'])}")
    st.caption(f"Step {fmt.fmt_steps(run['last_step'], run['total_steps'])}"
               f" · {run['world_size']} × {run['backend']} on {fmt.short_devices(run['devices'])}"
               f" · {run['host']} · {when}")
    if run["progress"] is not None:
        st.progress(run["progress"])
    if run["status"] == "FAILED":
        st.error(run["error"] or "no error message recorded", title="The run failed")
    elif run["status"] == "STOPPED":
        st.caption(f"The training {run['error'] or 'was stopped'} at step {run['last_step']:,}.")
    elif run["status"] == "RUNNING" and silent is not None and silent > STALE_AFTER_S:
        st.warning(f"The last metrics arrived {fmt.fmt_ago(silent)}: the training process "
                   "may have stopped without recording it.")


def training_curves(run: dict, logged: int, frames: dict, drawn: list[dict] | None) -> None:
    # Cards and charts from the same panels: a card is its chart's last point (cards.py).
    panels = {metric: charts.frame_panel(frames[metric], metric, drawn) for metric in TRAIN_CURVES}
    card_row(cards.training_cards(panels, run["final"]))
    st.subheader("Training curves", anchor=False)
    if not logged:
        st.info("No step logged yet.")
        return
    chart_columns([(panel.chart, f"{panel.unit.title} against training step",
                    f"{panel.unit.title}: not measured ({fmt.MISSING})") for panel in panels.values()])


def feature_recovery(run: dict, frames: dict) -> None:
    recovery = {metric: charts.frame_panel(frames[metric], metric) for metric in RECOVERY_CURVES}
    if not any(panel.chart is not None for panel in recovery.values()):
        return
    st.subheader("Feature recovery", anchor=False)
    ceiling = cards.recovery_ceiling(run.get("config") or {})
    st.caption("Synthetic data plants a known dictionary: how much of it the SAE has found "
               "(measured at checkpoints)." + (f" {ceiling}" if ceiling else ""))
    card_row(cards.training_cards(recovery, run["final"]))
    chart_columns([(panel.chart, f"{panel.unit.title} against training step", None)
                   for panel in recovery.values()])


def ranks_section(run: dict, db_url: str, drawn: list[dict] | None) -> None:
    st.subheader("Ranks", anchor=False)
    ranks = load_rank_summary(db_url, run["id"], run["last_step"], run["last_update"])
    if not ranks:
        st.info("No per-rank statistics logged yet.")
        return
    st.dataframe(tables.ranks_table(ranks), hide_index=True,
                 alt="Per-rank timings, peak memory and straggler counts")
    st.caption("A rank is a straggler at a logged step when its compute time is over "
               "1.3 × the median of the ranks. Peak memory: allocated GPU memory, or the "
               "growth of the process's resident memory on a CPU rank.")
    left, right = st.columns(2)
    with left:
        field = st.segmented_control(
            "Time", ["compute_time_s", "step_time_s"], default="compute_time_s",
            key="rank_time_field", label_visibility="collapsed",
            format_func={"compute_time_s": "Compute time", "step_time_s": "Step time"}.get)
        field = field or "compute_time_s"
        times = load_rank_times(db_url, run["id"], field, run["last_step"], run["last_update"])
        draw_view(monitor_views.rank_time_view(times, field, drawn))
    with right:
        stacked_charts([(charts.peak_memory_chart(ranks), "Peak memory of each rank",
                         f"Peak memory per rank: not measured ({fmt.MISSING})")])




def open_picked_run() -> None:
    """A click on the L0-FVU chart: open that run in the Run tab and keep it compared."""
    picked = pareto.picked_run(st.session_state.get("pareto"))
    if picked is None:
        return
    st.query_params["run"] = str(picked)
    compared = st.session_state.get("compare_pick") or []
    if picked not in compared:
        st.session_state["compare_pick"] = [*compared, picked]
    st.session_state["view"] = RUN_TAB


def compare_controls() -> tuple[list[int], float, bool, str]:
    """The runs compared and how their curves are drawn: smoothing, log scale, x axis."""
    # The runs compared are in the URL (?compare=3,5), by id: a comparison to bookmark or send.
    linked = run_compare.runs_in_link(st.query_params.get("compare", ""), list(by_id))
    picked = st.multiselect(
        "Runs to compare", list(by_id), default=linked or run_compare.compare_default(runs, opened),
        key="compare_pick", persist_state="page", placeholder="Pick runs",
        format_func=lambda i: f"{run_compare.run_label(by_id[i])} · {by_id[i]['status']}")
    with st.container(horizontal=True, vertical_alignment="bottom"):
        weight = st.slider("Smoothing", 0.0, MAX_WEIGHT, 0.0, step=0.01, key="smoothing",
                           persist_state="page", width=260, bind="query-params",
                           help="An exponential moving average, debiased as TensorBoard does "
                                "(0: none); the raw curve stays faint beneath.")
        x = st.segmented_control("X axis", list(run_compare.X_AXES), default="step", key="x_axis",
                                 required=True, persist_state="page", bind="query-params",
                                 format_func=lambda k: run_compare.X_AXES[k].title)
        log = st.toggle("Log scale (y)", key="log_y", persist_state="page", bind="query-params")
    if picked:
        st.query_params["compare"] = run_compare.link_value(picked)
    else:
        st.query_params.pop("compare", None)
    return picked, weight, log, x or "step"


def compared_curves(picked: list[int], weight: float, log: bool, x: str, live: bool) -> None:
    """The overlaid curves; a fragment of its own, refreshed while a compared run is RUNNING."""
    fresh = {r["id"]: r for r in queries.list_runs(engine, RUNS_READ) if r["id"] in picked}
    chosen = [fresh[i] for i in picked if i in fresh]
    if live and not any(r["status"] == "RUNNING" for r in chosen):
        st.rerun()  # the last live one just ended: redraw the page once, without the timer
    overlays = load_overlays(db_url, chosen, x, weight, log)
    colors = run_compare.color_scale(chosen)
    st.markdown(run_compare.key_html(chosen), unsafe_allow_html=True)
    chart_columns([(compare_charts.overlay_chart(overlay, metric, x, colors, weight, log),
                    f"{compare_charts.compare_title(metric)} against {run_compare.X_AXES[x].title.lower()}",
                    compare_charts.empty_text(overlay, metric)) for metric, overlay in overlays.items()])

def config_section(picked: list[int]) -> None:
    st.subheader("Configuration differences", anchor=False)
    if len(picked) < 2:
        st.caption("Pick two or more runs to see the configuration keys whose values differ.")
        return
    summaries = [queries.get_run_summary(engine, i) for i in sorted(picked)]
    rows = config_diff.config_diff({run_compare.run_label(s): s["config"] for s in summaries if s})
    if not rows:
        st.caption("The runs compared have the same configuration.")
        return
    st.dataframe(rows, hide_index=True, column_config={"key": "Config key"},
                 alt="The configuration keys whose values differ, by run")


def pareto_section(picked: list[int]) -> None:
    st.subheader("L0 against FVU", anchor=False)
    points = pareto.run_points(runs, queries.latest_evaluations(engine))
    chart = compare_charts.pareto_chart(points, pareto.pareto_frontier(points),
                                        run_compare.run_colors(picked))
    if chart is None:
        st.info("No run has measured both L0 and FVU yet.")
        return
    st.caption(pareto.caption(points, len(runs), RUNS_READ))
    st.altair_chart(chart, key="pareto", on_select=open_picked_run, selection_mode=pareto.SELECTION,
                    alt="Each run's final L0 against its FVU, with the Pareto frontier")


if run_id is not None:
    with run_tab:
        run_view(run_id, live)
if compare_tab.open:
    with compare_tab:
        compared, smoothing, log_y, x_axis = compare_controls()
        if compared:
            live_compared = any(by_id[i]["status"] == "RUNNING" for i in compared)
            st.fragment(compared_curves, run_every=REFRESH_SECONDS if live_compared else None)(
                compared, smoothing, log_y, x_axis, live_compared)
        else:
            st.info("Pick one or more runs above to draw their curves together.")
        config_section(compared)
        pareto_section(compared)
