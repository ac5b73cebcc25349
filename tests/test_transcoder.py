"""Transcoders and skip transcoders: the module against a dense formulation written here, their
export as SAELens loads them (the real sae-lens), paired shards (pair-shards; harvest --transcode
against the model run by hand), training on them for real (2 gloo ranks) and from the model, and
every bad input's one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import LENGTH_FREE_SCHEDULE, main_here, run_cli
from sae_dist.data.shard_format import write_shards
from sae_dist.data.sources.shards import open_shards
from sae_dist.models.export import export_saelens, load_sae
from sae_dist.models.sae import SparseAutoencoder

D, D_SAE, K = 12, 48, 4
# (label, architecture, matryoshka selection): the architectures a transcoder may have
KINDS = [("batchtopk", "batchtopk", "sample"), ("standard", "standard", "sample"),
         ("jumprelu", "jumprelu", "sample"), ("matryoshka_batch", "matryoshka", "batch")]


def transcoder(label: str, skip: bool, seed: int = 0) -> SparseAutoencoder:
    """A transcoder that looks trained: nonzero biases and offsets, a nonzero skip path."""
    arch, selection = next((a, s) for name, a, s in KINDS if name == label)
    t = SparseAutoencoder(D, D_SAE, arch, k=K, seed=seed, transcoder=True, skip=skip, l1_coefficient=0.01,
                          l0_coefficient=0.01, jumprelu_init_threshold=0.05, jumprelu_bandwidth=0.05,
                          matryoshka_widths=(D_SAE // 4, D_SAE) if arch == "matryoshka" else None,
                          matryoshka_selection=selection, auxk_coefficient=1 / 32)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        t.W_enc.add_(0.3 * torch.randn(D, D_SAE, generator=g))
        t.b_enc.copy_(0.1 * torch.randn(D_SAE, generator=g))
        t.set_offsets(torch.randn(2 * D, generator=g))
        if skip:
            t.W_skip.copy_(0.2 * torch.randn(D, D, generator=g))
        if t.batch_level:
            t.topk_threshold.fill_(0.3)
    return t


def pairs(rows: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g) * 1.5
    y = (x @ torch.randn(D, D, generator=g)).tanh() + 0.5  # some function of x, offset
    return torch.cat([x, y], dim=1)


@pytest.mark.parametrize("label", [k[0] for k in KINDS])
@pytest.mark.parametrize("skip", [False, True])
def test_forward_is_the_target_error_of_a_dense_transcoder(label, skip):
    """loss and every gradient as a dense autograd transcoder gives them: pre = (x - b_in) W_enc + b_enc,
    the architecture's activation, y_hat = acts W_dec + b_dec (+ x W_skip^T), error against y."""
    t = transcoder(label, skip).train()
    rows = pairs()
    x, y = rows[:, :D], rows[:, D:]
    out = t(rows)
    out.loss.backward()

    p = {n: getattr(t, n).detach().clone().requires_grad_(True) for n in ("W_enc", "b_enc", "W_dec", "b_dec")}
    w_skip = t.W_skip.detach().clone().requires_grad_(True) if skip else None
    pre = (x - t.b_in) @ p["W_enc"] + p["b_enc"]
    if t.batch_level:
        acts = pre.relu()
        kth = acts.detach().flatten().topk(K * len(x)).values[-1]
        acts = acts * (acts.detach() >= kth)
    elif label == "standard":
        acts = pre.relu()
    else:  # jumprelu, forward only: its threshold's straight-through gradient is test_sae's
        acts = pre.relu() * (pre.detach() > t.threshold.detach())
    skip_out = x @ w_skip.t() if skip else 0.0
    y_hat = acts @ p["W_dec"] + p["b_dec"] + skip_out
    mse = (y_hat - y).pow(2).sum(-1).mean()
    loss = mse
    if label == "standard":
        loss = loss + 0.01 * acts.sum(-1).mean()
    if label == "jumprelu":
        loss = loss + 0.01 * (pre.detach() > t.threshold.detach()).float().sum(-1).mean()
    for width in getattr(t, "matryoshka_widths", ())[:-1]:
        loss = loss + (acts[:, :width] @ p["W_dec"][:width] + p["b_dec"] + skip_out - y).pow(2).sum(-1).mean()
    loss.backward()

    assert torch.allclose(out.x_hat, y_hat, atol=1e-5) and torch.allclose(out.mse, mse, atol=1e-4)
    assert torch.allclose(out.loss, loss, rtol=1e-5)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.allclose(getattr(t, name).grad, p[name].grad, atol=1e-4, rtol=1e-4), name
    if skip:
        assert t.W_skip.grad.abs().sum() > 0 and torch.allclose(t.W_skip.grad, w_skip.grad, atol=1e-4, rtol=1e-4)
    assert t.b_in.grad is None  # a fixed offset, not trained


@pytest.mark.parametrize("label", [k[0] for k in KINDS])
@pytest.mark.parametrize("skip", [False, True])
def test_export_round_trip_predicts_the_same(label, skip, tmp_path):
    """Exported with b_in folded into b_enc (SAELens' transcoders read x as it is), then read back
    by our loader: the same activations and the same prediction of y."""
    t = transcoder(label, skip).eval()
    out = export_saelens(t, tmp_path / "t")
    cfg = json.loads((out / "cfg.json").read_text())
    kind = "skip_transcoder" if skip else "transcoder"
    assert cfg["architecture"] == (kind if label == "standard" else f"jumprelu_{kind}")
    assert cfg["d_out"] == D and cfg["apply_b_dec_to_input"] is False
    assert ("W_skip" in load_file(str(out / "sae_weights.safetensors"))) == skip
    loaded = load_sae(out)
    assert loaded.transcoder and loaded.skip == skip and loaded.row_width == 2 * D
    x = pairs(40, seed=5)[:, :D]
    with torch.no_grad():
        acts, again = t.encode(x), loaded.encode(x)
        assert ((acts > 0).sum(-1) > 0).any() and (acts == 0).any()  # a nontrivial comparison
        assert torch.allclose(again, acts, atol=1e-5)
        assert torch.allclose(loaded.predict(x, again), t.predict(x, acts), atol=1e-5)


def test_evaluation_judges_the_prediction_of_the_target(tmp_path):
    """evaluate on paired rows: every metric of y against y_hat, whatever x is; rows of the wrong
    width are one error naming pairs."""
    from sae_dist.errors import DataError
    from sae_dist.evaluate.load import load_sae as read_folder
    from sae_dist.evaluate.metrics import evaluate_sae

    t = transcoder("batchtopk", skip=True).eval()
    rows = pairs(200, seed=7)
    ours = evaluate_sae(t, rows.split(64))
    x, y = rows[:, :D], rows[:, D:]
    with torch.no_grad():
        y_hat = t.predict(x, t.encode(x))
    fvu = float((y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    assert ours.fvu == pytest.approx(fvu, rel=1e-5)
    read = read_folder(export_saelens(t, tmp_path / "t"))
    assert evaluate_sae(read, rows.split(50)).fvu == pytest.approx(fvu, rel=1e-4)  # as SAELens computes it
    with pytest.raises(DataError, match=r"its rows must be pairs \[input \| target\], \[rows, 24\]"):
        evaluate_sae(t, [x])


# ---------------------------------------------------------------- the real SAELens


SAELENS_CLASS = {("standard", False): "Transcoder", ("standard", True): "SkipTranscoder",
                 ("jumprelu", False): "JumpReLUTranscoder", ("jumprelu", True): "JumpReLUSkipTranscoder"}
EXPORTED = [(label, skip) for label, *_ in KINDS for skip in (False, True)]


def prepare_saelens(root: Path) -> tuple[str, list]:
    """Every transcoder kind exported into root, with the input rows (tests/saelens_once.py runs
    the script with the real sae-lens)."""
    names = []
    for i, (label, skip) in enumerate(EXPORTED):
        name = f"{label}-{'skip' if skip else 'plain'}"
        export_saelens(transcoder(label, skip, seed=30 + i), root / name)
        names.append(name)
    save_file({"x": pairs(40, seed=9)[:, :D].contiguous()}, str(root / "input.safetensors"))
    (root / "names.json").write_text(json.dumps(names))
    from test_export import SAELENS_SCRIPT  # loads each folder with the real sae-lens, runs encode and forward

    return SAELENS_SCRIPT, [root]


@pytest.mark.slow
@pytest.mark.saelens
@pytest.mark.parametrize("label,skip", EXPORTED)
def test_saelens_loads_our_transcoders(label, skip, tmp_path_factory):
    from saelens_once import saelens_folder

    root = saelens_folder("transcoder", tmp_path_factory)
    name = f"{label}-{'skip' if skip else 'plain'}"
    outs, classes = load_file(str(root / "saelens_out.safetensors")), json.loads((root / "classes.json").read_text())
    assert classes[name] == SAELENS_CLASS[("standard" if label == "standard" else "jumprelu", skip)]
    ours = load_sae(root / name)
    x = load_file(str(root / "input.safetensors"))["x"]
    with torch.no_grad():
        acts = ours.encode(x)
        assert ((acts > 0).sum(-1) > 0).any() and (acts == 0).any()
        assert torch.allclose(outs[name + ".encode"], acts, atol=1e-5)
        assert torch.allclose(outs[name + ".forward"], ours.predict(x, acts), atol=1e-5)


# ---------------------------------------------------------------- paired shards, for real

def shard_set(path: Path, rows: torch.Tensor, **meta) -> Path:
    return write_shards(path, rows.split(100), meta)


def one_line(result, words: str) -> None:
    code, out, err = result
    assert code == 2, f"{code}\n{out}\n{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], err


def test_pair_shards_joins_row_for_row_and_refuses_what_does_not_pair(tmp_path):
    rows = pairs(300, seed=2)
    shard_set(tmp_path / "in", rows[:, :D], site="mlp_in")
    shard_set(tmp_path / "out", rows[:, D:], site="mlp_out")
    done = main_here("pair-shards", str(tmp_path / "in"), str(tmp_path / "out"), "--out", str(tmp_path / "p"),
                     "--rows-per-shard", "128")
    assert done.returncode == 0 and "--transcode mlp_in:mlp_out" in done.stdout, done
    paired = open_shards(tmp_path / "p")
    assert paired.manifest["pair"] == ["mlp_in", "mlp_out"] and paired.rows == [128, 128, 44]
    got = torch.cat([load_file(str(f))["activations"] for f in paired.files])
    assert torch.equal(got, rows)

    shard_set(tmp_path / "short", rows[:299, D:])
    one_line(main_here("pair-shards", str(tmp_path / "in"), str(tmp_path / "short"), "--out", str(tmp_path / "q")),
             "paired shards need the same rows: ")
    shard_set(tmp_path / "wide", torch.cat([rows[:, D:], rows[:, :1]], dim=1))
    one_line(main_here("pair-shards", str(tmp_path / "in"), str(tmp_path / "wide"), "--out", str(tmp_path / "q")),
             "paired shards need one width")
    one_line(main_here("pair-shards", str(tmp_path / "in"), str(tmp_path / "in"), "--out", str(tmp_path / "q")),
             "is both the input and the target")
    one_line(main_here("pair-shards", str(tmp_path / "p"), str(tmp_path / "out"), "--out", str(tmp_path / "q")),
             "is paired already")
    one_line(main_here("pair-shards", str(tmp_path / "in"), str(tmp_path / "out"), "--out", str(tmp_path / "p")),
             "already holds shards")  # nothing already stored is lost
    one_line(main_here("pair-shards", str(tmp_path / "in"), str(tmp_path / "out"), "--out", str(tmp_path / "q"),
                       "--rows-per-shard", "0"), "--rows-per-shard 0: must be positive")
    one_line(main_here("pair-shards", str(tmp_path / "in"), str(tmp_path / "out"), "--out", str(tmp_path / "q"),
                       "--names", "same:same"), "give two different sites as IN:OUT")
    # harvest --transcode is read before any model is loaded: a bad pair is one line
    one_line(main_here("harvest", "--model", str(tmp_path / "no-model"), "--layer", "3", "--text", str(tmp_path),
                       "--out", str(tmp_path / "q"), "--transcode", "mlp_in"), "give two different sites as IN:OUT")
    assert not (tmp_path / "q").exists() and torch.equal(
        torch.cat([load_file(str(f))["activations"] for f in open_shards(tmp_path / "p").files]), rows)


def test_bad_transcoder_settings_are_one_line_each_before_anything_starts(tmp_path):
    rows = pairs(300)
    shard_set(tmp_path / "one", rows[:, D:], site="mlp_out")
    shard_set(tmp_path / "p", rows, pair=["mlp_in", "mlp_out"])
    base = ("train", "--no-db", "--devices", "cpu:1", "--steps", "2", "--out-dir", str(tmp_path / "r"))
    one_line(main_here(*base, "--skip"), "skip: a skip path belongs to a transcoder: add --transcode IN:OUT")
    one_line(main_here(*base, "--transcode", "mlp_in:mlp_out"), "transcode: needs the model source")
    one_line(main_here(*base, "--source", "model", "--model-path", "m", "--text-path", "t", "--architecture",
                       "batchtopk", "--transcode", "mlp_in:embed"), "site 'embed' is not one a model is read at")
    one_line(main_here(*base, "--source", "shards", "--shards-path", str(tmp_path / "p"), "--transcode", "mlp_in"),
             "give two different sites as IN:OUT")
    one_line(main_here(*base, "--source", "shards", "--shards-path", str(tmp_path / "p"), "--transcode",
                       "mlp_in:mlp_out"), "a topk transcoder (each sample's top k) has no SAELens class")
    arch = ("--architecture", "batchtopk")
    one_line(main_here(*base, *arch, "--source", "shards", "--shards-path", str(tmp_path / "one"), "--transcode",
                       "mlp_in:mlp_out"), "holds one site's rows, not pairs")
    one_line(main_here(*base, *arch, "--source", "shards", "--shards-path", str(tmp_path / "p")),
             "holds pairs (mlp_in:mlp_out) for a transcoder; add --transcode mlp_in:mlp_out")
    one_line(main_here(*base, *arch, "--source", "shards", "--shards-path", str(tmp_path / "p"), "--transcode",
                       "resid:mlp_out"), "pairs mlp_in:mlp_out, not resid:mlp_out")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_skip_transcoder_learns_on_two_ranks_what_a_plain_one_cannot(tmp_path):
    """y = x A + c (linear, full rank): the skip path can hold it exactly, 4 latents of 48 cannot.
    Trained for real on paired shards, 2 gloo ranks, then evaluated on the held-out tail."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6000, D, generator=g)
    y = x @ torch.randn(D, D, generator=g) / D**0.5 + 1.0
    shard_set(tmp_path / "p", torch.cat([x, y], dim=1), pair=["input", "target"])
    fvus = {}
    for skip in (False, True):
        run = tmp_path / ("skip" if skip else "plain")
        done = run_cli("train", "--no-db", "--devices", "cpu:2", "--source", "shards", "--shards-path",
                       str(tmp_path / "p"), "--transcode", "input:target", *(["--skip"] if skip else []),
                       "--architecture", "batchtopk", "--d-sae", str(D_SAE), "--k", str(K), "--batch-size", "128",
                       "--steps", "150", "--lr", "3e-3", "--log-every", "50", "--eval-rows", "512",
                       "--out-dir", str(run))
        assert done.returncode == 0, done.stderr[-3000:]
        fvus[skip] = json.loads((run / "evaluation.json").read_text())["fvu"]
        assert (load_sae(run / "sae").skip) == skip
    print(fvus)
    assert fvus[True] < 0.5 * fvus[False], fvus  # measured 0.19 against 0.60


# ---------------------------------------------------------------- the model, for real

@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    from test_harvest import TEXT

    path = tmp_path_factory.mktemp("text") / "text.md"
    path.write_text(Path(TEXT[0]).read_text(encoding="utf-8")[:3_000], encoding="utf-8")
    return str(path)


@pytest.mark.slow
def test_harvested_pairs_are_the_mlps_input_and_output_and_train_a_transcoder(minilm, text, tmp_path):
    """harvest --transcode mlp_in:mlp_out: each row is layer 3's MLP input (the attention block's
    output, after its LayerNorm) and the MLP's output (before the residual sum), checked against
    the model run by hand; a transcoder trains on them, and on the model straight."""
    out = tmp_path / "pairs"
    done = run_cli("harvest", "--model", minilm, "--layer", "3", "--transcode", "mlp_in:mlp_out", "--text", text,
                   "--out", str(out), "--max-tokens", "300", "--devices", "cpu:1")
    assert done.returncode == 0, done.stderr[-2000:]
    data = open_shards(out)
    assert data.d_in == 768 and data.manifest["pair"] == ["mlp_in", "mlp_out"] and "site" not in data.manifest
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(minilm), AutoModel.from_pretrained(minilm)
    ids = tok(Path(text).read_text(), add_special_tokens=False)["input_ids"][:126]
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([[tok.cls_token_id, *ids, tok.sep_token_id]]),
                       output_hidden_states=True).hidden_states
        block = model.encoder.layer[3]
        mlp_in = block.attention(states[3])[0]
        mlp_out = block.output.dense(block.intermediate(mlp_in))
    rows = load_file(str(data.files[0]))["activations"][:126]
    assert torch.allclose(rows[:, :384], mlp_in[0, 1:-1], atol=1e-4)
    assert torch.allclose(rows[:, 384:], mlp_out[0, 1:-1], atol=1e-4)

    common = ("--no-db", "--devices", "cpu:1", "--architecture", "batchtopk", "--skip", "--expansion-factor", "2",
              "--k", "16", "--batch-size", "64", "--log-every", "10", "--eval-rows", "64")
    trained = main_here("train", "--source", "shards", "--shards-path", str(out), "--transcode", "mlp_in:mlp_out",
                        "--steps", "30", "--out-dir", str(tmp_path / "run"), *common)
    assert trained.returncode == 0, trained.stderr[-2000:]
    fvus = [float(v) for v in re.findall(r"fvu ([\d.]+)", trained.stdout)]
    assert fvus[-1] < fvus[0], trained.stdout
    check = json.loads((tmp_path / "run" / "evaluation.json").read_text())["model_check"]
    assert check["kind"] == "sentence_cosine" and check["site"] == "mlp_in:mlp_out", check
    # evaluate --json prints the JSON alone, though the model check logs its loading on the way
    again = run_cli("evaluate", str(tmp_path / "run" / "sae"), "--shards", str(out), "--rows", "64", "--json",
                    "--no-db")
    assert again.returncode == 0 and json.loads(again.stdout)["model_check"]["site"] == "mlp_in:mlp_out", again
    straight = main_here("train", "--source", "model", "--model-path", minilm, "--model-layer", "3", "--text-path",
                         text, "--transcode", "mlp_in:mlp_out", "--steps", "10", "--out-dir", str(tmp_path / "m"),
                         *common)
    assert straight.returncode == 0, straight.stderr[-2000:]
    assert load_sae(tmp_path / "m" / "sae").transcoder


def test_a_transcoders_sweep_cannot_vary_its_sites(minilm, text, tmp_path):
    """The source hooks the two sites --transcode names at one layer: a sweep over the layer or the
    site would train every SAE on those anyway, so it is refused before anything starts."""
    one_line(main_here("train", "--no-db", "--devices", "cpu:1", "--source", "model", "--model-path", minilm,
                       "--text-path", text, "--architecture", "batchtopk", "--transcode", "mlp_in:mlp_out",
                       "--sweep", "model_layer=2,3", "--steps", "2", "--out-dir", str(tmp_path / "r")),
             "model_layer and model_site cannot vary in its sweep")
    assert not (tmp_path / "r").exists()


def test_a_skip_transcoder_resumes_exactly(tmp_path):
    """10 steps, then 10 more with --resume, give the weights of 20 straight (a schedule that does
    not depend on the run's length): W_skip, the fixed input offset b_in and the stream of pairs
    are all in the checkpoint."""
    from test_train import final_weights, rel_diff

    shard_set(tmp_path / "p", pairs(3000, seed=4), pair=["input", "target"])
    common = ("train", "--no-db", "--devices", "cpu:1", "--source", "shards", "--shards-path", str(tmp_path / "p"),
              "--transcode", "input:target", "--skip", "--architecture", "batchtopk", "--d-sae", str(D_SAE), "--k",
              str(K), "--batch-size", "64", "--eval-rows", "0", "--checkpoint-every", "10", *LENGTH_FREE_SCHEDULE,
              "--refit-fraction", "0")  # a finished run refits its decoder, and the split run finishes at 10
    for steps, run, extra in (("20", "straight", ()), ("10", "split", ()), ("20", "split", ("--resume",))):
        done = main_here(*common, "--steps", steps, "--out-dir", str(tmp_path / run), *extra)
        assert done.returncode == 0, done.stderr[-2000:]
    straight, split = final_weights(tmp_path / "straight"), final_weights(tmp_path / "split")
    assert {"W_skip", "b_in"} <= set(straight) and bool(straight["b_in"].abs().sum() > 0)
    assert rel_diff(split, straight) < 1e-6


def test_a_skip_transcoders_decoder_refit_lowers_its_target_error(tmp_path):
    """--refit-fraction on a skip transcoder: the refit fits the decoder to what the latents must
    add to b_dec and the skip path to reach y (the loss's own goal), so on held-out pairs of a
    nonlinear target it predicts y better than the same run without it; it exports and loads as a
    skip transcoder."""
    shard_set(tmp_path / "p", pairs(6000, seed=4), pair=["input", "target"])
    fvus = {}
    for fraction in ("0", "0.5"):
        run = tmp_path / f"refit{fraction}"
        out = main_here("train", "--no-db", "--devices", "cpu:1", "--source", "shards", "--shards-path",
                        str(tmp_path / "p"), "--transcode", "input:target", "--skip", "--architecture", "batchtopk",
                        "--d-sae", str(D_SAE), "--k", str(K), "--batch-size", "128", "--steps", "120", "--lr", "3e-3",
                        "--log-every", "40", "--checkpoint-every", "0", "--eval-rows", "512",
                        "--refit-fraction", fraction, "--out-dir", str(run))
        assert out.returncode == 0, out.stderr[-3000:]
        assert ("decoder refit by least squares to the codes of the last 60 steps" in out.stdout) == (fraction != "0")
        fvus[fraction] = json.loads((run / "evaluation.json").read_text())["fvu"]
        assert load_sae(run / "sae").skip
    print(fvus)
    assert fvus["0.5"] < 0.97 * fvus["0"], fvus
