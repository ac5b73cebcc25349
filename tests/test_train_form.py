"""The Train page's pure decisions: first values for the devices, GPUs wanted, repeat submits."""

from __future__ import annotations

from sae_dist.analytics import train_form

TRAINER = {"tr_d_in": 512, "tr_batch": 4096, "tr_steps": 1000, "tr_name": ""}


def test_virtual_devices_start_small_and_real_gpus_keep_the_trainers_defaults():
    small = train_form.first_values(TRAINER, all_virtual=True)
    assert (small["tr_d_in"], small["tr_batch"], small["tr_steps"]) == (64, 256, 1500)
    assert small["tr_name"] == ""
    assert train_form.first_values(TRAINER, all_virtual=False) == TRAINER


def test_devices_wanted_at_first():
    assert train_form.devices_wanted(8, all_virtual=False) == 8  # every idle GPU
    assert train_form.devices_wanted(4, all_virtual=True) == 2
    assert train_form.devices_wanted(1, all_virtual=True) == 1
    assert train_form.devices_wanted(0, all_virtual=False) == 1


def test_wanted_error_in_words():
    assert train_form.wanted_error(0, 4) == "at least 1 device is needed (0 given)"
    assert train_form.wanted_error(5, 4) == "this machine has 4 devices (5 given)"
    assert train_form.wanted_error(2, 1) == "this machine has 1 device (2 given)"
    assert train_form.wanted_error(None, 4).startswith("give how many")
    assert train_form.wanted_error(1, 0) is None and train_form.wanted_error(4, 4) is None


def test_a_repeat_is_the_same_config_priority_limit_and_count_whatever_the_name_and_devices():
    a = train_form.fingerprint({"steps": 100, "name": None}, 0, None, 2)
    assert a == train_form.fingerprint({"name": "x", "steps": 100}, 0, None, 2)
    assert a != train_form.fingerprint({"steps": 200, "name": None}, 0, None, 2)
    assert a != train_form.fingerprint({"steps": 100}, 1, None, 2)
    assert a != train_form.fingerprint({"steps": 100}, 0, 60.0, 2)
    assert a != train_form.fingerprint({"steps": 100}, 0, None, 1)
    assert train_form.repeats_last(a, a, confirmed=False)
    assert not train_form.repeats_last(a, a, confirmed=True)
    assert not train_form.repeats_last(a, None, confirmed=False)
    assert not train_form.repeats_last(None, None, confirmed=False)


FIELDS = {"architecture": "topk", "source": "synthetic", "batch_size": 256, "grad_accum": 1, "steps": 100,
          "precision": "auto", "checkpoint_every": 50, "balance": "equal", "rebalance": True,
          "on_rank_loss": "continue", "d_in": 64, "shards_path": None, "width_by": "expansion",
          "expansion_factor": 4, "d_sae": None, "k": 8, "l1_coefficient": None, "l0_coefficient": None,
          "lr_text": "", "name": ""}


def test_the_form_s_fields_make_the_trainer_s_config():
    config, sweep, lists, errors = train_form.form_config(FIELDS, None, [])
    assert errors == {} and sweep is None and lists == {}
    assert (config.d_in, config.expansion_factor, config.k, config.steps, config.lr, config.name) == \
        (64, 4, 8, 100, None, None)  # a blank learning rate and name: the defaults
    config, *_ = train_form.form_config({**FIELDS, "width_by": "d_sae", "d_sae": 512, "architecture": "standard",
                                         "l1_coefficient": 0.5, "lr_text": " 3e-4 ", "name": " run-a "}, None, [])
    assert (config.d_sae, config.architecture, config.l1_coefficient, config.lr, config.name) == \
        (512, "standard", 0.5, 3e-4, "run-a")


def test_matryoshka_s_inner_weight_is_set_only_off_its_default():
    mat = {**FIELDS, "architecture": "matryoshka", "matryoshka_inner_weight": 1.0}
    config, *_ = train_form.form_config(mat, None, [])
    assert config.matryoshka_inner_weight is None  # the default, left unset as the CLI leaves it
    config, *_ = train_form.form_config({**mat, "matryoshka_inner_weight": 0.5}, None, [])
    assert config.matryoshka_inner_weight == 0.5


def test_the_inner_weights_schedule_is_read_as_typed_for_matryoshka_only():
    mat = {**FIELDS, "architecture": "matryoshka", "matryoshka_inner_weight_start": " ",
           "matryoshka_inner_weight_until": ""}
    config, *_ = train_form.form_config(mat, None, [])
    assert (config.matryoshka_inner_weight_start, config.matryoshka_inner_weight_until) == (None, None)  # blank
    typed = {**mat, "matryoshka_inner_weight_start": "16", "matryoshka_inner_weight_until": " 0.8 "}
    config, *_ = train_form.form_config(typed, None, [])
    assert (config.matryoshka_inner_weight_start, config.matryoshka_inner_weight_until) == (16.0, 0.8)
    _, _, _, errors = train_form.form_config({**typed, "matryoshka_inner_weight_until": "late"}, None, [])
    assert errors == {"matryoshka_inner_weight_until": "'late' is not a number; write e.g. 0.8, or leave it "
                                                       "blank for the default"}
    config, _, _, errors = train_form.form_config({**typed, "architecture": "topk"}, None, [])  # not drawn there
    assert not errors and config.matryoshka_inner_weight_start is None


def test_each_bad_field_has_its_message_under_it():
    _, _, _, errors = train_form.form_config({**FIELDS, "lr_text": "fast"}, None, [])
    assert errors == {"lr": "'fast' is not a number; write e.g. 2e-4, or leave it blank for the default"}
    config, _, _, errors = train_form.form_config({**FIELDS, "k": 0}, None, [])
    assert config is None and list(errors) == ["k"]


def test_a_swept_setting_leaves_the_base_config_and_the_sweep_sets_it():
    config, sweep, lists, errors = train_form.form_config(FIELDS, {"k": "4, 8", "lr": ""}, [])
    assert errors == {} and lists == {"k": [4, 8]} and sweep.names == ["k4", "k8"]
    from sae_dist.config import config_fields

    # The form's k left the base config (the sweep sets it): the base holds the trainer's default.
    assert config.k == next(f.default for f in config_fields() if f.name == "k") != FIELDS["k"]
    _, sweep, _, errors = train_form.form_config(FIELDS, {"k": "4, x"}, [])
    assert sweep is None and list(errors) == ["sweep_k"]
