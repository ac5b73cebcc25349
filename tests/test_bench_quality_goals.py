"""scripts/bench_quality.py's goals, a pure function of the evaluations, on plain dicts."""

from __future__ import annotations

from conftest import load_script

Q = load_script("bench_quality")
HIER = next(s for s in Q.SETS if s.name == "h1")
FLAT = next(s for s in Q.SETS if s.name == "q1")


def ev(fvu: float, parents: float | None = None, children: float | None = None, mcc: float = 0.5,
       recovered: float = 0.95, dead: float = 0.0) -> dict:
    rec = {"frac_above_0_9": recovered, "mcc": mcc}
    if parents is not None:
        rec.update(parents_frac_above_0_9=parents, children_frac_above_0_8=children)
    return {"fvu": fvu, "dead_fraction": dead, "recovery": rec}


def test_a_hierarchy_is_met_only_with_every_part_of_the_goal():
    peers = {"sparsify": ev(0.12, 0.63, 0.056, 0.51), "saelens": ev(0.15, 0.19, 0.01, 0.45)}
    good = {"sae-dist": ev(0.10, 0.53, 0.045, 0.46), "sae-dist-matryoshka": ev(0.11, 0.85, 0.2, 0.6), **peers}
    ((name, met, why),) = Q.goals_for(HIER, good)
    assert name == "h1 matryoshka" and met is True and "parents 85.0%" in why
    for worse in (ev(0.11, 0.79, 0.2, 0.6), ev(0.11, 0.85, 0.2, 0.54), ev(0.13, 0.85, 0.2, 0.6),
                  ev(0.11, 0.85, 0.04, 0.6)):  # parents, MCC, FVU, children below TopK's
        assert Q.goals_for(HIER, {**good, "sae-dist-matryoshka": worse})[0][1] is False
    # a peer ahead on MCC is a miss too
    assert Q.goals_for(HIER, {**good, "sparsify": ev(0.12, 0.63, 0.056, 0.7)})[0][1] is False
    assert Q.goals_for(HIER, {"sae-dist": good["sae-dist"]})[0][1] is None  # not run: unproven


def test_flat_sets_keep_topks_goal_and_bound_matryoshkas_fvu():
    peers = {"sparsify": ev(0.12), "saelens": ev(0.15)}
    goals = Q.goals_for(FLAT, {"sae-dist": ev(0.10), "sae-dist-matryoshka": ev(0.109), **peers})
    assert [(name, met) for name, met, _ in goals] == [("q1", True), ("q1 matryoshka", True)]
    goals = Q.goals_for(FLAT, {"sae-dist": ev(0.10), "sae-dist-matryoshka": ev(0.111)})
    assert [(name, met) for name, met, _ in goals] == [("q1", None), ("q1 matryoshka", False)]
