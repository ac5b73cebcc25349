"""Overview: the machine at a glance: devices, running jobs, the queue, finished jobs, training runs.

Run with `streamlit run app.py`; the state database is `$SAE_DIST_HOME/state.db` (or
`$SAE_DIST_DB_URL`). Device and queue data come from `scheduler.status`, formatting from
`sae_dist.analytics`; this page only lays them out. The live parts are fragments that redraw
themselves every REFRESH_SECONDS without rerunning the page.
"""

from datetime import datetime, timezone

import streamlit as st

from sae_dist import format as fmt
from sae_dist.analytics import devices as dev
from sae_dist.analytics import queries
from sae_dist.analytics.tables import runs_table
from sae_dist.errors import UserError
from scheduler import device_view, status
from scheduler.store import JobNotFound, count_jobs, get_job
from scheduler.submit import submit_demo
from webui.sidebar import APP_ROOT, REFRESH_SECONDS, page_frame

engine = page_frame("Overview", ":material/dashboard:")
MONITOR_PAGE = "pages/2_Monitor.py"
RUNS_PAGE = "pages/4_Training_runs.py"
TRAIN_PAGE = "pages/1_Train.py"
RUN_STATUSES = ("RUNNING", "COMPLETED", "STOPPED", "FAILED")  # every status the trainer writes
RUN_STATUS_HELP = {"STOPPED": "Ended by a signal: a cancel, a time limit, Ctrl-C"}
FINISHED_COLORS = {"COMPLETED": "green", "CANCELLED": "gray", "TIMEOUT": "orange"}  # others: red


def monitor_link(job_id: int, label: str) -> None:
    """A link to watch a job on the Monitor page."""
    st.page_link(MONITOR_PAGE, label=label, icon=":material/speed:", query_params={"job": str(job_id)})


def start_demo() -> None:
    try:
        job_id, chosen = submit_demo(engine, str(APP_ROOT))
    except UserError as error:
        st.session_state["demo_error"] = str(error)
        return
    st.session_state["demo_job"] = (job_id, len(chosen) or 1)


st.title("Overview", anchor=False)
st.caption(f"Devices, jobs and training runs on this machine; updated every {REFRESH_SECONDS} s.")

def demo_active(job_id: int) -> bool:
    try:
        return get_job(engine, job_id).state in ("PENDING", "RUNNING")
    except JobNotFound:
        return False


demo = st.session_state.get("demo_job")
if demo is not None and demo_active(demo[0]):
    job_id, n = demo
    with st.container(border=True):
        st.success(f"Demo job {job_id} is queued on {n} device{'s' if n > 1 else ''}: synthetic data, "
                   "3,000 steps, about a minute on CPU. Its curves appear below as it trains.",
                   title="Demo submitted", icon=":material/rocket_launch:")
        monitor_link(job_id, f"Monitor job {job_id}")
elif demo is None and count_jobs(engine) == 0 and not queries.list_runs(engine, limit=1):
    with st.container(border=True, key="demo_card"):
        st.markdown("**Nothing has run here yet.** Try it with one click: a small sparse autoencoder "
                    "on synthetic activations (d_in 64, 256 latents, k = 8, 3,000 steps) on up to two "
                    "free devices. It starts within seconds and finishes in about a minute on CPU.")
        st.button("Start a demo training", key="demo", type="primary", icon=":material/play_arrow:",
                  on_click=start_demo)
        if "demo_error" in st.session_state:
            st.error(st.session_state["demo_error"], title="The demo could not be queued")


@st.fragment(run_every=REFRESH_SECONDS)
def machine_overview() -> None:
    now = datetime.now(timezone.utc)
    devices, states, _ = status.devices_now(engine)
    rows = status.device_rows(devices, states, status.latest_samples(engine), device_view.device_sharers(engine))
    st.subheader("Devices", anchor=False)
    if any(r["virtual"] for r in rows):
        st.caption("No NVIDIA GPU in use here: these are virtual devices, each one CPU-backed "
                   "training rank. Their memory is a share of the machine's RAM; temperature and "
                   f"power are not measured ({fmt.MISSING}).")
    with st.grid(4, gap="small", min_column_width=220):
        for row in rows:
            device_card(row)

    queue = status.queue_overview(engine, now)
    counts = queue["counts"]
    st.subheader("Jobs", anchor=False)
    with st.container(horizontal=True):
        st.metric("Running jobs", counts["RUNNING"], border=True, width=180)
        st.metric("Pending jobs", counts["PENDING"], border=True, width=180,
                  help=f"{counts['held']} of them held" if counts["held"] else None)
    for job in queue["running"]:
        running_job(job)
    if queue["pending"]:
        st.markdown("**Next in the queue**")
        st.dataframe(
            [{"Job": j["id"], "Name": j["name"], "GPUs": j["gpus"], "Priority": j["priority"],
              "Reason": j["reason"] or fmt.MISSING} for j in queue["pending"]],
            hide_index=True, alt="The first pending jobs, in the order they will start, with why they wait",
            column_config={"Job": st.column_config.NumberColumn(format="%d", width=60)})
        if counts["PENDING"] > len(queue["pending"]):
            st.caption(f"and {counts['PENDING'] - len(queue['pending'])} more pending.")
    elif not queue["running"]:
        st.caption("The queue is empty.")
    if queue["finished"]:
        st.markdown("**Recently finished**")
        st.dataframe(
            [{"Job": j["id"], "Name": j["name"], "State": j["state"],
              "Exit code": fmt.fmt_exit(j["exit_code"], j["signal"]),
              "Ended": fmt.fmt_ago((now - j["ended_at"]).total_seconds() if j["ended_at"] else None),
              "Elapsed": fmt.fmt_duration(j["elapsed_s"]), "Reason": j["reason"] or ""}
             for j in queue["finished"]],
            hide_index=True, alt="The last jobs that ended, with their state and exit code",
            column_config={"Job": st.column_config.NumberColumn(format="%d", width=60)})


def device_card(row: dict) -> None:
    c = dev.card(row)
    label, color, why = c["badge"]
    if row["fault"]:  # unavailable because a training rank died on it, until a health check passes
        label = "failed"
    with st.container(border=True, gap="small"):
        st.markdown(f"**{c['title']}**")
        with st.container(horizontal=True, vertical_alignment="center", gap="small"):
            st.badge(label, color=color, help=why)
            if c["virtual"]:
                st.badge("virtual", color="gray", icon=":material/memory:", help=dev.VIRTUAL_HELP)
        if row["fault"]:
            st.caption(f"Unavailable: {row['reason'].rstrip('.')}. Back for new jobs once a health check "
                       "passes (the daemon's, or `python -m scheduler info --recheck`).")
        if c["memory_fraction"] is None:
            st.caption(f"Memory {c['memory_text']}")
        else:
            st.progress(c["memory_fraction"], text=f"Memory {c['memory_text']}")
        if c["utilization_fraction"] is None:
            st.caption(f"Utilisation {c['utilization']}")
        else:
            st.progress(c["utilization_fraction"], text=f"Utilisation {c['utilization']}")
        st.markdown(f":small[Temperature **{c['temperature']}** · Power **{c['power']}**]")


def running_job(job: dict) -> None:
    with st.container(border=True, gap="small"):
        with st.container(horizontal=True, vertical_alignment="center", gap="small"):
            st.markdown(f"**Job {job['id']}** · {job['name']}", width="content")
            st.badge("RUNNING", color="blue")
            if job["cancel_requested"]:
                st.badge("cancelling", color="orange")
            st.caption(f"on {fmt.short_devices(job['devices'])}", width="content")
        text = progress_text(job)
        if job["fraction"] is None:
            st.caption(text)
        else:
            st.progress(job["fraction"], text=text)
        monitor_link(job["id"], f"Watch job {job['id']}")


def progress_text(job: dict) -> str:
    basis = job["basis"]
    if basis == "steps":
        eta = f" · ETA {fmt.fmt_duration(job['eta_s'])}" if job["eta_s"] is not None else ""
        return f"Step {fmt.fmt_steps(job['step'], job['total_steps'])}{eta}"
    if basis == "starting":
        total = f" of {job['total_steps']:,} steps" if job["total_steps"] else ""
        return f"Starting: no step logged yet{total} · running for {fmt.fmt_duration(job['elapsed_s'])}"
    if basis == "time":
        return (f"Elapsed {fmt.fmt_duration(job['elapsed_s'])} of its "
                f"{fmt.fmt_duration(job['time_limit_s'])} time limit")
    return f"Elapsed {fmt.fmt_duration(job['elapsed_s'])} · no time limit"


machine_overview()


@st.fragment(run_every=REFRESH_SECONDS)
def runs_overview() -> None:
    st.subheader("Training runs", anchor=False)
    runs = queries.list_runs(engine)
    if not runs:
        st.info("Configure one and pick its devices on the Train page; it appears here as it "
                "starts.", title="No training run yet")
        st.page_link(TRAIN_PAGE, label="Train a sparse autoencoder", icon=":material/rocket_launch:")
        return

    statuses = [run["status"] for run in runs]
    with st.container(horizontal=True):
        for run_status in RUN_STATUSES:
            st.metric(run_status.capitalize(), statuses.count(run_status), border=True, width=180,
                      help=RUN_STATUS_HELP.get(run_status))

    st.dataframe(
        runs_table(runs, datetime.now(timezone.utc)),
        hide_index=True, key="runs_table",
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
               "logged ones; — means not measured. A table wider than the page scrolls sideways "
               "(shift + wheel, or drag), its name column staying in view.")

    for run in runs:
        if run["status"] == "RUNNING":
            st.page_link(RUNS_PAGE, label=f"Watch run {run['id']} ({run['name']})",
                         icon=":material/play_circle:", query_params={"run": str(run["id"])})


runs_overview()
