"""Monitor: a job's devices (or all devices) live, and its training curves.

`?job=<id>` opens a job; without it, the latest running job, else all devices. Aggregated
shows the devices together (memory used of total, mean utilisation, total power, hottest
temperature), Per-GPU one panel per device. Series are bucketed by the database
(`sae_dist.analytics.samples`), a few thousand points at most whatever the window. A live
view redraws itself every 2 s (a fragment: the rest of the page does not rerun), less often
where a redraw takes longer on this server (webui/refresh.py); a finished
job shows its final state and does not refresh.
"""

import os
from datetime import datetime, timedelta, timezone

import streamlit as st

from sae_dist import format as fmt
from sae_dist.analytics import (
    balance_view,
    cards,
    charts,
    jobs,
    monitor_views,
    progress,
    queries,
    samples,
    sparklines,
    tables,
    units,
)
from sae_dist.db import get_engine
from webui.refresh import refresh_every, timed_redraw
from webui.sidebar import page_frame
from webui.widgets import card_row, chart_columns, command_hint, draw_view, events_toggle, log_tail, view_columns

engine = page_frame("Monitor", ":material/speed:")

REFRESH_S = 2
ALL = 0  # the job choice meaning "all devices"
WINDOWS = {"5 min": 300, "1 h": 3600, "24 h": 86400, "All": None}
VIEWS = ("Aggregated", "Per-GPU")
# The view a session starts with: SAE_DIST_MONITOR_VIEW=per-gpu for people who prefer it.
DEFAULT_VIEW = "Per-GPU" if os.environ.get("SAE_DIST_MONITOR_VIEW", "").lower().replace(
    "_", "-") in ("per-gpu", "pergpu", "gpu") else "Aggregated"
# Points a series gets: a half-page chart is some 700 px wide and a sparkline far less, so
# fewer than the 2,000 the queries allow (turning 2,000 points x 4 charts into a Vega-Lite spec
# took 0.27 s of each 2 s refresh).
CHART_POINTS = 600
PANEL_POINTS = 240
CURVE_POINTS = 400
STALE_S = 15  # a live device without a reading for this long: the daemon is not sampling it
LIVE_STATES = ("PENDING", "RUNNING")
TRAIN_CURVES = ("loss", "fvu", "l0", "dead_fraction", "samples_per_s")
RECOVERY_CURVES = ("recovery_frac", "recovery_mean_cos")
LOG_LINES = 20  # the log tail's length: what the job is doing now (200 lines made the page 8,000 px tall)


@st.cache_data(max_entries=32, show_spinner=False)
def load_curves(db_url: str, run_id: int, last_step: int, last_update: datetime | None):
    # Keyed by what changes when rows land: a finished run is read once, a live one per step.
    return samples.run_curves(get_engine(db_url), run_id,
                              (*TRAIN_CURVES, *RECOVERY_CURVES), CURVE_POINTS)


@st.cache_data(max_entries=32, show_spinner=False)
def load_rank_times(db_url: str, run_id: int, field: str, last_step: int,
                    last_update: datetime | None):
    # The rows Training runs gives the same chart.
    return samples.rank_times(get_engine(db_url), run_id, field, max_rows=charts.RANK_LINE_ROWS)


# The charts built once per logged step, not on every 2 s redraw (building them is most of a
# script run's time): keyed like the rows they draw, and by the events drawn on them.
@st.cache_data(max_entries=32, show_spinner=False)
def training_views(db_url: str, run_id: int, last_step: int, last_update: datetime | None,
                   drawn: list[dict] | None, final: bool) -> monitor_views.TrainingViews:
    return monitor_views.training_views(load_curves(db_url, run_id, last_step, last_update),
                                        drawn, final, TRAIN_CURVES, RECOVERY_CURVES)


@st.cache_data(max_entries=32, show_spinner=False)
def rank_time_view(db_url: str, run_id: int, field: str, last_step: int,
                   last_update: datetime | None, drawn: list[dict] | None) -> monitor_views.View:
    times = load_rank_times(db_url, run_id, field, last_step, last_update)
    return monitor_views.rank_time_view(times, field, drawn)


def job_label(job_id: int) -> str:
    if job_id == ALL:
        return "All devices"
    job = by_id[job_id]
    return f"Job {job_id} · {job['name']} · {job['state']}"


def sync_url() -> None:
    choice = st.session_state["monitor_job"]
    st.query_params["job"] = str(choice) if choice != ALL else "all"


def device_label(device: dict) -> str:
    kind = "virtual GPU" if device.get("virtual") else "GPU"
    return f"{kind} {device['index']}" if device.get("index") is not None else device["uuid"]


# ---- which job, which view, which window ------------------------------------------------------

st.title("Monitor", anchor=False)
job_list = jobs.monitor_jobs(engine)
by_id = {job["id"]: job for job in job_list}
requested = st.query_params.get("job", "")
if requested.isdigit() and int(requested) not in by_id:
    old = jobs.get_job(engine, int(requested))  # an older job named in a link
    if old is not None:
        by_id[old["id"]] = old
if requested.isdigit() and int(requested) in by_id:
    st.session_state["monitor_job"] = int(requested)
elif requested == "all":
    st.session_state["monitor_job"] = ALL
elif st.session_state.get("monitor_job") not in (ALL, *by_id):
    st.session_state["monitor_job"] = jobs.latest_running(job_list) or ALL
st.session_state.setdefault("monitor_view", DEFAULT_VIEW)
st.session_state.setdefault("monitor_window", "1 h")

with st.container(horizontal=True, vertical_alignment="bottom"):
    job_id = st.selectbox("Job", [ALL, *by_id], key="monitor_job", format_func=job_label,
                          on_change=sync_url, width=420, persist_state="session")
    view = st.segmented_control("View", VIEWS, key="monitor_view", required=True,
                                persist_state="session")
    window_name = st.segmented_control("Window", list(WINDOWS), key="monitor_window",
                                       required=True, persist_state="session",
                                       help="How far back the charts go (a job's charts "
                                            "start when it did).")
window_s = WINDOWS[window_name or "1 h"]
selected = by_id.get(job_id)
live = selected is None or selected["state"] in LIVE_STATES


# ---- the live part ----------------------------------------------------------------------------

@st.fragment(run_every=refresh_every("monitor", REFRESH_S) if live else None)
def monitor(job_id: int, view: str, window_s: int | None, known_state: str | None) -> None:
    with timed_redraw("monitor"):  # a slow redraw makes the next visit refresh less often
        draw_monitor(job_id, view, window_s, known_state)


def draw_monitor(job_id: int, view: str, window_s: int | None, known_state: str | None) -> None:
    now = datetime.now(timezone.utc)
    inventory = {d["uuid"]: d for d in jobs.devices(engine)}
    job = jobs.get_job(engine, job_id) if job_id != ALL else None
    if job_id != ALL and job is None:
        st.warning(f"Job {job_id} is no longer in the database.")
        return
    if job is not None and job["state"] != known_state:
        st.rerun()  # it started or ended: redraw the page once (the choice's label, the timer)

    if job is None:
        uuids = list(inventory)
        end = now
        # From the first reading on, so that a young history fills the charts' width.
        first = samples.first_sample_time(engine, uuids) or now
        start = max(first, now - timedelta(seconds=window_s)) if window_s else first
        if not uuids:
            st.info("The scheduler daemon records the devices and samples them every second.",
                    title="No device known yet")
            command_hint("python -m scheduler daemon")
            return
    else:
        job_header(job, now)
        uuids = job["devices"]
        if job["state"] == "PENDING" or job["started_at"] is None:
            st.info(f"Job {job['id']} has not started: {jobs.explain_reason(job['reason'])}. "
                    "Its devices appear here when it starts.", title="Pending")
            return
        end = job["ended_at"] or now
        start = job["started_at"]
        if window_s:
            start = max(start, end - timedelta(seconds=window_s))
        if not uuids:
            st.caption("This job holds no device.")

    if uuids:
        since = now - timedelta(seconds=STALE_S) if job is None or job["ended_at"] is None else start
        latest = samples.latest_samples(engine, uuids, at=end, since=since)
        devices = [inventory.get(u, {"uuid": u, "index": None, "name": u, "virtual": None})
                   for u in uuids]
        silent = [device_label(d) for d in devices if latest[d["uuid"]] is None]
        if silent and (job is None or job["ended_at"] is None):
            st.warning(f"No reading in the last {STALE_S} s from {', '.join(silent)}: is the "
                       "scheduler daemon running (`python -m scheduler daemon`)?")
        if view == "Per-GPU":
            per_gpu(devices, latest, start, end, show_jobs=job is None)
        else:
            aggregated(devices, start, end)
        if any(d.get("virtual") for d in devices):
            st.caption("Virtual GPUs are CPU-backed: their memory is the ranks' resident memory "
                       "out of a share of the machine's RAM, their utilisation the ranks' CPU "
                       f"use; they have no temperature or power sensor ({fmt.MISSING}: not "
                       "measured).")
    if job is not None:
        training(job, now)
        st.subheader("Log", anchor=False)
        log_tail(job, LOG_LINES)
        st.page_link("pages/3_Queue.py", label="More of the log (up to 1,000 lines) in the Queue",
                     icon=":material/article:", query_params={"job": str(job["id"])})


def job_header(job: dict, now: datetime) -> None:
    with st.container(horizontal=True, vertical_alignment="center"):
        st.subheader(f"Job {job['id']} · {job['name']}", anchor=False, width="content")
        st.badge(job["state"], color=jobs.STATE_COLORS.get(job["state"], "gray"))
        if job["cancel_requested"] and job["state"] == "RUNNING":
            st.badge("cancelling", color="orange")
    parts = [f"{job['gpus']} device{'s' if job['gpus'] != 1 else ''}"]
    if job["started_at"]:
        parts.append(f"started {fmt.fmt_time(job['started_at'])}")
    if job["ended_at"]:
        parts.append(f"ended {fmt.fmt_time(job['ended_at'])}")
    parts.append(f"elapsed {fmt.fmt_duration(jobs.elapsed_s(job, now))}")
    if job["state"] not in LIVE_STATES:
        parts.append(f"exit {fmt.fmt_exit(job['exit_code'], job['signal'])}")
    st.caption(" · ".join(parts))
    if job["state"] not in LIVE_STATES:
        st.info(f"This job ended ({job['state']}{': ' + job['reason'] if job['reason'] else ''})"
                ": the figures are its last readings and the charts stop at its end.",
                title="Final state", icon=":material/flag:")


def aggregated(devices: list[dict], start: datetime, end: datetime) -> None:
    series = samples.total_series(engine, [d["uuid"] for d in devices], start, end,
                                  max_points=CHART_POINTS)
    # Each card is its chart's last point (cards.py): the same buckets, unit and rounding.
    panels = {field: charts.device_panel(series.columns, field, series.width_s, total=True)
              for field in charts.DEVICE_PANELS}
    n = len(devices)
    last = {field: cards.last_plotted_row(panel.frame) or {} for field, panel in panels.items()}
    point = f"the charts' last point ({charts.span_label(series.width_s)})"
    with st.container(horizontal=True):
        st.metric("Memory used", panels["memory_used"].text, border=True,
                  help=f"Of the total of the {last['memory_used'].get('memory_devices') or 0} "
                       f"of {n} devices whose memory was read, at {point}")
        st.metric("Mean utilisation", panels["utilization_pct"].text, border=True,
                  help=f"Mean over the {last['utilization_pct'].get('devices') or 0} devices "
                       f"with a reading, at {point}")
        st.metric("Total power", panels["power_w"].text, border=True,
                  help=f"Measured on {last['power_w'].get('power_devices') or 0} of {n} devices, "
                       f"at {point}")
        st.metric("Hottest", panels["temperature_c"].text, border=True,
                  help=f"The hottest device's temperature, at {point}")
    if not len(series):
        st.info("No reading in this window.")
        return
    chart_columns([(panel.chart, f"{charts.TOTAL_TITLES[field]} over time",
                    f"{charts.TOTAL_TITLES[field]}: not measured on these devices ({fmt.MISSING})")
                   for field, panel in panels.items()])


def per_gpu(devices: list[dict], latest: dict, start: datetime, end: datetime,
            show_jobs: bool) -> None:
    uuids = [d["uuid"] for d in devices]
    series = samples.device_series(engine, uuids, start, end, max_points=PANEL_POINTS)
    memory, util = units.DEVICE["memory_used"], units.DEVICE["utilization_pct"]
    with st.grid(2 if len(devices) > 1 else 1, gap="medium"):
        for device in devices:
            uuid = device["uuid"]
            reading = latest[uuid] or {}
            columns = series[uuid].columns
            # The bars and cards read the sparklines' last points, as the cards' rule is.
            at, used = cards.last_present(columns["memory_used"])
            total = columns["memory_total"][at] if at is not None else None
            _, busy = cards.last_present(columns["utilization_pct"])
            with st.container(border=True, key=f"gpu_panel_{uuid}"):
                with st.container(horizontal=True, vertical_alignment="center"):
                    number = f"GPU {device['index']}" if device.get("index") is not None else uuid
                    st.markdown(f"**{number}** · {device['name']}", width="content")
                    if device.get("virtual"):
                        st.badge("virtual", color="violet", icon=":material/memory:")
                    if show_jobs and reading.get("job_id") is not None:
                        st.badge(f"job {reading['job_id']}", color="blue")
                held = memory.text(None if used is None else used * memory.factor)
                if used is not None and total:
                    held += f" of {memory.text(total * memory.factor)}"
                st.progress(min(used / total, 1.0) if used is not None and total else 0.0,
                            text=f"Memory {held}")
                st.progress(min(busy / 100, 1.0) if busy is not None else 0.0,
                            text=f"Utilisation {util.text(busy)}")
                with st.grid(2, gap="small"):  # each sparkline wide enough for its time axis
                    for field, label in (("memory_used", "Memory"), ("utilization_pct", "Utilisation"),
                                         ("temperature_c", "Temperature"), ("power_w", "Power")):
                        with st.container():
                            st.metric(label, cards.sparkline_text(columns[field], unit=units.DEVICE[field]))
                            # Streamlit's own metric sparkline has no time axis: this one has.
                            line = sparklines.sparkline_chart(columns, field, series[uuid].width_s)
                            if line is not None:
                                st.altair_chart(line, alt=f"{label} of {number} over time")
    width = next((s.width_s for s in series.values()), 1)
    st.caption(f"Sparklines: {window_name} window, {charts.span_label(width)} a point, times in "
               f"UTC; each figure is its sparkline's last point. {fmt.MISSING}: not measured.")


def training(job: dict, now: datetime) -> None:
    run_id = jobs.training_run_of(engine, job["id"])
    st.subheader("Training", anchor=False)
    run = queries.get_run_summary(engine, run_id) if run_id is not None else None
    if run is None:
        if not startup(job, None, now):
            st.caption("A command job: no training metrics." if job["kind"] != "train" else
                       "The job ended before its trainer recorded a run: its log (below) says why."
                       if job["state"] not in LIVE_STATES else "No training run recorded yet.")
        return
    recent = queries.recent_steps(engine, run_id)
    training_header(job, run, recent, now)
    if not recent and startup(job, run, now):
        return  # nothing to draw yet: what it is doing instead of empty cards and charts
    db_url = engine.url.render_as_string(hide_password=False)
    # Not cached: both are a few indexed rows, and an event can land after its step's metrics.
    events = queries.run_events(engine, run_id)
    window = queries.latest_rank_window(engine, run_id)
    show = events_toggle("monitor_show_events", events)
    drawn = events if show else None
    # Cards and charts from the same panels: a card is its chart's last point (cards.py).
    views = training_views(db_url, run_id, run["last_step"], run["last_update"], drawn,
                           run["final"])
    card_row(views.cards)
    load_balance(run, events, window)
    if not views.has_steps:
        st.info("No step logged yet.")
        return
    left, right = st.columns(2)
    with left:  # loss, L0, throughput; beside them FVU, dead latents and the ranks' times
        draw_view(views.columns[0])
    with right:
        draw_view(views.columns[1])
        rank_times(run, db_url, drawn)
        shares(window)
    feature_recovery(run, views)


def startup(job: dict, run: dict | None, now: datetime) -> bool:
    """Before the first logged step: what the job is doing, from what exists, with its log's
    last line; False when there is nothing of the kind to say."""
    status = progress.startup_status(job, run, has_steps=False, now=now)
    if status is None:
        return False
    st.info(status.detail, title=status.title, icon=":material/hourglass_top:")
    last = jobs.last_log_line(job)
    st.caption("Its log's last line:" if last else "Its log is empty so far.")
    if last:
        st.code(last, language=None)
    return True


def progress_line(run: dict, recent: list, live: bool) -> str:
    """"Step 300 / 1,000 · ETA 2 min 20 s at 5 steps/s over the last 300 steps"; no rate, no
    ETA; a run that is not training any more, no ETA at all."""
    text = f"Step {fmt.fmt_steps(run['last_step'], run['total_steps'])}"
    if not live:
        return text
    rate = progress.recent_rate(recent)
    eta = progress.eta_s(run["last_step"], run["total_steps"], rate)
    if rate is None:
        return text + " · ETA unknown: no step rate yet (it needs two logged steps)"
    pace = f"{fmt.fmt_number(rate.steps_per_s, 3)} steps/s over the last {rate.steps:,} steps"
    return text + (f" · ETA {fmt.fmt_duration(eta)} at {pace}" if eta is not None
                   else f" · {pace} (ETA unknown: no total)")


def training_header(job: dict, run: dict, recent: list, now: datetime) -> None:
    """The run's step, status and a link to its page; why it stopped when it did."""
    # A job stopped from outside (cancel, time limit, killed) can leave its run saying RUNNING.
    orphaned = run["status"] == "RUNNING" and job["state"] not in LIVE_STATES
    with st.container(horizontal=True, vertical_alignment="center"):
        st.caption(f"Run {run['id']} · {run['name']} · step "
                   f"{fmt.fmt_steps(run['last_step'], run['total_steps'])} · {run['world_size']} × "
                   f"{run['backend']}", width="content")
        if orphaned:
            st.badge(f"stopped with the job ({job['state']})", color="orange")
        else:
            st.badge(run["status"], color=fmt.RUN_STATUS_COLORS.get(run["status"], "gray"))
        st.page_link("pages/4_Training_runs.py", label="Run details", icon=":material/monitoring:",
                     query_params={"run": str(run["id"])})
        sweep_id = jobs.sweep_of(engine, job["id"])
        if sweep_id is not None:  # this run is one SAE of the job's sweep: the others are there
            st.page_link("pages/6_Sweeps.py", label=f"Sweep {sweep_id}: every SAE", icon=":material/grid_view:",
                         query_params={"sweep": str(sweep_id)})
    live = run["status"] == "RUNNING" and job["state"] == "RUNNING"
    line = progress_line(run, recent, live)
    if recent and live:
        quiet = (now - recent[-1][1]).total_seconds()
        line += f" · last step logged {fmt.fmt_duration(max(0.0, quiet))} ago"
    if run["progress"] is not None:
        st.progress(run["progress"], text=line)
    else:
        st.caption(line)
    if run["status"] == "FAILED":
        st.error(run["error"] or "no error message recorded", title="The run failed")
    elif run["status"] == "STOPPED":
        st.caption(f"The training {run['error'] or 'was stopped'}: the figures below are the last "
                   "it logged.")
    elif orphaned:
        st.caption(f"The job ended ({job['state']}) before the training recorded its end: the "
                   "figures below are the last it logged.")


def rank_times(run: dict, db_url: str, drawn: list[dict] | None) -> None:
    # DDP ranks wait for each other every step, so their step times match; the compute time
    # (before the gradient all-reduce) is where a slow rank shows.
    field = st.segmented_control(
        "Rank time", ["step_time_s", "compute_time_s"], default="step_time_s",
        key="monitor_rank_time", label_visibility="collapsed",
        format_func={"step_time_s": "Step time", "compute_time_s": "Compute time"}.get)
    field = field or "step_time_s"
    draw_view(rank_time_view(db_url, run["id"], field, run["last_step"], run["last_update"], drawn))


def feature_recovery(run: dict, views: monitor_views.TrainingViews) -> None:
    if run["recovery_frac"] is None and not views.recovery_drawn:
        return
    st.subheader("Feature recovery", anchor=False)
    ceiling = cards.recovery_ceiling(run.get("config") or {})
    st.caption("Synthetic data plants a known dictionary: how much of it the SAE has found "
               "(measured at checkpoints)." + (f" {ceiling}" if ceiling else ""))
    card_row(views.recovery_cards)
    view_columns(views.recovery)


def load_balance(run: dict, events: list[dict], window: list[dict]) -> None:
    """The latest window's balance: a warning when rebalancing cannot even out a rank, the
    imbalance, and the run's events. Nothing on runs from before these were recorded."""
    limited = run["balance_limited_rank"]
    if limited is not None:
        slowdown = fmt.balance_limited_slowdown(limited, events, window)
        st.warning(fmt.balance_limited_message(limited, slowdown), icon=":material/warning:")
    card = balance_view.imbalance_card(queries.recent_imbalance(engine, run["id"]), window) \
        if run["imbalance"] is not None else None
    if card is None and not events:
        return
    with st.container(horizontal=True, vertical_alignment="top"):
        if card is not None:  # a figure only on the rebalancer's own evidence, else "even"
            st.metric("Imbalance", card[0], border=True, width="content", help=card[1])
        if events:
            with st.container(key="run_events"):
                st.markdown("**Run events**")
                st.markdown("\n".join(fmt.event_lines(events)))


def shares(window: list[dict]) -> None:
    """Each rank's share of the step's batch beside its times, when the trainer recorded it."""
    if not any(w["batch_size"] is not None for w in window):
        return  # a run from before shares were recorded: nothing to show, nothing to invent
    st.dataframe(tables.shares_table(window), hide_index=True, key="rank_shares",
                 alt="Each rank's share of the step's batch, step and compute time")
    st.caption(f"Latest report window (step {window[0]['step']:,}). Share: the samples a rank "
               "computes each step (of the global batch); rebalancing moves samples away from a "
               "rank that stays slower.")


monitor(job_id, view or DEFAULT_VIEW, window_s, selected["state"] if selected else None)
