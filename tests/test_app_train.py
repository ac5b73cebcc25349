"""The Train page with AppTest: a real SQLite database in a temporary home, 4 virtual devices,
SAE_DIST_AUTOSTART=0 so that submitting starts no daemon (jobs stay PENDING)."""

from __future__ import annotations

import json

import pytest
import torch
from streamlit.testing.v1 import AppTest

from conftest import REPO
from sae_dist.data.shard_format import write_shards
from sae_dist.db import get_engine
from scheduler.control import daemon_running
from scheduler.store import list_jobs
from test_status import running_job

TRAIN_PAGE = "pages/1_Train.py"
TIMEOUT = 30
UUIDS = [f"virtual-{i}" for i in range(4)]


@pytest.fixture(autouse=True)
def virtual_devices(state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "4")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")


def train_page() -> AppTest:
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=TIMEOUT).run()
    at.switch_page(TRAIN_PAGE).run()
    assert not at.exception
    return at


def device(at: AppTest, uuid: str):
    return at.checkbox(key=f"tr_dev_{uuid}")


def ticked(at: AppTest) -> list[str]:
    return [u for u in UUIDS if device(at, u).value]


def summary(at: AppTest) -> str:
    lines = [m.value for m in at.markdown if "Selected:" in m.value]
    assert len(lines) == 1, lines
    return lines[0].strip("*")


def field_errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def pick(at: AppTest, wanted: list[str]) -> AppTest:
    """Tick exactly `wanted`, one click at a time as a person would."""
    for uuid in UUIDS:
        box = device(at, uuid)
        if box.value != (uuid in wanted):
            box.set_value(uuid in wanted)
            at.run()
            assert not at.exception
    return at


def test_on_virtual_devices_the_page_preselects_two_for_a_small_run_and_says_so():
    at = train_page()
    assert ticked(at) == UUIDS[:2]  # recommended: 2 of the 4 idle virtual devices (2 cores here)
    assert summary(at) == "Selected: 2 GPUs | Effective batch size: 512"  # 2 x 256
    assert (at.number_input(key="tr_d_in").value, at.number_input(key="tr_steps").value) == (64, 1500)
    assert any("about a minute on 2 of them" in c.value for c in at.caption)
    assert not at.error
    assert at.button(key="tr_submit").disabled is False
    assert any("Estimated memory:" in c.value and "per device" in c.value for c in at.caption)
    assert any("virtual" in m.value for m in at.markdown)
    assert "Train" in [link.value for link in at.page_link]  # the sidebar links the page


def optimisation(at: AppTest) -> str:
    (line,) = [c.value for c in at.caption if c.value.startswith("Optimisation: ")]
    return line


def test_the_resolved_defaults_are_shown_before_submit():
    from sae_dist.config import TrainConfig
    from sae_dist.defaults import default_lr

    at = train_page()  # virtual devices: 2 devices x 256 x 1,500 steps of synthetic d_in 64, 256 latents, k 8
    lr = float(f"{default_lr(2 * 256, 256, 8, 64):.3g}")
    assert optimisation(at) == (f"Optimisation: lr {lr:.3g} (default), warm-up 75 steps (default), decay to 0 over "
                                "the last 20% of the steps (default), dead after 76,800 samples without firing "
                                "(default), no decoder refit (default), no rare-latent bias (default).")
    # (dead after: a tenth of the run's 768,000 samples)
    assert TrainConfig(d_in=64, batch_size=256, steps=1500).resolved(2).dead_after_samples == 76_800
    at.text_input(key="tr_lr").set_value("1e-3").run()
    pick(at, ["virtual-0"])  # one device: half the samples
    assert optimisation(at).startswith("Optimisation: lr 0.001, warm-up 75 steps (default)")
    assert "dead after 38,400 samples" in optimisation(at)
    at.segmented_control(key="tr_architecture").set_value("matryoshka").run()  # refits its decoder by default
    assert optimisation(at).endswith("decoder refit to the last 20% of the steps (default), rare-latent bias under "
                                     "0.4 of the average rate for the first 70% of the steps (default).")
    assert optimisation(at).startswith("Optimisation: lr 0.001, decoder at 3x the lr (default), inner prefixes "
                                       "through their own offset (default), inner weight 8 falling to 1 by 60% of "
                                       "the steps (default), warm-up")


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_the_summary_follows_the_selection_and_the_batch():
    at = pick(train_page(), ["virtual-1", "virtual-3"])
    assert summary(at) == "Selected: 2 GPUs | Effective batch size: 512"
    assert at.number_input(key="tr_n_gpus").value == 2  # the count follows a hand-made pick
    at.number_input(key="tr_batch").set_value(1024).run()
    assert ticked(at) == ["virtual-1", "virtual-3"]  # a form change keeps the pick
    assert summary(at) == "Selected: 2 GPUs | Effective batch size: 2048"
    at.number_input(key="tr_n_gpus").set_value(1).run()  # asking for a count: recommended again
    assert not at.exception and len(ticked(at)) == 1
    assert summary(at) == "Selected: 1 GPUs | Effective batch size: 1024"
    at.number_input(key="tr_grad_accum").set_value(3).run()  # micro-batches multiply it
    assert summary(at) == "Selected: 1 GPUs | Effective batch size: 3072"
    pick(at, [])  # none ticked: any 1 device, as many as wanted (the scheduler picks, or queues)
    assert summary(at) == "Selected: none, any 1 GPU | Effective batch size: 3072"
    assert not at.button(key="tr_submit").disabled
    at.button(key="tr_use_recommended").click().run()
    assert len(ticked(at)) == 1


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_submit_queues_a_pending_training_on_exactly_the_chosen_devices():
    at = pick(train_page(), ["virtual-0", "virtual-2"])
    at.number_input(key="tr_steps").set_value(200)
    at.number_input(key="tr_batch").set_value(512)
    at.text_input(key="tr_lr").set_value("3e-4")
    at.text_input(key="tr_name").set_value("pick-two")
    at.text_input(key="tr_time").set_value("1:30:00")
    at.number_input(key="tr_priority").set_value(7)
    at.segmented_control(key="tr_balance").set_value("speed")
    at.toggle(key="tr_rebalance").set_value(False)
    at.segmented_control(key="tr_on_rank_loss").set_value("fail").run()
    assert not at.error
    at.button(key="tr_submit").click().run()
    assert not at.exception

    jobs = list_jobs(get_engine())
    assert len(jobs) == 1
    job = jobs[0]
    assert (job.state, job.kind, job.name, job.gpus) == ("PENDING", "train", "pick-two", 2)
    assert json.loads(job.gpu_ids_json) == ["virtual-0", "virtual-2"]
    assert json.loads(job.argv_json) == []  # a training config, never a command
    assert (job.priority, job.time_limit_s) == (7, 5400.0)
    config = json.loads(job.train_config_json)
    assert (config["steps"], config["batch_size"], config["lr"], config["name"]) == (200, 512, 3e-4, "pick-two")
    assert (config["architecture"], config["source"], config["d_in"]) == ("topk", "synthetic", 64)
    assert (config["balance"], config["rebalance"], config["on_rank_loss"]) == ("speed", False, "fail")
    assert at.success[0].value.startswith(f"Job {job.id} (pick-two, 2 devices) is in the queue: PENDING, ")
    assert at.text_input(key="tr_name").value == ""  # a name is for one run
    assert any(link.value == f"Monitor job {job.id}" for link in at.page_link) or \
        any(f"Job id {job.id}" in c.value for c in at.caption)
    assert not daemon_running()  # SAE_DIST_AUTOSTART=0 is honoured


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_the_confirmation_shows_the_jobs_name_as_typed_not_as_markdown():
    at = pick(train_page(), ["virtual-0"])
    at.text_input(key="tr_name").set_value("*big* :red[run]").run()
    at.button(key="tr_submit").click().run()
    assert at.success[0].value.startswith("Job 1 (\\*big\\* :red\\[run\\], 1 device) is in the queue")


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_a_blank_name_gets_one_shared_by_the_job_and_its_run():
    at = pick(train_page(), ["virtual-3"])
    at.button(key="tr_submit").click().run()
    job = list_jobs(get_engine())[0]
    config = json.loads(job.train_config_json)
    assert job.name == config["name"] and job.name.startswith("topk-256-")
    assert json.loads(job.gpu_ids_json) == ["virtual-3"]


def test_an_allocated_device_cannot_be_chosen_and_says_which_job():
    job_id = running_job(get_engine(), ["virtual-1"])
    at = train_page()
    box = device(at, "virtual-1")
    assert box.disabled and box.value is False
    assert box.proto.help == f"allocated to job {job_id}"
    assert ticked(at) == ["virtual-0", "virtual-2"]  # 2 of the 3 free
    assert summary(at) == "Selected: 2 GPUs | Effective batch size: 512"
    texts = [m.value for m in at.markdown]
    assert f":blue-badge[job {job_id}]" in texts
    assert any(f"allocated to job {job_id}" in t for t in texts)
    with pytest.raises(Exception):  # AppTest refuses to tick a disabled box, as a browser does
        box.check()


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_with_every_device_taken_a_submit_queues_the_job_until_devices_free():
    """Queueing is the point of a scheduler: with every device busy the page still submits, for
    any N devices, and says where the job stands (the Queue page's words)."""
    job_id = running_job(get_engine(), UUIDS)
    at = train_page()
    assert all(device(at, u).disabled for u in UUIDS) and ticked(at) == []
    assert at.info[0].proto.title == "Every device is taken: the job will wait"
    assert summary(at) == "Selected: none, any 1 GPU | Effective batch size: 256"
    assert sum(f"allocated to job {job_id}" in m.value for m in at.markdown) == 4
    at.number_input(key="tr_n_gpus").set_value(2).run()
    assert any("any 2 devices, queued until they are free (0 free now)" in c.value for c in at.caption)
    at.button(key="tr_submit").click().run()
    assert not at.exception
    queued = [j for j in list_jobs(get_engine()) if j.id != job_id]
    assert [(j.state, j.gpus, j.gpu_ids_json) for j in queued] == [("PENDING", 2, None)]
    assert at.success[0].value.startswith(f"Job {queued[0].id} (")
    assert "2 devices) is in the queue: PENDING, waiting for the next scheduling pass" in at.success[0].value


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
@pytest.mark.parametrize("change, field_message", [
    ({"tr_width_by": "d_sae", "tr_d_sae": 16, "tr_k": 32}, "k = 32 is more than d_sae = 16"),
    ({"tr_lr": "0"}, "must be positive, got 0.0"),
    ({"tr_lr": "fast"}, "'fast' is not a number"),
    ({"tr_steps": 0}, "must be positive, got 0"),
    ({"tr_grad_accum": 0}, "must be positive, got 0"),
    ({"tr_time": "soon"}, "'soon' is not a time limit"),
])
def test_an_invalid_value_shows_its_message_at_the_field_and_submits_nothing(change, field_message):
    at = train_page()
    for key, value in change.items():
        if key == "tr_width_by":
            at.segmented_control(key=key).set_value(value).run()
        elif key in ("tr_lr", "tr_time"):
            at.text_input(key=key).set_value(value)
        else:
            at.number_input(key=key).set_value(value)
    at.run()
    assert not at.exception
    assert [m for m in field_errors(at) if field_message in m], field_errors(at)
    assert at.button(key="tr_submit").disabled
    assert list_jobs(get_engine()) == []


def test_the_error_sits_right_above_the_field_it_names():
    """Above it, not under it: under it, the next field's help tooltip covered it when Tab moved
    the focus on (the end-to-end test measures that in Chromium)."""
    at = train_page()
    at.text_input(key="tr_lr").set_value("0").run()
    form = [c for c in at.columns if c.text_input or c.number_input or c.segmented_control]
    assert len(form) == 3  # model / data and optimisation / job
    assert [[e.value for e in c.error] for c in form] == [[], ["must be positive, got 0.0"], []]
    column = form[1]
    lr_at = next(i for i, node in enumerate(column.children.values()) if getattr(node, "key", None) == "tr_lr")
    above = list(column.children.values())[lr_at - 1]  # the slot right above the learning rate
    assert above.type == "error" and above.value == "must be positive, got 0.0"


def test_devices_short_of_memory_are_marked_and_not_recommended():
    at = train_page()
    at.number_input(key="tr_batch").set_value(10_000_000).run()  # ~800 GB of activations per device
    assert not at.exception
    assert sum("low memory" in m.value for m in at.markdown) == 4
    assert ticked(at) == []
    assert at.warning and "Fewer than 2 devices fit now" in at.warning[0].proto.title
    device(at, "virtual-0").check().run()  # still allowed by hand: the estimate may be pessimistic
    assert summary(at) == "Selected: 1 GPUs | Effective batch size: 10000000"


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_shards_source_reads_d_in_from_the_shards(tmp_path):
    write_shards(tmp_path / "acts", [torch.randn(64, 48), torch.randn(32, 48)])
    at = train_page()
    at.segmented_control(key="tr_source").set_value("shards").run()
    assert not at.exception
    assert any("directory of the activation shards" in e for e in field_errors(at))
    at.text_input(key="tr_shards_path").set_value(str(tmp_path / "nowhere")).run()
    assert any("does not exist" in e for e in field_errors(at))
    at.text_input(key="tr_shards_path").set_value(str(tmp_path / "acts")).run()
    assert not at.error
    assert [n.value for n in at.number_input if n.label == "d_in (from the shards)"] == [48]
    pick(at, ["virtual-0"]).button(key="tr_submit").click().run()
    config = json.loads(list_jobs(get_engine())[0].train_config_json)
    assert (config["source"], config["shards_path"], config["d_in"]) == ("shards", str(tmp_path / "acts"), 48)


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_one_click_queues_one_job_and_the_same_form_needs_a_confirmation():
    at = train_page()
    at.button(key="tr_submit").click().run()
    (job,) = list_jobs(get_engine())
    links = {link.value: link.proto for link in at.page_link}
    assert links[f"Monitor job {job.id}"].query_string == f"job={job.id}"
    assert links[f"Job {job.id} in the queue"].page == "Queue"
    # The form is the same (with a daemon the next free devices would be ticked: the same count):
    # no second job by one more click.
    assert len(ticked(at)) == 2
    assert at.button(key="tr_submit").disabled
    assert any(f"Job {job.id} was just queued from this form" in c.value for c in at.caption)
    at.button(key="tr_again_button").click().run()  # asked for: allowed once
    assert not at.button(key="tr_submit").disabled
    at.button(key="tr_submit").click().run()
    assert len(list_jobs(get_engine())) == 2 and at.button(key="tr_submit").disabled
    at.number_input(key="tr_steps").set_value(500).run()  # a changed form is a new job
    assert not at.button(key="tr_submit").disabled


@pytest.mark.parametrize("wanted, message", [
    (0, "GPUs wanted: at least 1 device is needed (0 given)"),
    (9, "GPUs wanted: this machine has 4 devices (9 given)"),
])
def test_gpus_wanted_out_of_range_says_why_in_words(wanted, message):
    at = train_page()
    at.number_input(key="tr_n_gpus").set_value(wanted).run()
    assert not at.exception
    assert message in field_errors(at)
    assert at.button(key="tr_submit").disabled


def test_the_architecture_choice_has_the_page_width():
    at = train_page()
    control = at.segmented_control(key="tr_architecture")
    assert list(control.options) == ["topk", "batchtopk", "matryoshka", "standard", "jumprelu"]
    in_columns = [c for c in at.columns if c.segmented_control and
                  any(getattr(w, "key", None) == "tr_architecture" for w in c.segmented_control)]
    assert not in_columns  # not squeezed into a third of the page, where "jumprelu" was cut


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_a_sweep_shows_its_saes_and_memory_per_device_then_queues_one_job():
    at = train_page()
    at.toggle(key="tr_sweep").set_value(True).run()
    assert [e.value for e in at.error] == ["list values in at least one field (e.g. 16, 32, 64 in k), or turn "
                                           "the sweep off"]
    assert at.button(key="tr_submit").disabled
    at.text_input(key="tr_sw_k").set_value("4, 8")
    at.text_input(key="tr_sw_expansion_factor").set_value("2, 4")
    at.multiselect(key="tr_sw_architecture").set_value(["topk", "batchtopk"]).run()
    assert not at.exception and not at.error
    (saes,) = [m.value for m in at.markdown if "SAEs in one job" in m.value]
    assert saes.startswith("**8 SAEs in one job:** `topk-k4-x2`, `topk-k4-x4`")
    plan = at.dataframe[0].value  # the 2 preselected virtual devices, 4 SAEs each
    assert list(plan["Device"]) == ["virtual GPU 0", "virtual GPU 1"] and set(plan["Capacity"]) == {"unknown (virtual)"}
    assert all(text.endswith("MiB") for text in plan["Estimated memory"])
    assert any("capacity unknown" in c.value for c in at.caption)
    at.text_input(key="tr_name").set_value("grid").run()
    at.button(key="tr_submit").click().run()
    (job,) = list_jobs(get_engine())
    config = json.loads(job.train_config_json)
    assert (job.name, job.gpus, config["sweep"]) == ("grid", 2, {
        "architecture": ["topk", "batchtopk"], "k": [4, 8], "expansion_factor": [2, 4]})
    assert at.success[0].value.startswith(f"Job {job.id} (grid, 8 SAEs, 2 devices) is in the queue: PENDING")
    assert sum(link.proto.page == "Sweeps" for link in at.page_link) == 2  # the sidebar's, and the sweep's


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_each_bad_sweep_field_has_its_own_error_and_nothing_is_queued():
    at = train_page()
    at.toggle(key="tr_sweep").set_value(True).run()
    at.text_input(key="tr_sw_k").set_value("4, x")
    at.text_input(key="tr_sw_lr").set_value("1e-3, -1").run()
    assert sorted(e.value for e in at.error) == ["'x' is not a whole number",
                                                 "point 2 (lr=-1.0): lr: must be positive, got -1.0"]
    at.text_input(key="tr_sw_k").set_value("4, 4000").run()  # each field checked alone: the width is 256
    assert "point 2 (k=4000): k: k = 4000 is more than d_sae = 256" in [e.value for e in at.error]
    assert at.button(key="tr_submit").disabled and list_jobs(get_engine()) == []


def test_the_sweep_plan_names_what_does_not_fit_a_known_capacity():
    from sae_dist.analytics.train_form import form_sweep, sweep_plan

    values = {"architecture": "topk", "source": "synthetic", "d_in": 64, "expansion_factor": 4, "batch_size": 256}
    sweep, lists, errors = form_sweep(values, {"k": "4, 8", "lr": ""}, [])
    assert (lists, errors, sweep.names) == ({"k": [4, 8]}, {}, ["k4", "k8"])
    roomy = sweep_plan(sweep, [("GPU 0", 80 * 2**30)], "cuda")
    assert (roomy["error"] is None and roomy["rows"][0]["Capacity"] == "80.0 GiB"
            and roomy["rows"][0]["SAEs"] == "k4, k8")
    tight = sweep_plan(sweep, [("GPU 0", 2**20)], "cuda")
    assert tight["rows"] == [] and tight["error"].startswith("the sweep does not fit the job's 1 device: "
                                                             "2 of its 2 SAEs")
    assert sweep_plan(sweep, [], "cuda")["rows"] == []  # no device chosen: names only
    assert form_sweep({**values, "steps": 0}, {"k": "4, 8"}, []) == (None, {"k": [4, 8]}, {})  # steps says why


def test_matryoshka_shows_its_prefix_widths_checked_above_the_field():
    """Matryoshka keeps k and adds its prefixes' widths: blank is the default, a wrong list is
    the trainer's own message above the field, and nothing can be submitted meanwhile."""
    at = train_page()
    assert "tr_matryoshka_widths" not in [w.key for w in at.text_input]  # drawn only for matryoshka
    at.segmented_control(key="tr_architecture").set_value("matryoshka").run()
    assert not at.exception and not field_errors(at)
    assert at.number_input(key="tr_k").value == 8  # still a k, on average over the batch
    at.text_input(key="tr_matryoshka_widths").set_value("16,64").run()
    assert field_errors(at) == ["the last width is the whole dictionary: 64 given, d_sae is 256"]
    assert at.button(key="tr_submit").disabled
    at.text_input(key="tr_matryoshka_widths").set_value("16,64,256").run()
    assert not field_errors(at) and not at.button(key="tr_submit").disabled
    selection = at.segmented_control(key="tr_matryoshka_selection")
    assert selection.value == "sample" and list(selection.options) == ["sample", "batch"]
    selection.set_value("batch").run()
    assert not at.exception and not field_errors(at)
    weight = at.number_input(key="tr_matryoshka_inner_weight")
    assert weight.value == 1.0  # the paper's, the default: not written into the job's settings
    weight.set_value(0.5).run()
    assert not at.exception and not field_errors(at) and not at.button(key="tr_submit").disabled


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_the_inner_weights_schedule_is_typed_checked_and_queued():
    """Matryoshka's inner weight on a schedule: blank fields are the defaults (said in the
    resolved line), a word or a value out of range is one error above its field and blocks the
    submit, and typed values reach the queued job's settings and the resolved line."""
    at = train_page()
    at.segmented_control(key="tr_architecture").set_value("matryoshka").run()
    start = at.text_input(key="tr_matryoshka_inner_weight_start")
    assert start.value == at.text_input(key="tr_matryoshka_inner_weight_until").value == ""
    assert "inner weight 8 falling to 1 by 60% of the steps (default)" in optimisation(at)
    start.set_value("eight").run()
    assert field_errors(at) == ["'eight' is not a number; write e.g. 8, or leave it blank for the default"]
    assert at.button(key="tr_submit").disabled
    at.text_input(key="tr_matryoshka_inner_weight_start").set_value("4").run()
    at.text_input(key="tr_matryoshka_inner_weight_until").set_value("1.5").run()
    assert field_errors(at) == ["must be above 0 and at most 1 (a fraction of the steps), got 1.5"]
    assert at.button(key="tr_submit").disabled
    at.text_input(key="tr_matryoshka_inner_weight_until").set_value("0.8").run()
    assert not field_errors(at) and "inner weight 4 falling to 1 by 80% of the steps," in optimisation(at)
    pick(at, ["virtual-0"]).button(key="tr_submit").click().run()
    assert not at.exception
    config = json.loads(list_jobs(get_engine())[0].train_config_json)
    assert (config["matryoshka_inner_weight_start"], config["matryoshka_inner_weight_until"]) == (4.0, 0.8)


@pytest.mark.slow  # 1 s or more (AppTest runs of the page)
def test_paired_shards_queue_a_transcoder(tmp_path):
    """A transcoder's paired shards (harvest --transcode, pair-shards) make the form a transcoder's:
    d_in is the input's width, the pair is said, TopK is refused with the trainer's own line (SAELens
    has no TopK transcoder), and BatchTopK with a skip path queues."""
    write_shards(tmp_path / "pairs", [torch.randn(64, 96)], {"pair": ["mlp_in", "mlp_out"]})
    at = train_page()
    at.segmented_control(key="tr_source").set_value("shards").run()
    at.text_input(key="tr_shards_path").set_value(str(tmp_path / "pairs")).run()
    assert [n.value for n in at.number_input if n.label == "d_in (from the shards)"] == [48]
    assert any("pair mlp_in with mlp_out" in c.value for c in at.caption)
    assert any("a topk transcoder (each sample's top k) has no SAELens class" in e for e in field_errors(at))
    assert at.button(key="tr_submit").disabled
    at.segmented_control(key="tr_architecture").set_value("batchtopk").run()
    at.toggle(key="tr_skip").set_value(True).run()
    assert not field_errors(at)
    pick(at, ["virtual-0"]).button(key="tr_submit").click().run()
    config = json.loads(list_jobs(get_engine())[0].train_config_json)
    assert (config["transcode"], config["skip"], config["d_in"]) == ("mlp_in:mlp_out", True, 48)
