"""scripts/bench_transcoder.py's goals, a pure function of the evaluations, on plain dicts."""

from __future__ import annotations

from conftest import load_script

T = load_script("bench_transcoder")


def ev(fvu: float, l0: float) -> dict:
    return {"fvu": fvu, "l0": l0}


def results(out_sae, in_sae, plain, skip) -> dict:
    return dict(zip(T.KINDS, (out_sae, in_sae, plain, skip)))


def test_a_transcoder_beats_an_sae_only_with_a_lower_fvu_at_the_same_l0():
    sae = ev(0.10, 30.0)
    assert T.beats(ev(0.09, 30.0), sae)
    assert T.beats(ev(0.09, 12.0), sae)  # fewer latents and a lower FVU: ahead at the SAE's L0 too
    assert not T.beats(ev(0.10, 30.0), sae)  # equal is not ahead
    assert not T.beats(ev(0.11, 20.0), sae)
    # one firing more latents is judged with its threshold moved to the SAE's L0, and not without it
    assert not T.beats(ev(0.09, 34.0), sae)
    assert T.beats(ev(0.09, 34.0), sae, at_sae_l0=ev(0.095, 30.1))
    assert not T.beats(ev(0.09, 34.0), sae, at_sae_l0=ev(0.105, 30.1))


def test_the_goals_name_the_better_transcoder_and_judge_it_against_both_saes():
    got = T.goals(results(ev(0.075, 28.2), ev(0.117, 26.0), ev(0.120, 28.3), ev(0.0995, 16.9)), {})
    (same_input, met_in, why_in), (output, met_out, why_out), (skip, met_skip, why_skip) = got
    assert "MLP's input (its reconstruction put through the MLP)" in same_input and met_in
    assert why_in == "skip transcoder 0.0995 at L0 16.9; the SAE 0.1170 at L0 26.0"
    assert "MLP's output" in output and not met_out and why_out.endswith("the SAE 0.0750 at L0 28.2")
    assert "skip" in skip and met_skip and why_skip == "0.0995 vs 0.1200"
    # the plain transcoder is the one judged when it is the better, and a skip path that does not help fails
    got = T.goals(results(ev(0.075, 28.2), ev(0.117, 26.0), ev(0.070, 28.0), ev(0.080, 28.0)), {})
    assert got[1][1] and got[1][2].startswith("transcoder 0.0700") and not got[2][1]


def test_a_transcoder_firing_more_is_judged_at_the_saes_l0():
    runs = results(ev(0.042, 30.0), ev(0.08, 29.0), ev(0.077, 34.1), ev(0.037, 34.1))
    assert T.best_transcoder(runs) == "skip transcoder"
    unmoved = T.goals(runs, {})
    assert not unmoved[0][1] and not unmoved[1][1]  # not judged without its evaluation at the SAE's L0
    moved = T.goals(runs, {"SAE on mlp_out": ev(0.039, 30.2), "SAE on mlp_in, through the MLP": ev(0.085, 29.1)})
    assert moved[1][1] and "0.0390 at L0 30.2 with its threshold moved to the SAE's L0" in moved[1][2]
    assert not moved[0][1]  # 0.085 at the SAE's L0 is not below its 0.080
