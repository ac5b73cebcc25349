"""Queue: pending jobs (and why they wait), running and finished ones; cancel, hold, release or
requeue a job after a confirmation; the tail of its log.

`?job=<id>` selects a job. The tables and the job's panel (its state, the actions it allows,
its links, its log) redraw themselves every 2 s from a fresh read (fragments);
actions go through `scheduler.actions`, as the CLI's do (database first, then the job's
supervisor and the daemon are told).
"""

from datetime import datetime, timezone

import streamlit as st

from sae_dist import format as fmt
from sae_dist.analytics import jobs, tables
from sae_dist.errors import UserError
from scheduler import actions, cluster
from webui.sidebar import page_frame
from webui.widgets import command_hint, log_tail

engine = page_frame("Queue", ":material/list:")

REFRESH_S = 2
FINISHED_SHOWN = 100
LOG_LINES = (50, 200, 1000)  # choices of how much of the log's end to show
CONFIRM = "queue_confirm"  # (action, job id) waiting for the person to confirm it
OPEN_DIALOG = "queue_open_dialog"  # set by a click inside the job's fragment: rerun the page
FLASH = "queue_flash"  # (kind, message) of the last action, shown once
ACTION_LABELS = {"cancel": ("Cancel", ":material/cancel:"), "hold": ("Hold", ":material/pause:"),
                 "release": ("Release", ":material/play_arrow:"),
                 "requeue": ("Requeue", ":material/replay:")}
CONSEQUENCES = {
    "cancel": "A pending job is cancelled at once. A running one is sent SIGTERM (SIGKILL after "
              "the grace period) and its devices are freed; it ends CANCELLED.",
    "hold": "It stays in the queue but does not start until it is released.",
    "release": "It can start as soon as enough devices are free.",
    "requeue": "It goes back to the queue and runs again when devices are free; a running job "
               "is stopped first.",
}
# Month and day: the job's panel below says the year. Narrow, so that the tables fit a 1,400 px window.
TIME_COLUMN = {"format": "MM-DD HH:mm:ss", "timezone": "UTC", "width": 115}


def job_option(job_id: int) -> str:
    # No state here: a label is drawn once per page run; the live state is the badge below.
    job = choices[job_id]
    task = f" (array task {job['label']})" if job.get("array_job_id") is not None and job.get("label") else ""
    return f"{job_id}{task} · {job['name']}"


def sync_url() -> None:
    st.query_params["job"] = str(st.session_state["queue_job"])


def ask(action: str, job_id: int) -> None:
    st.session_state[CONFIRM] = (action, job_id)
    st.session_state[OPEN_DIALOG] = True


def forget() -> None:
    st.session_state.pop(CONFIRM, None)


def perform(action: str, job_id: int) -> None:
    forget()
    try:
        st.session_state[FLASH] = ("success", actions.perform(engine, action, job_id))
    except UserError as error:  # it changed state meanwhile, or was removed
        st.session_state[FLASH] = ("error", str(error))


@st.dialog("Confirm", on_dismiss=forget)
def confirm(action: str, job_id: int) -> None:
    if st.session_state.get(CONFIRM) is None:  # answered: close (a full rerun drops the dialog)
        st.rerun()
    job = jobs.get_job(engine, job_id)
    label, icon = ACTION_LABELS[action]
    if job is None:
        st.warning(f"Job {job_id} is no longer in the database.")
        return
    st.markdown(f"**{label} job {job_id}** ({job['name']}, {job['state']})?")
    st.caption(CONSEQUENCES[action])
    with st.container(horizontal=True):
        st.button(f"{label} job {job_id}", icon=icon, type="primary", key="confirm_yes",
                  on_click=perform, args=(action, job_id))
        st.button("Back", key="confirm_no", on_click=forget)


# ---- the tables -------------------------------------------------------------------------------

st.title("Queue", anchor=False)
st.caption(f"Jobs of the local scheduler, updated every {REFRESH_S} s. The same actions from a "
           "terminal: `python -m scheduler queue | show | update | cancel | hold | release | requeue`.")
flash = st.session_state.pop(FLASH, None)
if flash is not None:
    (st.success if flash[0] == "success" else st.error)(flash[1])

queue_now = jobs.queue(engine, FINISHED_SHOWN)
choices = {j["id"]: j for part in ("running", "pending", "finished") for j in queue_now[part]}


@st.fragment(run_every=REFRESH_S)
def queue_tables(known: frozenset[int]) -> None:
    now = datetime.now(timezone.utc)
    queue = jobs.queue(engine, FINISHED_SHOWN)
    ids = {j["id"] for part in queue.values() for j in part}
    if ids - known:
        st.rerun()  # a new job: redraw the page so that it can be selected
    with st.container(horizontal=True):
        st.metric("Running", len(queue["running"]), border=True)
        st.metric("Pending", sum(j["task_count"] for j in queue["pending"]), border=True)
        st.metric("Held", sum(j["task_count"] for j in queue["pending"] if j["held"]), border=True)
        st.metric("Finished (shown)", len(queue["finished"]), border=True)
    array_table()
    running_table(queue["running"], now)
    pending_table(queue["pending"], now)
    finished_table(queue["finished"], now)
    cluster_table()


def array_table() -> None:
    arrays = jobs.array_progress(engine)
    if not arrays:
        return
    st.subheader("Arrays", anchor=False)
    st.dataframe(
        tables.array_rows(arrays), hide_index=True, key="array_table",
        alt="Job arrays with how many of their tasks are pending, running, completed or not",
        column_config={
            "Array": st.column_config.NumberColumn(format="%d", width=60),
            "Progress": st.column_config.ProgressColumn("Ended", min_value=0.0, max_value=1.0,
                                                        format="percent", width=100)})
    st.caption("A task is a job of its own (ARRAY_TASK below); `python -m scheduler cancel ARRAY` "
               "cancels every task.")


def running_table(running: list[dict], now: datetime) -> None:
    st.subheader("Running", anchor=False)
    if not running:
        st.caption("No job is running.")
        return
    runs = jobs.runs_by_job(engine, [j["id"] for j in running])
    st.dataframe(
        tables.drop_quiet_columns(tables.running_rows(running, runs, now)), hide_index=True, key="running_table",
        alt="Running jobs with their devices, progress and elapsed time",
        column_config={
            "Job": st.column_config.NumberColumn(format="%d", width=50),
            "Progress": st.column_config.ProgressColumn(min_value=0.0, max_value=1.0,
                                                        format="percent", width=100),
            "Started": st.column_config.DatetimeColumn("Started (UTC)", **TIME_COLUMN)})


def pending_table(pending: list[dict], now: datetime) -> None:
    st.subheader("Pending", anchor=False)
    if not pending:
        st.caption("Nothing is waiting.")
        return
    st.dataframe(
        tables.drop_quiet_columns(tables.pending_rows(pending, now)), hide_index=True, key="pending_table",
        alt="Pending jobs in the order they would start, with why each waits",
        column_config={
            "Job": st.column_config.NumberColumn(format="%d", width=50),
            "Submitted": st.column_config.DatetimeColumn("Submitted (UTC)", **TIME_COLUMN),
            "Expected start": st.column_config.DatetimeColumn(
                "Expected start (UTC)", help="When the scheduler expects the first job to start, by the "
                "running jobs' time limits (it keeps devices for it); empty where nothing says when",
                **TIME_COLUMN)})
    st.caption("In the order they would start: highest priority first, then oldest.")


def finished_table(finished: list[dict], now: datetime) -> None:
    st.subheader("Finished", anchor=False)
    if not finished:
        st.caption("No job has finished yet.")
        return
    st.dataframe(
        tables.drop_quiet_columns(tables.finished_rows(finished, now)), hide_index=True, key="finished_table",
        alt="Finished jobs, newest first, with their final state and exit code",
        column_config={
            "Job": st.column_config.NumberColumn(format="%d", width=50),
            "Ended": st.column_config.DatetimeColumn("Ended (UTC)", **TIME_COLUMN),
            "Reason": st.column_config.TextColumn(help="Why it ended so; the whole of it under the job below")})
    if len(finished) == FINISHED_SHOWN:
        st.caption(f"The last {FINISHED_SHOWN}; `python -m scheduler acct` lists them all.")


def cluster_table() -> None:
    slurm_jobs, slurm_error = cluster.listed(engine)
    if not slurm_jobs:
        return
    st.subheader("On the SLURM cluster", anchor=False)
    if slurm_error:
        st.warning(f"SLURM could not be asked ({slurm_error}); the last states read are shown.")
    st.dataframe(
        tables.cluster_rows(slurm_jobs), hide_index=True, key="cluster_table",
        alt="Jobs handed to the SLURM cluster, with the state SLURM reports",
        column_config={"Started": st.column_config.DatetimeColumn("Started (UTC)", **TIME_COLUMN),
                       "Ended": st.column_config.DatetimeColumn("Ended (UTC)", **TIME_COLUMN)})
    st.caption("Submitted with `python -m scheduler submit --cluster slurm`; states read from SLURM "
               "(squeue, sacct); cancel with `python -m scheduler cancel slurm:<id>`.")


queue_tables(frozenset(choices))


# ---- one job: actions and log -----------------------------------------------------------------

st.divider()
if not choices:
    st.info("Submit one from the Train page, or from a terminal.", title="The queue is empty")
    st.page_link("pages/1_Train.py", label="Train a sparse autoencoder", icon=":material/rocket_launch:")
    command_hint("python -m scheduler submit --gpus 1 --train run.toml")
    st.stop()

requested = st.query_params.get("job", "")
if requested.isdigit() and int(requested) not in choices:
    old = jobs.get_job(engine, int(requested))  # older than the finished jobs shown
    if old is not None:
        choices[old["id"]] = old
if requested.isdigit() and int(requested) in choices:
    st.session_state["queue_job"] = int(requested)
elif st.session_state.get("queue_job") not in choices:
    st.session_state["queue_job"] = next(iter(choices))

job_id = st.selectbox("Job", list(choices), key="queue_job", format_func=job_option,
                      on_change=sync_url, width=420)
if st.session_state.get(CONFIRM) is not None:
    confirm(*st.session_state[CONFIRM])


# Everything that depends on the job's state is drawn here, from a fresh read at every refresh:
# a panel drawn once outside the fragment kept saying RUNNING after the job had ended.
@st.fragment(run_every=REFRESH_S)  # even for an ended job: it can be requeued from a terminal
def job_panel(job_id: int) -> None:
    job = jobs.get_job(engine, job_id)
    if job is None:
        st.warning(f"Job {job_id} is no longer in the database.")
        return
    if st.session_state.pop(OPEN_DIALOG, False):
        st.rerun()  # an action was asked for: the page (outside this fragment) asks to confirm it
    with st.container(horizontal=True, vertical_alignment="center"):
        st.subheader(f"Job {job_id} · {job['name']}", anchor=False, width="content")
        st.badge(job["state"], color=jobs.STATE_COLORS.get(job["state"], "gray"))
        if job["held"]:
            st.badge("held", color="gray", icon=":material/pause:")
        if job["cancel_requested"] and job["state"] == "RUNNING":
            st.badge("cancelling", color="orange")
        if job["preemptible"]:
            st.badge("preemptible", color="violet", icon=":material/swap_horiz:",
                     help="A job of higher priority may take its devices; it is then requeued")
        if job["shared"]:
            st.badge("shared GPU", color="blue", help="Runs beside other --shared jobs while their --mem fits")
    job_actions(job)
    if job["snapshot_commit"]:
        st.caption(f"Runs the checkout as it was queued: commit `{job['snapshot_commit']}`.")
    if job["state"] == "PENDING":
        st.caption(f"Waiting: {jobs.explain_reason(job['reason'])}. Submitted "
                   f"{fmt.fmt_time(job['submitted_at'])}.")
    else:
        ended = (f" · exit {fmt.fmt_exit(job['exit_code'], job['signal'])}"
                 if job["state"] not in ("PENDING", "RUNNING") else "")
        if job["state"] != "RUNNING" and job["reason"]:
            ended += f" · {fmt.plain_markdown(job['reason'])}"
        st.caption(f"Started {fmt.fmt_time(job['started_at'])} · ended "
                   f"{fmt.fmt_time(job['ended_at'])}{ended} · devices "
                   f"{fmt.short_devices(job['devices'])} · working directory `{job['workdir']}`")
    earlier = tables.attempt_rows(job)
    if earlier:
        st.caption("Earlier runs of this job (requeued), as `python -m scheduler acct -D` lists them:")
        st.dataframe(earlier, hide_index=True, key="attempts_table",
                     column_config={"Started": st.column_config.DatetimeColumn("Started (UTC)", **TIME_COLUMN),
                                    "Ended": st.column_config.DatetimeColumn("Ended (UTC)", **TIME_COLUMN)})
    shown = LOG_LINES[0]
    if jobs.log_paths(job):
        shown = st.segmented_control("Log lines", LOG_LINES, default=LOG_LINES[0], key="log_lines",
                                     format_func=lambda n: f"last {n:,} lines",
                                     label_visibility="collapsed") or LOG_LINES[0]
    log_tail(job, shown)


def job_actions(job: dict) -> None:
    """The actions the job's state allows now, its Monitor and, once it has one, its run."""
    allowed = actions.available(job["state"], job["held"], job["cancel_requested"])
    run_id = jobs.training_run_of(engine, job["id"]) if job["kind"] == "train" else None
    sweep_id = jobs.sweep_of(engine, job["id"]) if run_id is not None else None
    with st.container(horizontal=True, vertical_alignment="center"):
        for action, (label, icon) in ACTION_LABELS.items():
            why_not = allowed[action]
            st.button(label, icon=icon, key=f"ask_{action}", on_click=ask, args=(action, job["id"]),
                      disabled=why_not is not None,
                      help=CONSEQUENCES[action] if why_not is None else f"Not now: {why_not}.")
        st.page_link("pages/2_Monitor.py", label="Monitor", icon=":material/speed:",
                     query_params={"job": str(job["id"])})
        if sweep_id is not None:  # one run per SAE: the sweep shows them all
            st.page_link("pages/6_Sweeps.py", label=f"Sweep {sweep_id}", icon=":material/grid_view:",
                         query_params={"sweep": str(sweep_id)})
        elif run_id is not None:
            st.page_link("pages/4_Training_runs.py", label=f"Training run {run_id}",
                         icon=":material/monitoring:", query_params={"run": str(run_id)})


job_panel(job_id)
