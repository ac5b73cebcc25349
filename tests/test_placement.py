"""Placement of a sweep's SAEs on a job's devices (sae_dist.sweeps.placement) on plain data: DDP groups
when devices outnumber SAEs, several SAEs per device otherwise, one error for a sweep that does
not fit (which SAEs, on which device, by how much), and the plan as printed and stored."""

from __future__ import annotations

import json

import pytest

from sae_dist.contract.sweep import build_sweep
from sae_dist.errors import UserError
from sae_dist.memory import MemoryEstimate
from sae_dist.sweeps.placement import (
    Device,
    PlacementError,
    SaeNeed,
    device_bytes,
    needs_for,
    place,
)

MIB = 2**20
GIB = 2**30
RUNTIME = 500 * MIB


def estimate(kept_mib: float, temporaries_mib: float, buckets_mib: float = 0) -> MemoryEstimate:
    """An estimate with `kept_mib` of weights, gradients and Adam states and `temporaries_mib` of
    step temporaries, on a device whose runtime takes RUNTIME."""
    kept = int(kept_mib * MIB)
    return MemoryEstimate(params=kept // 4, grads=kept // 4, optimizer=kept - 2 * (kept // 4),
                          ddp_buckets=int(buckets_mib * MIB), activations=int(temporaries_mib * MIB),
                          heap=0, runtime=RUNTIME)


def need(name: str, kept_mib: float, temporaries_mib: float = 100) -> SaeNeed:
    return SaeNeed(name, estimate(kept_mib, temporaries_mib), estimate(kept_mib, temporaries_mib, 25))


def devices(count: int, capacity: int | None = 80 * GIB) -> list[Device]:
    return [Device(f"cuda:{i}", capacity) for i in range(count)]


def test_a_device_holds_its_runtime_once_every_sae_kept_and_the_largest_step():
    a, b = estimate(1000, 300), estimate(200, 700)
    assert device_bytes([a]) == a.total
    assert device_bytes([a, b]) == RUNTIME + 1200 * MIB + 700 * MIB
    assert device_bytes([]) == 0


@pytest.mark.parametrize("saes, count, sizes", [
    (1, 1, [1]),
    (1, 4, [4]),
    (2, 4, [2, 2]),
    (3, 3, [1, 1, 1]),
    (3, 8, [3, 3, 2]),  # the two heaviest (the first two here) get the extra devices
    (4, 6, [2, 2, 1, 1]),
    (5, 16, [4, 3, 3, 3, 3]),
])
def test_more_devices_than_saes_gives_each_a_ddp_group(saes, count, sizes):
    needs = [need(f"s{i}", 1000 - i) for i in range(saes)]  # s0 the heaviest
    plan = place(needs, devices(count))
    assert plan.mode == "groups"
    assert [len(s.devices) for s in plan.saes] == sizes
    assert [s.name for s in plan.saes] == [n.name for n in needs]  # the sweep's order
    used = [d for s in plan.saes for d in s.devices]
    assert sorted(used) == sorted(d.name for d in devices(count))  # every device, once
    for slot in plan.saes:  # each group is contiguous in device order
        ids = [int(d.split(":")[1]) for d in slot.devices]
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        group_need = next(n for n in needs if n.name == slot.name)
        assert slot.bytes_per_device == (group_need.alone if len(ids) == 1 else group_need.in_group).total
    assert [d.device for d in plan.devices] == [d.name for d in devices(count)]


def test_the_extra_devices_go_to_the_heaviest_saes():
    plan = place([need("small", 100), need("big", 5000), need("mid", 1000)], devices(5))
    assert {s.name: len(s.devices) for s in plan.saes} == {"small": 1, "big": 2, "mid": 2}
    assert "the extra devices go to the SAEs with the most to compute" in plan.reason
    assert plan.group_of("big") == ("cuda:0", "cuda:1")


@pytest.mark.parametrize("sizes_mib, count, expected", [
    # largest first, each onto an empty device, then onto the one with the most room
    ([4000, 3000, 2000, 1000], 2, [["a", "d"], ["b", "c"]]),
    ([1000] * 5, 2, [["a", "c", "e"], ["b", "d"]]),
    ([5000, 100, 100, 100, 100], 2, [["a"], ["b", "c", "d", "e"]]),
    ([1000, 1000, 1000, 1000, 1000, 1000, 1000], 3, [["a", "d", "g"], ["b", "e"], ["c", "f"]]),
])
def test_more_saes_than_devices_shares_the_devices_and_balances_memory(sizes_mib, count, expected):
    names = "abcdefg"
    needs = [need(names[i], size) for i, size in enumerate(sizes_mib)]
    plan = place(needs, devices(count))
    assert plan.mode == "shared"
    assert [list(d.saes) for d in plan.devices] == expected
    assert all(d.saes for d in plan.devices)  # every device used
    by_name = {n.name: n for n in needs}
    for d in plan.devices:
        assert d.bytes == device_bytes([by_name[s].alone for s in d.saes])
    assert all(len(s.devices) == 1 and s.bytes_per_device == by_name[s.name].alone.total for s in plan.saes)


def test_every_device_is_used_even_when_a_bigger_one_has_more_room():
    plan = place([need("a", 1000), need("b", 900), need("c", 800)],
                 [Device("cuda:0", 80 * GIB), Device("cuda:1", 8 * GIB)])
    assert [list(d.saes) for d in plan.devices] == [["a", "c"], ["b"]]


def test_unknown_capacities_are_placed_unchecked_and_said_so():
    plan = place([need(f"s{i}", 50_000) for i in range(3)], devices(2, capacity=None))
    assert [len(d.saes) for d in plan.devices] == [2, 1]
    assert "memory not checked on cuda:0, cuda:1 (capacity unknown)" in plan.reason
    assert "capacity unknown: not checked" in plan.devices[0].reason
    # A device of unknown size takes what a known one cannot hold.
    mixed = place([need("big", 9000), need("x", 100), need("y", 100)],
                  [Device("cuda:0", 4 * GIB), Device("cuda:1", None)])
    assert mixed.group_of("big") == ("cuda:1",)


def test_an_sae_too_big_for_its_group_names_it_its_device_and_the_overflow():
    with pytest.raises(PlacementError) as e:
        place([need("k32-x64", 9000), need("k32-x8", 100)], devices(2, capacity=8 * GIB))
    text = str(e.value)
    big = need("k32-x64", 9000).alone.total
    assert "1 of its 2 SAEs has no room" in text
    over = (big - 8 * GIB) / GIB
    assert f"k32-x64 on cuda:0 alone needs {big / GIB:.1f} GiB of its 8.0 GiB: {over:.1f} GiB over" in text
    assert "k32-x8" not in text.split("(")[1]  # only the SAE that does not fit is named
    with pytest.raises(PlacementError, match="as one of its 2 DDP ranks needs"):
        place([need("big", 9000)], devices(2, capacity=8 * GIB))


def test_saes_that_cannot_share_the_devices_are_each_named():
    needs = [need("a", 3000), need("b", 3000), need("c", 3000), need("d", 3000)]
    with pytest.raises(PlacementError) as e:
        place(needs, devices(2, capacity=6 * GIB))  # one per device fits (3.5 GiB), two need 6.4 GiB
    text = str(e.value)
    assert "the sweep does not fit the job's 2 devices: 2 of its 4 SAEs have no room" in text
    assert "c on cuda:0 beside a needs" in text and "d on cuda:0 beside a needs" in text  # the least over
    assert "needs 6.4 GiB of its 6.0 GiB: 456.0 MiB over" in text and "sweep fewer or smaller SAEs" in text
    assert isinstance(e.value, UserError)  # the CLI prints it as one line, exit code 2


def test_the_plan_as_printed_and_stored():
    plan = place([need("k16", 1000), need("k32", 2000), need("k64", 500)], devices(2, capacity=16 * GIB))
    lines = plan.lines()
    assert lines[0] == plan.reason and lines[0].startswith("3 SAEs on 2 devices: several per device")
    assert lines[1].startswith("  cuda:0: k32, alone: ") and "of 16.0 GiB estimated" in lines[1]
    assert lines[2].startswith("  cuda:1: k16, k64 (2 SAEs, one after another): ")
    stored = json.loads(json.dumps(plan.to_dict()))
    assert stored["mode"] == "shared" and stored["saes"][0] == {
        "name": "k16", "devices": ["cuda:1"], "bytes_per_device": need("k16", 1000).alone.total}
    assert [d["saes"] for d in stored["devices"]] == [["k32"], ["k16", "k64"]]
    one = place([need("only", 10)], devices(1))
    assert one.reason == "1 SAE on 1 device: one device each" and one.lines()[1].startswith("  cuda:0: only, alone")


@pytest.mark.parametrize("needs, devs, words", [
    ([], devices(1), "no SAE to place"),
    ([need("a", 1)], [], "no device"),
    ([need("a", 1), need("a", 2)], devices(2), "two SAEs share a name"),
])
def test_nothing_to_place(needs, devs, words):
    with pytest.raises(UserError, match=words):
        place(needs, devs)


def test_a_real_sweep_from_its_configs():
    """The needs of a sweep's points come from sae_dist.memory's estimate, for one device and
    for a DDP rank; a wider SAE needs more."""
    sweep = build_sweep({"d_in": 768, "batch_size": 4096}, {"k": [32], "expansion_factor": [8, 32]})
    needs = needs_for([(p.name, p.config) for p in sweep.points], "cuda")
    assert [n.name for n in needs] == ["k32-x8", "k32-x32"]
    assert needs[1].alone.total > needs[0].alone.total
    assert all(n.in_group.ddp_buckets > 0 == n.alone.ddp_buckets for n in needs)
    plan = place(needs, devices(1, capacity=80 * GIB))
    assert plan.devices[0].saes == ("k32-x32", "k32-x8")
    assert plan.devices[0].bytes < needs[0].alone.total + needs[1].alone.total  # one runtime, one step's peak


def test_the_model_source_s_memory_is_on_every_device_and_its_parts_are_said(tmp_path):
    """A model-source sweep: the model runs on every device (its weights, a forward pass, the fill)."""
    import numpy as np
    from safetensors.numpy import save_file

    from sae_dist.data.source_memory import estimate_source_memory, safetensors_bytes

    # forward: 4 B x (2 x 8 tokens x (6 x 4 + 2 x 16 + 3 x 4) + 2 x 2 contexts x 2 heads x 8^2);
    # fill: 4 copies x 10 rows x 3 sites x d_in 4 x 4 B.
    source = estimate_source_memory(1000, hidden=4, heads=2, intermediate=16, context_length=8, read_batch=2,
                                    fill_rows=10, n_sites=3, d_in=4)
    assert (source.weights, source.forward, source.fill, source.total) == (1000, 6400, 1920, 9320)
    big = estimate_source_memory(3 * GIB, 2048, 16, 8192, 128, 32, 65536, 2, 2048)
    plan = place([need("a", 1000), need("b", 500), need("c", 200)], devices(2), big)
    assert all(d.bytes == device_bytes([need(n, kept).alone for n, kept in held], big.total)
               for d, held in zip(plan.devices, [[("a", 1000)], [("b", 500), ("c", 200)]]))
    assert [s.bytes_per_device for s in plan.saes] == [need("a", 1000).alone.total, need("b", 500).alone.total,
                                                         need("c", 200).alone.total]  # each SAE's own
    assert plan.reason.endswith("; the model source runs on every device: 7.6 GiB estimated (weights 3.0 GiB, "
                                "forward pass of 32 contexts x 128 tokens 576.0 MiB, fill 4 x 65,536 rows x 2 sites "
                                "4.0 GiB)"), plan.reason
    assert "and the model source (7.6 GiB)" in plan.lines()[1]
    groups = place([need("a", 1000)], devices(2), big)  # a DDP group: the source on both of its devices
    assert [d.bytes for d in groups.devices] == [need("a", 1000).in_group.total + big.total] * 2
    # The SAE fits the device alone, not beside the model: one error that says so.
    with pytest.raises(PlacementError, match=r"a on cuda:0 alone, and the model source \(7.6 GiB\) "
                                             r"needs 9.1 GiB of its 8.0 GiB: 1.1 GiB over"):
        place([need("a", 1000)], devices(1, 8 * GIB), big)
    unknown = estimate_source_memory(None, 4, 2, 16, 8, 2, 10, 1, 4)
    assert "weights unknown" in unknown.describe() and unknown.total == 5888 + 640  # the forward pass and fill
    save_file({"w": np.zeros((3, 5), np.float16), "b": np.zeros(7, np.float32)}, str(tmp_path / "model.safetensors"))
    assert safetensors_bytes(tmp_path) == 3 * 5 * 2 + 7 * 4 and safetensors_bytes(tmp_path / "none") is None


@pytest.mark.parametrize("saes, count", [(1, 2), (2, 2), (3, 2), (2, 4)])
def test_everywhere_puts_every_sae_on_every_device(saes, count):
    """--balance speed|memory: each SAE a DDP group of all the devices, each device holding them
    all (their in-group estimates, runtime once, the largest step's temporaries)."""
    needs = [need(f"s{i}", 1000 + 100 * i) for i in range(saes)]
    plan = place(needs, devices(count), everywhere=True)
    assert plan.mode == "everywhere"
    assert all(slot.devices == tuple(f"cuda:{i}" for i in range(count)) for slot in plan.saes)
    assert {d.bytes for d in plan.devices} == {device_bytes([n.in_group for n in needs])}
    assert all(d.saes == tuple(n.name for n in needs) for d in plan.devices)
    assert "every SAE on every device" in plan.reason and "--balance" in plan.reason


def test_everywhere_on_one_device_is_the_plain_plan():
    assert place([need("a", 100), need("b", 100)], devices(1), everywhere=True).mode == "shared"


def test_everywhere_that_does_not_fit_names_each_device_and_the_way_out():
    with pytest.raises(PlacementError) as e:
        place([need("a", 30_000), need("b", 30_000)], [Device("cuda:0", 80 * GIB), Device("cuda:1", 40 * GIB)],
              everywhere=True)
    text = str(e.value)
    assert "every SAE of the sweep trains on every device" in text and "cuda:1 has 40.0 GiB" in text
    assert "cuda:0" not in text.split("on each:")[1] and "--balance equal" in text
