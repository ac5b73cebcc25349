"""A sweep's definition (sae_dist.contract.sweep) on plain data: the grid's product and explicit points,
--sweep flags read as their settings' types, names, and one clear error for each bad input."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from conftest import REPO
from sae_dist.cli import _parser
from sae_dist.config import TrainConfig, load_toml
from sae_dist.contract import config_from_args, train_argv
from sae_dist.contract.sweep import (
    MAX_SAES,
    SWEEPABLE,
    build_sweep,
    parse_sweep_flags,
    point_name,
    split_sweep,
    unique_names,
)
from sae_dist.data.harvest.sites import check_trainable, model_sites
from sae_dist.errors import ConfigError, UserError


def _sweep(base=None, table=None, flags=None):
    return build_sweep(base or {}, table, parse_sweep_flags(flags) if flags else None)


def _error(base=None, table=None, flags=None) -> str:
    with pytest.raises(ConfigError) as e:
        _sweep(base, table, flags)
    assert e.value.field == "sweep" and isinstance(e.value, UserError)  # the CLI prints it as one line
    return str(e.value)


def test_a_grid_is_the_product_of_its_lists_in_the_order_given():
    sweep = _sweep({"steps": 10}, {"k": [16, 32, 64], "expansion_factor": [8, 16]})
    assert sweep.keys == ("k", "expansion_factor")
    assert sweep.names == ["k16-x8", "k16-x16", "k32-x8", "k32-x16", "k64-x8", "k64-x16"]
    assert [(p.config.k, p.config.expansion_factor, p.config.steps) for p in sweep.points] == [
        (16, 8, 10), (16, 16, 10), (32, 8, 10), (32, 16, 10), (64, 8, 10), (64, 16, 10)]
    assert sweep.points[3].settings == {"k": 32, "expansion_factor": 16}
    assert all(isinstance(p.config, TrainConfig) for p in sweep.points)
    # The same lists written the other way round: the other order, the same SAEs.
    other = _sweep({"steps": 10}, {"expansion_factor": [8, 16], "k": [16, 32, 64]})
    assert other.names[:3] == ["x8-k16", "x8-k32", "x8-k64"]
    assert {p.config.to_dict()["k"] for p in other.points} == {16, 32, 64}


def test_explicit_points_and_a_toml_file(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text('steps = 20\n[sweep]\narchitecture = ["topk", "batchtopk"]\nk = [32]\n')
    plain, table = split_sweep(load_toml(grid))
    assert plain == {"steps": 20}
    assert _sweep(plain, table).names == ["topk-k32", "batchtopk-k32"]
    points = tmp_path / "points.toml"
    points.write_text('[train]\nsteps = 20\n\n[[sweep.points]]\nk = 16\nexpansion_factor = 8\n\n'
                      '[[sweep.points]]\nlr = 3e-4\n\n[[sweep.points]]\narchitecture = "relu"\nl1_coefficient = 0.1\n')
    plain, table = split_sweep(load_toml(points))
    sweep = _sweep(plain, table)
    assert sweep.names == ["k16-x8", "lr3e-4", "standard-l1c0.1"]  # "relu" is standard's alias
    assert sweep.keys == ("k", "expansion_factor", "lr", "architecture", "l1_coefficient")
    assert sweep.points[1].config.k == 32 and sweep.points[1].config.lr == 3e-4  # unset keys keep the base's
    assert split_sweep({"k": 4}) == ({"k": 4}, None) and _sweep({"k": 4}) is None  # no sweep at all


@pytest.mark.parametrize("flags, expected", [
    (["k=16,32"], {"k": [16, 32]}),
    (["lr=3e-4, 1e-3", "architecture=topk,jumprelu"], {"lr": [3e-4, 1e-3], "architecture": ["topk", "jumprelu"]}),
    (["expansion-factor=8,16"], {"expansion_factor": [8, 16]}),  # the flag spelling of a key
    (["model_layer=0,3", "model_site=resid,mlp_out"], {"model_layer": [0, 3], "model_site": ["resid", "mlp_out"]}),
    (["lr_decay_fraction=0,1"], {"lr_decay_fraction": [0.0, 1.0]}),  # floats stay floats
])
def test_sweep_flags_take_their_settings_types(flags, expected):
    lists = parse_sweep_flags(flags)
    assert lists == expected
    assert [type(v) for vs in lists.values() for v in vs] == [type(v) for vs in expected.values() for v in vs]


def test_flags_add_to_and_replace_the_tomls_lists():
    sweep = _sweep({}, {"k": [16, 32], "lr": [1e-3]}, ["k=64", "expansion_factor=4,8"])
    assert sweep.names == ["k64-lr1e-3-x4", "k64-lr1e-3-x8"]
    assert _sweep({}, None, ["k=8,16"]).names == ["k8", "k16"]


@pytest.mark.parametrize("base, table, flags, words", [
    ({}, {"kk": [1, 2]}, None, "kk: unknown setting; did you mean 'k'?"),
    ({}, {"expansion": [8]}, None, "did you mean 'expansion_factor'?"),
    ({}, None, ["lrr=1e-3"], "--sweep lrr: unknown setting; did you mean 'lr'?"),
    ({}, {"points": [{"archtecture": "topk"}]}, None, "did you mean 'architecture'?"),
    ({}, {"seed": [1, 2]}, None, "seed: the job's own setting"),
    ({}, {"batch_size": [1024]}, None, "batch_size: the job's own setting"),
    ({}, {"k": []}, None, "k = []: an empty list"),
    ({}, None, ["k="], "--sweep k=: an empty value"),
    ({}, None, ["k=16,,32"], "an empty value"),
    ({}, {"k": 16}, None, "k = 16 is one value, not a list; write k = [16]"),
    ({"k": 32}, {"k": [16, 64]}, None, "k is given both as a setting (k = 32) and in the sweep"),
    ({"lr": 1e-3}, None, ["lr=1e-4,1e-3"], "lr is given both as a setting"),
    ({"k": 32}, {"points": [{"k": 16}]}, None, "k is given both"),
    ({}, {"k": [16], "points": [{"k": 32}]}, None, "both lists (k) and [[sweep.points]] given"),
    ({}, {"points": [{"k": 32}]}, ["lr=1e-3"], "cannot be combined with [[sweep.points]]"),
    ({}, {"points": []}, None, "one or more tables"),
    ({}, {"points": [{"k": 8}, {}]}, None, "point 2 of [[sweep.points]] sets nothing"),
    ({}, {"points": [{"k": [8, 16]}]}, None, "one value per point"),
    ({}, {}, None, "lists nothing"),
    ({}, [1, 2], None, "must be a table"),
    ({}, None, ["k"], "write KEY=V1,V2"),
    ({}, None, ["k=16", "k=32"], "--sweep k given twice"),
    ({}, None, ["k=sixteen"], "--sweep k: 'sixteen' is not a whole number"),
    ({}, None, ["lr=fast"], "--sweep lr: 'fast' is not a number"),
])
def test_bad_input_is_one_error_each(base, table, flags, words):
    assert words in _error(base, table, flags)


@pytest.mark.parametrize("table, words", [
    ({"k": [16, 32], "lr": [-1.0, 1e-3]}, "point 1 (k=16, lr=-1.0): lr: must be positive"),
    ({"points": [{"k": 16}, {"k": 0}]}, "point 2 (k=0): k: must be positive"),
    ({"architecture": ["topk", "gated"]}, "point 2 (architecture=gated): architecture: unknown value 'gated'"),
    ({"k": [16, 2.5]}, "point 2 (k=2.5): k: must be a whole number"),
])
def test_a_bad_value_names_its_point(table, words):
    assert words in _error({}, table)


def test_a_point_too_wide_for_the_source_is_named_once_d_in_is_known():
    sweep = _sweep({"d_sae": 64}, {"k": [16, 128]})  # d_in unknown: k > d_sae cannot be seen yet
    with pytest.raises(ConfigError, match=r"sweep: k128 \(k=128\): k: k = 128 is more than d_sae = 64"):
        sweep.with_d_in(16)
    sized = _sweep({}, {"k": [16, 32]}).with_d_in(24)
    assert [p.config.d_in for p in sized.points] == [24, 24] and sized.names == ["k16", "k32"]


@pytest.mark.parametrize("base, table, words", [
    ({}, {"k": [16, 16]}, "point 2 (k=16) trains the same SAE as point 1 (k=16)"),
    ({}, {"points": [{"k": 16, "lr": 1e-3}, {"lr": 1e-3, "k": 16}]}, "trains the same SAE as point 1"),
    ({}, {"architecture": ["standard", "relu"]}, "point 2 (architecture=standard) trains the same SAE"),
    ({}, {"architecture": ["topk", "standard"], "l1_coefficient": [0.01, 0.1]},
     "l1_coefficient is not read by topk; list the points you mean with [[sweep.points]]"),
    ({"architecture": "standard"}, {"k": [16, 32]}, "k is not read by standard"),
    ({}, {"model_layer": [1, 2]}, "model_layer is read by the model source only (source is synthetic)"),
    ({"d_sae": 1024}, {"expansion_factor": [8, 16]}, "expansion_factor gives the same width (d_sae 1024)"),
])
def test_two_points_that_train_the_same_sae_are_an_error(base, table, words):
    assert words in _error(base, table)


def test_the_same_width_spelt_two_ways_is_seen_once_d_in_is_known():
    sweep = _sweep({}, {"points": [{"d_sae": 4096}, {"expansion_factor": 8}]})
    with pytest.raises(ConfigError, match="gives the same width"):
        sweep.with_d_in(512)
    assert len(sweep.with_d_in(256)) == 2  # 256 x 8 = 2048: two widths


def test_at_most_256_saes_and_the_error_says_how_many():
    assert len(_sweep({}, {"k": list(range(1, 17)), "lr": [i * 1e-4 for i in range(1, 17)]})) == MAX_SAES
    words = _error({}, {"k": list(range(1, 18)), "lr": [i * 1e-4 for i in range(1, 17)]})
    assert "272 SAEs (17 k x 16 lr); one job trains at most 256" in words
    huge = _error({}, {key: list(range(1, 11)) for key in ("k", "expansion_factor", "model_layer", "auxk_k")})
    assert "10,000 SAEs" in huge  # counted, never built
    points = _error({}, {"points": [{"k": i} for i in range(1, 258)]})
    assert "257 SAEs ([[sweep.points]])" in points


@pytest.mark.parametrize("settings, name", [
    ({"k": 32, "expansion_factor": 16}, "k32-x16"),
    ({"lr": 3e-4}, "lr3e-4"),
    ({"lr": 0.05}, "lr0.05"),  # a tie: the plain spelling
    ({"lr": 1.0}, "lr1"),
    ({"lr": 1e-6}, "lr1e-6"),
    ({"lr": 2e6}, "lr2e6"),  # never a '+'
    ({"architecture": "topk", "k": 32}, "topk-k32"),
    ({"model_layer": 3, "model_site": "mlp_out"}, "L3-mlp_out"),
    ({"d_sae": 4096, "auxk_coefficient": 0.03125}, "d4096-auxk0.03125"),
    ({"lr_decay_fraction": 0.0, "dead_after_samples": 10_000}, "decay0-dead10000"),
])
def test_names_come_from_the_settings(settings, name):
    assert point_name(settings) == name


def test_names_are_unique_and_safe_for_a_directory():
    assert unique_names(["a", "a", "b", "a"]) == ["a", "a-2", "b", "a-3"]
    assert unique_names(["a", "a", "a-2"]) == ["a", "a-3", "a-2"]  # a suffix never takes a given name
    sweep = _sweep({}, {"lr": [1e-3, 1.0000001e-3, 1.0000002e-3]})  # equal to 6 digits: the names collide
    assert sweep.names == ["lr1e-3", "lr1e-3-2", "lr1e-3-3"]
    model = {"source": "model", "model_path": "/m", "text_path": "/t.txt"}
    every = _sweep(model, {"points": [{key: value} for key, value in (
        ("architecture", "jumprelu"), ("d_sae", 1024), ("lr", 1e-4), ("lr_warmup_steps", 0),
        ("jumprelu_bandwidth", 0.002), ("model_site", "attn_out"))]})
    assert all(n and "/" not in n and not n.startswith((".", "-")) for n in every.names)
    assert set(SWEEPABLE) >= set(every.keys)


@pytest.mark.parametrize("table", [
    {"k": [16, 32], "expansion_factor": [4, 8]},
    {"architecture": ["topk", "jumprelu", "standard"], "lr": [3e-4, 1 / 3]},
    {"points": [{"model_layer": 2, "model_site": "mlp_out"}, {"model_layer": 5, "lr_decay_fraction": 0.5}]},
])
def test_every_point_can_run_as_its_own_job(table):
    """A point's config written as trainer flags and read back by the trainer's own parser is the
    same config: a point can be submitted alone (a job array) with contract.train_argv."""
    base = {"steps": 50, "batch_size": 256, "name": "sweep-a"}
    if "points" in table:
        base.update(source="model", model_path="/m", text_path="/t.txt")
    for point in _sweep(base, table).points:
        argv = train_argv(point.config, "cpu:2")
        back = config_from_args(_parser().parse_args(["train", *argv]))
        assert back == dataclasses.replace(point.config, devices="cpu:2")
        assert train_argv(point.config.to_dict(), "cpu:2") == argv


def test_a_sweep_as_stored():
    sweep = _sweep({}, {"k": [16, 32]})
    assert sweep.to_dict() == {"keys": ["k"], "points": [{"name": "k16", "settings": {"k": 16}},
                                                         {"name": "k32", "settings": {"k": 32}}]}


def test_a_model_sweep_reads_each_distinct_layer_and_site_once():
    """The (layer, site) one forward pass hooks, in the sweep's order; none for another source (its
    check reads no model). The model's own check: tests/test_sweep_model.py."""
    sweep = _sweep({"source": "model", "model_path": "/m", "text_path": "/t.txt"},
                   {"model_layer": [3, 1], "k": [16, 32], "model_site": ["resid", "mlp_out"]})
    assert model_sites(sweep) == [(3, "resid"), (3, "mlp_out"), (1, "resid"), (1, "mlp_out")]
    assert sweep.names[:2] == ["L3-k16-resid", "L3-k16-mlp_out"]
    assert model_sites(_sweep({}, {"k": [16, 32]})) == []
    check_trainable(_sweep({}, {"k": [16, 32]}))


def _module_level_imports(module: str) -> set[str]:
    """The modules `module` imports when it is imported (not inside functions), following sae_dist's."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = REPO / (name.replace(".", "/") + ".py")
        if not path.is_file():
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                todo.append(node.module)
    return seen


@pytest.mark.parametrize("module", ["sae_dist.contract.sweep", "sae_dist.sweeps.placement"])
def test_the_sweep_is_read_and_placed_without_torch(module):
    """The scheduler's submit and the Train page will use both: no torch at import."""
    imported = _module_level_imports(module)
    assert "sae_dist.config" in imported or "sae_dist.memory" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "sqlalchemy", "streamlit", "scheduler")}
