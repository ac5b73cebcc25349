"""Train: pick devices and queue a sparse-autoencoder training job.

The device table says what each device is doing; a device that is allocated, busy,
unavailable or failed (a training rank died on it) cannot be picked, and says why. The form is
the trainer's own configuration (`sae_dist.config.TrainConfig`: labels' help from its fields,
validation by `build_config`), so the page can only queue a validated training, never a
command. Widgets live outside `st.form` so that everything follows the form as it changes: the
memory estimate, the recommended devices (preselected until you pick your own), the selection
summary.
"""

from pathlib import Path

import streamlit as st

from sae_dist import format as fmt
from sae_dist.analytics import devices as dev
from sae_dist.analytics import jobs, train_form
from sae_dist.config import (
    ARCHITECTURES,
    BALANCES,
    MATRYOSHKA_SELECTIONS,
    ON_RANK_LOSS,
    PRECISIONS,
    SOURCES,
    SYNTHETIC_D_IN,
    TOPK_FAMILY,
    config_fields,
)
from sae_dist.contract.sweep_argv import SWEEP_KEY, CheckedTrain
from sae_dist.data.shard_format import input_width, read_layout, shard_pair  # the shards' headers, no torch
from sae_dist.defaults import describe_resolved
from sae_dist.errors import UserError
from sae_dist.paths import default_run_name, run_dir_for
from scheduler import device_view, status
from scheduler.recommend import recommend
from scheduler.spec import MAX_PRIORITY, JobSpec, parse_time_limit
from scheduler.submit import submit_spec
from webui.sidebar import APP_ROOT, page_frame

engine = page_frame("Train", ":material/rocket_launch:")
MONITOR_PAGE = "pages/2_Monitor.py"
QUEUE_PAGE = "pages/3_Queue.py"
SWEEPS_PAGE = "pages/6_Sweeps.py"
HELP = {f.name: f.metadata.get("help") for f in config_fields()}
DEFAULT = {f.name: f.default for f in config_fields()}
# Widget keys and their first values (the trainer's defaults), set in one place.
FORM_DEFAULTS = {
    "tr_architecture": DEFAULT["architecture"], "tr_source": DEFAULT["source"], "tr_shards_path": "",
    "tr_d_in": SYNTHETIC_D_IN, "tr_width_by": "expansion", "tr_expansion": DEFAULT["expansion_factor"],
    "tr_d_sae": SYNTHETIC_D_IN * DEFAULT["expansion_factor"], "tr_k": DEFAULT["k"],
    "tr_l1": DEFAULT["l1_coefficient"], "tr_l0": DEFAULT["l0_coefficient"], "tr_batch": DEFAULT["batch_size"],
    "tr_grad_accum": DEFAULT["grad_accum"],
    "tr_lr": "", "tr_steps": DEFAULT["steps"], "tr_precision": DEFAULT["precision"],
    "tr_checkpoint_every": DEFAULT["checkpoint_every"], "tr_balance": DEFAULT["balance"],
    "tr_rebalance": DEFAULT["rebalance"], "tr_on_rank_loss": DEFAULT["on_rank_loss"],
    "tr_name": "", "tr_priority": 0, "tr_time": "", "tr_matryoshka_widths": "", "tr_matryoshka_selection": "sample",
    "tr_matryoshka_inner_weight": 1.0, "tr_matryoshka_inner_weight_start": "", "tr_matryoshka_inner_weight_until": "",
    "tr_skip": DEFAULT["skip"],
    "tr_auto": True,  # preselect the recommended devices until the user ticks one
    "tr_sweep": False, "tr_sw_architecture": [], "tr_sw_k": "", "tr_sw_expansion_factor": "", "tr_sw_lr": "",
}
# The devices first: the form's first values depend on them (small runs on virtual devices).
try:
    devices, states, _ = status.devices_now(engine)
except UserError as error:
    st.error(str(error), title="The devices cannot be read")
    st.stop()
rows = status.device_rows(devices, states, status.latest_samples(engine), device_view.device_sharers(engine))
all_virtual = bool(rows) and all(r["virtual"] for r in rows)
if st.session_state.pop("tr_clear_name", False):  # a name is for one run: free it after a submit
    st.session_state["tr_name"] = ""
for key, value in train_form.first_values(FORM_DEFAULTS, all_virtual).items():
    st.session_state.setdefault(key, value)
WIDTH_BY = {"expansion": "Expansion factor", "d_sae": "d_sae"}
PAGE_SOURCES = tuple(s for s in SOURCES if s != "model")  # a model source: from the CLI or a TOML file
# Fields of the form that JobSpec checks (its errors name the CLI flag).
SPEC_FLAGS = {"--job-name": "name", "--priority": "priority", "--time": "time_limit"}


def device_key(uuid: str) -> str:
    return f"tr_dev_{uuid}"


def picked_by_hand() -> None:
    """A device was ticked or unticked: the selection is the user's now; the count follows it."""
    st.session_state["tr_auto"] = False
    ticked = sum(bool(st.session_state.get(device_key(u))) for u in st.session_state.get("tr_uuids", []))
    st.session_state["tr_n_gpus"] = max(1, ticked)


def use_recommended() -> None:
    st.session_state["tr_auto"] = True


@st.cache_data(ttl=30, show_spinner=False, max_entries=16)
def shards_d_in(path: str) -> tuple[int, tuple[str, str] | None]:
    """The SAE's d_in from the shards' headers, and the pair (input site, output site) when they are
    a transcoder's paired shards (harvest --transcode, pair-shards): then the form trains one."""
    layout = read_layout(path)
    pair = shard_pair(layout.manifest)
    return input_width(layout, pair), pair


def run_dir_taken(config) -> Path | None:
    """The run directory a named run would write to, when it already holds files (the trainer
    would refuse to start); None when the name is free."""
    _, run_dir = run_dir_for(config)
    return run_dir if run_dir.is_dir() and any(run_dir.iterdir()) else None


st.title("Train", anchor=False)
st.caption("Configure a sparse autoencoder, pick its devices and queue it: the scheduler starts it "
           "as soon as they are free.")
devices_box = st.container()
errors: dict[str, str] = {}  # form field -> message shown above it
slots = {}


def error_slot(field: str) -> None:
    """Where the field's error goes: above the field, as GOV.UK's forms put it. Below it, the
    next field's help, opening upwards when Tab gave its "?" the focus, covered the message."""
    slots[field] = st.empty()


def draw_sweep_fields() -> tuple[dict[str, str], list[str], object]:
    """The sweep's fields (comma-separated values): their texts, the swept architectures, and the
    box its plan is drawn in."""
    with st.container(border=True):
        st.caption("Comma-separated values, e.g. 16, 32, 64. A filled field is swept and replaces its "
                   "single value in the form; a blank one is not swept.")
        sweep_cols = st.columns(4)
        with sweep_cols[0]:
            error_slot("sweep_architecture")
            swept_archs = st.multiselect("Architectures", ARCHITECTURES, key="tr_sw_architecture",
                                         help=HELP["architecture"])
        sweep_texts = {}
        for col, (key, label) in zip(sweep_cols[1:], (("k", "k values"), ("expansion_factor", "Expansion factors"),
                                                      ("lr", "Learning rates"))):
            with col:
                error_slot(f"sweep_{key}")
                sweep_texts[key] = st.text_input(label, key=f"tr_sw_{key}", placeholder="16, 32, 64" if key == "k"
                                                 else "8, 16" if key == "expansion_factor" else "1e-4, 3e-4",
                                                 help=HELP[key])
        error_slot("sweep")
        sweep_preview = st.container()
    return sweep_texts, swept_archs, sweep_preview


def draw_data_fields() -> dict:
    """The data and optimisation column: the source (the shards' d_in read from their headers),
    batch, micro-batches, learning rate as typed, steps."""
    st.markdown("**Data and optimisation**")
    error_slot("source")
    source = st.segmented_control("Source", PAGE_SOURCES, key="tr_source", required=True, help=HELP["source"])
    d_in = shards_path = pair = transcode = None
    skip = False
    if source == "shards":
        error_slot("shards_path")
        typed = st.text_input("Shards directory", key="tr_shards_path", help=HELP["shards_path"],
                              placeholder="/data/activations/gpt2-layer6")
        if typed.strip():
            path = Path(typed.strip()).expanduser()
            shards_path = str(path if path.is_absolute() else (APP_ROOT / path).resolve())
            try:
                d_in, pair = shards_d_in(shards_path)
            except UserError as error:
                errors["shards_path"] = str(error)
        else:
            errors["shards_path"] = "the directory of the activation shards (safetensors files)"
        st.number_input("d_in (from the shards)", value=d_in, disabled=True,
                        help="The width of the shards' activations, read from their headers")
        if pair:
            error_slot("transcode")
            st.caption(f"These shards pair {pair[0]} with {pair[1]}: this trains a **transcoder** predicting "
                       f"{pair[1]} from {pair[0]} (BatchTopK, JumpReLU or standard; SAELens has no TopK one).")
            transcode = f"{pair[0]}:{pair[1]}"
            skip = st.toggle("Skip path", key="tr_skip", help=HELP["skip"])
    else:
        error_slot("d_in")
        d_in = st.number_input("d_in", key="tr_d_in", step=64,
                               help=f"Width of the synthetic activations (default {SYNTHETIC_D_IN})")
    error_slot("batch_size")
    batch = st.number_input("Batch size per device", key="tr_batch", step=256, help=HELP["batch_size"])
    error_slot("grad_accum")
    grad_accum = st.number_input("Micro-batches per step", key="tr_grad_accum", step=1, help=HELP["grad_accum"])
    error_slot("lr")
    lr_text = st.text_input("Learning rate", key="tr_lr", help=HELP["lr"], placeholder="default")
    error_slot("steps")
    steps = st.number_input("Steps", key="tr_steps", step=100, help=HELP["steps"])
    return {"source": source, "d_in": d_in, "shards_path": shards_path, "batch_size": batch,
            "grad_accum": grad_accum, "lr_text": lr_text, "steps": steps, "transcode": transcode, "skip": skip}


def draw_device_rows(table: list[dict], widths: list[float]) -> list[str]:
    """One row a device, its box ticked where picked; returns the devices ticked."""
    selected = []
    for row in table:
        cols = st.columns(widths, vertical_alignment="center")
        ticked = cols[0].checkbox(f"GPU {row['index']}", key=device_key(row["uuid"]),
                                  on_change=picked_by_hand, disabled=not row["selectable"],
                                  help=row["why"] if not row["selectable"] else None)
        if ticked and row["selectable"]:
            selected.append(row["uuid"])
        cols[1].markdown(row["name"] + (" :gray-badge[virtual]" if row["virtual"] else ""))
        cols[2].markdown(row["memory_text"])
        cols[3].markdown(row["utilization"])
        # A failed device (a rank died on it) reads as such; the note says where and since when.
        cols[4].badge("failed" if row["fault"] else row["state_label"], color=row["state_color"])
        note = row["why"]
        if row["low_memory"]:
            note = f":orange-badge[low memory] {note.removeprefix('low memory: ')}"
        elif not row["selectable"]:
            note = f":gray[{note}]"
        if row["recommended"]:
            note = ":green-badge[recommended] " + note
        cols[5].markdown(note or " ")
    return selected


def draw_matryoshka_fields() -> dict:
    """Matryoshka's own fields: the prefixes' widths (blank: the default), how latents are chosen,
    the inner prefixes' loss weight and its schedule (its start and end as typed, blank: the
    defaults)."""
    error_slot("matryoshka_widths")
    widths = st.text_input("Prefix widths", key="tr_matryoshka_widths", placeholder="default",
                           help=HELP["matryoshka_widths"])
    selection = st.segmented_control("Latents chosen per", MATRYOSHKA_SELECTIONS, required=True,
                                     key="tr_matryoshka_selection", help=HELP["matryoshka_selection"])
    error_slot("matryoshka_inner_weight")
    inner = st.number_input("Inner prefixes' weight", min_value=0.0, step=0.25, key="tr_matryoshka_inner_weight",
                            help=HELP["matryoshka_inner_weight"])
    # One under the other: side by side in a third of the page, a message above one wrapped a word a line.
    error_slot("matryoshka_inner_weight_start")
    start = st.text_input("Inner weight at the start", key="tr_matryoshka_inner_weight_start",
                          placeholder="default", help=HELP["matryoshka_inner_weight_start"])
    error_slot("matryoshka_inner_weight_until")
    until = st.text_input("Falling to it by (share of the steps)", key="tr_matryoshka_inner_weight_until",
                          placeholder="default", help=HELP["matryoshka_inner_weight_until"])
    return {"matryoshka_widths": widths, "matryoshka_selection": selection, "matryoshka_inner_weight": inner,
            "matryoshka_inner_weight_start": start, "matryoshka_inner_weight_until": until}


def draw_form() -> dict:
    """The SAE form's widgets (drawn below the devices, read first: the devices depend on it): the
    fields train_form.form_config reads, the sweep's texts (None: no sweep) and architectures, the
    job's priority and time limit as typed, and where the sweep's plan goes."""
    # Above the columns, at its full width: in a third of the page its last option read "jumpr…".
    error_slot("architecture")
    architecture = st.segmented_control("Architecture", ARCHITECTURES, key="tr_architecture",
                                        required=True, help=HELP["architecture"])
    sweep_on = st.toggle("Sweep: many SAEs in one job", key="tr_sweep",
                         help="List values in the fields below: every combination is one SAE, all trained in one "
                              "job from one activation stream (at most 256)")
    sweep_texts, swept_archs, sweep_preview = draw_sweep_fields() if sweep_on else (None, [], None)
    model_col, data_col, job_col = st.columns(3, gap="medium")
    with model_col:
        st.markdown("**Model**")
        width_by = st.segmented_control("Latent count", list(WIDTH_BY), key="tr_width_by", required=True,
                                        format_func=WIDTH_BY.get, help="Give d_sae directly, or as d_in x a factor")
        if width_by == "d_sae":
            error_slot("d_sae")
            d_sae = st.number_input("d_sae (latents)", key="tr_d_sae", step=1024, help=HELP["d_sae"])
        else:
            error_slot("expansion_factor")
            expansion = st.number_input("Expansion factor", key="tr_expansion", step=1,
                                        help=HELP["expansion_factor"])
        if architecture in TOPK_FAMILY:
            error_slot("k")
            k = st.number_input("k (active latents)", key="tr_k", step=1, help=HELP["k"])
        elif architecture == "standard":
            error_slot("l1_coefficient")
            l1 = st.number_input("L1 coefficient", key="tr_l1", step=0.01, format="%.4f",
                                 help=HELP["l1_coefficient"])
        else:
            error_slot("l0_coefficient")
            l0 = st.number_input("L0 coefficient", key="tr_l0", step=0.005, format="%.4f",
                                 help=HELP["l0_coefficient"])
        matryoshka = draw_matryoshka_fields() if architecture == "matryoshka" else {}
        error_slot("precision")
        precision = st.segmented_control("Precision", PRECISIONS, key="tr_precision", required=True,
                                         help=HELP["precision"])

    with data_col:
        data = draw_data_fields()

    with job_col:
        st.markdown("**Job**")
        error_slot("name")
        name = st.text_input("Name", key="tr_name", placeholder="<architecture>-<d_sae>-<time>",
                             help="The job's and the run's name; blank: one is made up at submit")
        error_slot("checkpoint_every")
        checkpoint_every = st.number_input("Checkpoint every (steps)", key="tr_checkpoint_every", step=100,
                                           help=HELP["checkpoint_every"])
        error_slot("priority")
        # Bounds: the browser refuses a number past them (a 20-digit one was silently stored as 0).
        priority = st.number_input("Priority", key="tr_priority", step=1, min_value=-MAX_PRIORITY,
                                   max_value=MAX_PRIORITY,
                                   help="Higher starts first among pending jobs (SLURM's -nice)")
        error_slot("time_limit")
        time_text = st.text_input("Time limit", key="tr_time", placeholder="UNLIMITED",
                                  help="SLURM's --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM[:SS]; "
                                       "blank or UNLIMITED for none. The job is stopped (TIMEOUT) after it.")
        balance = st.segmented_control("Share of each step", BALANCES, key="tr_balance", required=True,
                                       help=HELP["balance"])
        rebalance = st.toggle("Rebalance stragglers", key="tr_rebalance", help=HELP["rebalance"])
        on_rank_loss = st.segmented_control("If a device fails", ON_RANK_LOSS, key="tr_on_rank_loss", required=True,
                                            help=HELP["on_rank_loss"])
    fields = {**data, "architecture": architecture, "precision": precision, "checkpoint_every": checkpoint_every,
              "balance": balance, "rebalance": rebalance, "on_rank_loss": on_rank_loss,
              "width_by": width_by, "name": name,
              "d_sae": d_sae if width_by == "d_sae" else None,
              "expansion_factor": expansion if width_by != "d_sae" else None,
              "k": k if architecture in TOPK_FAMILY else None,
              **matryoshka,
              "l1_coefficient": l1 if architecture == "standard" else None,
              "l0_coefficient": l0 if architecture not in (*TOPK_FAMILY, "standard") else None}
    return {"fields": fields, "sweep_texts": sweep_texts, "swept_architectures": swept_archs,
            "preview": sweep_preview, "priority": priority, "time_text": time_text}


def draw_devices(config, batch, grad_accum) -> tuple[list[dict], list[str], dict]:
    """The devices: what each is doing, which fit the estimate, which are recommended (ticked
    until the user picks); returns the table's rows, the devices ticked and what the job asks."""
    uuids = [r["uuid"] for r in rows]
    st.session_state["tr_uuids"] = uuids
    # How many to recommend: at first every idle GPU (people train on what is free), 2 virtual ones.
    st.session_state.setdefault("tr_n_gpus", train_form.devices_wanted(
        sum(dev.why_not_selectable(r) is None for r in rows), all_virtual))
    wanted_error = train_form.wanted_error(st.session_state["tr_n_gpus"], len(rows))
    if wanted_error:
        errors["n_gpus"] = f"GPUs wanted: {wanted_error}"
    wanted = min(max(1, int(st.session_state["tr_n_gpus"] or 1)), max(1, len(rows)))

    estimate = None
    if config is not None and config.d_in is not None:
        from sae_dist.memory import estimate_for_config

        # Virtual devices are CPU ranks: their runtime is a CPU process's, not a CUDA context.
        estimate = estimate_for_config(config, wanted, "cpu" if all_virtual else "cuda")
    need = estimate.total if estimate is not None else None
    fitting = [r for r in rows if dev.why_not_selectable(r) is None and dev.low_memory(r, need) is None]
    advice = recommend(devices, states, wanted, need)
    recommended = advice.chosen
    if advice.error and fitting:  # fewer fit than wanted: recommend those that do
        recommended = recommend(devices, states, len(fitting), need).chosen
    if st.session_state["tr_auto"]:
        for uuid in uuids:
            st.session_state[device_key(uuid)] = uuid in recommended
    table = dev.selection_rows(rows, need, recommended)
    for row in table:
        if not row["selectable"]:
            st.session_state[device_key(row["uuid"])] = False  # a device taken meanwhile drops out

    with devices_box:
        st.subheader("Devices", anchor=False)
        error_slot("n_gpus")
        with st.container(horizontal=True, vertical_alignment="bottom"):
            # No min/max: the browser would only outline a 0 in red; the page says why instead.
            st.number_input("GPUs wanted", key="tr_n_gpus", step=1, on_change=use_recommended, width=150,
                            help="How many devices to recommend: idle ones with room for the estimate, "
                                 "most free memory first")
            st.button("Use recommended", key="tr_use_recommended", icon=":material/auto_awesome:",
                      on_click=use_recommended)
            st.button("Refresh", key="tr_refresh", icon=":material/refresh:",
                      help="Read the devices' state again")
        if any(r["virtual"] for r in rows):
            st.caption("Virtual devices: each is one CPU-backed training rank (no NVIDIA GPU in use here). "
                       "The form starts with a small synthetic run that ends in about a minute on 2 of them.")
        widths = [1.5, 2.2, 2.1, 1.3, 1.1, 2.7]  # "GPU 0" beside its help icon, "Utilisation" on one line at 1,280 px
        with st.container(border=True, gap="xsmall"):
            for col, title in zip(st.columns(widths), ("Device", "Name", "Memory", "Utilisation", "State",
                                                      "Note")):
                col.markdown(f"**{title}**")
            selected = draw_device_rows(table, widths)
        asked = train_form.devices_asked(selected, wanted)
        free = sum(r["selectable"] for r in table)
        effective = (asked["gpus"] * batch * grad_accum if isinstance(batch, int) and isinstance(grad_accum, int)
                     else None)
        picked = f"{len(selected)} GPUs" if selected else f"none, any {asked['gpus']} GPU{'s' * (asked['gpus'] != 1)}"
        st.markdown(f"**Selected: {picked} | Effective batch size: "
                    f"{effective if effective is not None else fmt.MISSING}**")
        if estimate is not None:
            st.caption(f"Estimated memory: {estimate.describe()}.")
            st.caption("Optimisation: " + describe_resolved(config, config.resolved(asked["gpus"])) + ".")
        else:
            st.caption(f"Estimated memory per device: {fmt.MISSING} (fix the form first).")
        if not free:
            st.info(f"Submit queues the job for any {asked['gpus']} device{'s' if asked['gpus'] != 1 else ''}: it "
                    "waits in the queue (PENDING) and the scheduler starts it as soon as they are free. The State "
                    "column says what holds each one.", title="Every device is taken: the job will wait")
        elif advice.error:
            short = any(r["selectable"] and r["low_memory"] for r in table)
            st.warning(f"{len(fitting)} of the {wanted} wanted are idle with room for the estimate; the "
                       "table says why for the others."
                       + (" A low-memory device can still be picked by hand if the estimate is too cautious."
                          if short else ""),
                       title=f"Fewer than {wanted} devices fit now")
    return table, selected, asked


def draw_sweep_plan(sweep, table: list[dict], selected: list[str], asked: dict, preview) -> None:
    """A sweep's SAEs and where they would train, before the submit."""
    # The devices it would train on: those ticked, else the largest it may get.
    planned = ([r for r in table if r["uuid"] in selected] if selected else
               sorted(table, key=lambda r: -(r["memory_total"] or 0))[:asked["gpus"]])
    plan = train_form.sweep_plan(sweep, [(r["label"], None if r["virtual"] else r["memory_total"]) for r in planned],
                                 "cpu" if all_virtual else "cuda")
    with preview:
        st.markdown(f"**{plan['count']} SAEs in one job:** " + ", ".join(f"`{n}`" for n in plan["names"]))
        if plan["error"]:
            errors["sweep"] = plan["error"]
        elif plan["rows"]:
            st.caption(plan["reason"] + ".")
            st.dataframe(plan["rows"], hide_index=True)
        else:
            st.caption(f"Estimated memory per device: {fmt.MISSING} (select devices first).")


def draw_submit(config, sweep, sweep_lists: dict, asked: dict, table: list[dict], priority,
                time_limit_s: float | None) -> None:
    """The job checked as the scheduler will (each error above its field), then one click queues it."""
    spec = None
    train_dict = None if config is None else {**config.to_dict(), **({SWEEP_KEY: sweep_lists} if sweep else {})}
    if config is not None and not errors:
        # The job and its run named alike, and uniquely (the default name holds this second).
        run_name = config.name or default_run_name(config, len(sweep) if sweep else None)
        try:
            # Checked once, by form_config: the JobSpec stores it as it is (a made-up name is valid).
            named = CheckedTrain(config if config.name else config._unchecked(name=run_name),
                                 sweep_lists if sweep else None)
            spec = JobSpec(kind="train", train_config=named, name=run_name,
                           gpu_ids=asked["gpu_ids"], gpus=asked["gpus"], priority=int(priority),
                           time_limit_s=time_limit_s, workdir=str(APP_ROOT))
        except UserError as error:
            flag, _, message = str(error).partition(": ")
            errors[SPEC_FLAGS.get(flag, "general")] = message if flag in SPEC_FLAGS else str(error)

    for field, message in errors.items():
        if field in slots:
            slots[field].error(message, icon=":material/error:")
        else:  # a field the form does not show (or a check spanning several): above the form
            general_error.error(message if field == "general" else f"{field}: {message}",
                                icon=":material/error:")

    # One click queues one job: the form just submitted cannot be queued again by another click (the
    # next free devices are ticked by then) until it changes, or the person asks for the same again.
    current = (train_form.fingerprint(train_dict, int(priority), time_limit_s, asked["gpus"])
               if spec is not None else None)
    last = st.session_state.get("tr_last_submit")
    repeat = train_form.repeats_last(current, last, st.session_state.get("tr_again", False))
    if current != last:
        st.session_state.pop("tr_again", None)  # a confirmation holds for the form it was given on

    st.divider()
    with st.container(horizontal=True, vertical_alignment="center"):
        clicked = st.button("Submit training job", key="tr_submit", type="primary", icon=":material/send:",
                            disabled=spec is None or repeat)
        if repeat:
            job_id = st.session_state["tr_submitted"][0]
            st.caption(f"Job {job_id} was just queued from this form: change a field to queue another,",
                       width="content")
            st.button("or queue the same again", key="tr_again_button", icon=":material/content_copy:",
                      on_click=lambda: st.session_state.update(tr_again=True))
        elif errors:
            st.caption("Fix the fields marked in red to submit.")
        else:
            free = sum(r["selectable"] for r in table)
            on = train_form.asked_in_words(asked, {r["uuid"]: r["label"] for r in table}, free)
            st.caption(f"{f'{len(sweep)} SAEs, ' if sweep else ''}{config.steps:,} steps on {on}"
                       f"{'' if time_limit_s is None else ', time limit ' + fmt.fmt_duration(time_limit_s)}")
    if clicked and spec is not None:
        try:
            job_id = submit_spec(engine, spec, devices)
        except UserError as error:
            st.error(str(error), title="The job was not queued")
        else:
            st.session_state["tr_submitted"] = (job_id, spec.name, spec.gpus)
            st.session_state["tr_submitted_saes"] = len(sweep) if sweep else None
            st.session_state["tr_last_submit"] = current
            st.session_state.pop("tr_again", None)
            st.session_state["tr_auto"] = True
            st.session_state["tr_clear_name"] = True
            st.rerun()


def draw_submitted() -> None:
    """Where the job just queued stands, with links to follow it."""
    job_id, job_name, n = st.session_state["tr_submitted"]
    saes = st.session_state.get("tr_submitted_saes")
    standing = train_form.job_status(jobs.get_job(engine, job_id), jobs.explain_reason)
    st.success(f"Job {job_id} ({fmt.plain_markdown(job_name)}{f', {saes} SAEs' if saes else ''}, {n} "
               f"device{'s' if n > 1 else ''}) is in the queue: {standing}.",
               title="Submitted", icon=":material/check_circle:")
    with st.container(horizontal=True):
        st.page_link(MONITOR_PAGE, label=f"Monitor job {job_id}", icon=":material/speed:",
                     query_params={"job": str(job_id)})
        st.page_link(QUEUE_PAGE, label=f"Job {job_id} in the queue", icon=":material/list:",
                     query_params={"job": str(job_id)})
        if saes:  # its SAEs' grid, once the job has started them
            st.page_link(SWEEPS_PAGE, label="Sweeps", icon=":material/grid_view:")

st.subheader("Sparse autoencoder", anchor=False)
general_error = st.empty()
form = draw_form()
# ---- validate: the trainer's own checks; each message goes above the field it names ----
config, sweep, sweep_lists, form_errors = train_form.form_config(form["fields"], form["sweep_texts"],
                                                                 form["swept_architectures"])
for field, message in form_errors.items():
    errors.setdefault(field, message)
time_limit_s = None
if form["time_text"].strip():
    try:
        time_limit_s = parse_time_limit(form["time_text"])
    except (UserError, OverflowError) as error:
        errors["time_limit"] = str(error).removeprefix("--time: ")
if config is not None and config.name and "name" not in errors:
    taken = run_dir_taken(config)
    if taken is not None:
        errors["name"] = f"a run named {config.name!r} already exists ({taken}); choose another name"
table, selected, asked = draw_devices(config, form["fields"]["batch_size"], form["fields"]["grad_accum"])
if sweep is not None:
    draw_sweep_plan(sweep, table, selected, asked, form["preview"])
draw_submit(config, sweep, sweep_lists, asked, table, form["priority"], time_limit_s)
if "tr_submitted" in st.session_state:
    draw_submitted()
