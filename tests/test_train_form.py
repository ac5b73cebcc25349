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
