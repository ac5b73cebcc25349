"""SAELens-format export: round trip through our loader, bad folders, and the real sae-lens package."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sae_dist.errors import UserError
from sae_dist.models.export import export_saelens, load_feature_density, load_sae
from sae_dist.models.sae import SparseAutoencoder

# "matryoshka_batch": Matryoshka with batch-level selection (the paper's), exported as a JumpReLU;
# "matryoshka" selects per sample and is exported as TopK.
ARCHS = ["topk", "standard", "jumprelu", "batchtopk", "matryoshka", "matryoshka_batch"]
BATCH_LEVEL = ("batchtopk", "matryoshka_batch")
THRESHOLDED = ("jumprelu", *BATCH_LEVEL)
D_IN, D_SAE, K = 16, 64, 4
SAELENS_ARCH = {"topk": "topk", "standard": "standard", "jumprelu": "jumprelu", "batchtopk": "jumprelu",
                "matryoshka": "topk", "matryoshka_batch": "jumprelu"}
SAELENS_CLASS = {"topk": "TopKSAE", "standard": "StandardSAE", "jumprelu": "JumpReLUSAE"}


def trained_sae(arch: str, seed: int = 0, d_in: int = D_IN, d_sae: int = D_SAE, k: int = K) -> SparseAutoencoder:
    """A small SAE after a few real training steps, with nonzero biases and (where any) thresholds."""
    torch.manual_seed(seed)
    matryoshka = arch.startswith("matryoshka")
    sae = SparseAutoencoder(d_in, d_sae, "matryoshka" if matryoshka else arch, k=k, seed=seed, l1_coefficient=1e-3,
                            l0_coefficient=1e-3, auxk_coefficient=1 / 32, jumprelu_bandwidth=0.05,
                            matryoshka_widths=(d_sae // 4, d_sae // 2, d_sae) if matryoshka else None,
                            matryoshka_selection="batch" if arch == "matryoshka_batch" else "sample")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        sae.W_enc.add_(0.2 * torch.randn(d_in, d_sae, generator=g))
        sae.b_enc.copy_(0.1 * torch.randn(d_sae, generator=g))
        sae.b_dec.copy_(0.3 * torch.randn(d_in, generator=g))
        if arch == "jumprelu":
            sae.log_threshold.copy_(torch.empty(d_sae).uniform_(math.log(0.05), math.log(0.5), generator=g))
    opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
    dead = torch.zeros(d_sae, dtype=torch.bool)
    dead[:5] = True
    sae.train()
    for _ in range(5):
        opt.zero_grad()
        sae(torch.randn(32, d_in, generator=g), dead).loss.backward()
        sae.remove_parallel_gradient()
        opt.step()
        sae.normalize_decoder()
    if arch in BATCH_LEVEL:
        with torch.no_grad():
            sae.topk_threshold.fill_(0.15)  # as after many steps of the running mean
    return sae.eval()


def inputs(seed: int = 5, shape=(24, D_IN)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 1.5


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


# ---------------------------------------------------------------- our loader


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(arch, tmp_path):
    sae = trained_sae(arch, seed=ARCHS.index(arch))
    density = torch.rand(D_SAE, generator=torch.Generator().manual_seed(1)) * 0.1
    density[:3] = 0.0  # never fired
    out = export_saelens(sae, tmp_path / "sae", feature_density=density, metadata={"run_name": "r1"})
    assert out == tmp_path / "sae"
    loaded = load_sae(out)

    expected_arch = SAELENS_ARCH[arch]
    assert loaded.architecture == expected_arch
    assert (loaded.d_in, loaded.d_sae) == (D_IN, D_SAE)
    assert not loaded.training
    for n in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(loaded, n), getattr(sae, n)), n
    if expected_arch == "topk":
        assert loaded.k == K
    if arch in THRESHOLDED:
        assert_close(loaded.threshold, sae.threshold.detach(), tol=1e-6)
    if arch in BATCH_LEVEL:
        assert torch.allclose(loaded.threshold, torch.full((D_SAE,), 0.15))

    for x in (inputs(), inputs(6, (3, 7, D_IN))):
        with torch.no_grad():
            enc, enc2 = sae.encode(x), loaded.encode(x)
            assert_close(enc2, enc)
            assert ((enc > 0).sum(-1) > 0).all() and (enc == 0).any()  # a nontrivial comparison
            assert_close(loaded.decode(enc2), sae.decode(enc))

    # weights file: SAELens names, fp32, contiguous shapes
    w = load_file(str(out / "sae_weights.safetensors"))
    names = {"W_enc", "b_enc", "W_dec", "b_dec"} | ({"threshold"} if arch in THRESHOLDED else set())
    assert set(w) == names
    assert all(t.dtype == torch.float32 for t in w.values())
    assert w["W_enc"].shape == (D_IN, D_SAE) and w["W_dec"].shape == (D_SAE, D_IN)

    # sparsity file: log10 of the feature density, clamped where a latent never fired
    s = load_file(str(out / "sparsity.safetensors"))
    assert set(s) == {"sparsity"}
    assert_close(s["sparsity"][3:], torch.log10(density[3:]))
    assert (s["sparsity"][:3] == -10).all()
    assert_close(load_feature_density(out)[3:], density[3:])

    cfg = json.loads((out / "cfg.json").read_text())
    required = {"architecture", "d_in", "d_sae", "dtype", "device", "apply_b_dec_to_input",
                "normalize_activations", "reshape_activations", "metadata"}
    assert required <= set(cfg)
    assert cfg["architecture"] == expected_arch
    assert (cfg["d_in"], cfg["d_sae"], cfg["dtype"]) == (D_IN, D_SAE, "float32")
    assert cfg["apply_b_dec_to_input"] is True and cfg["normalize_activations"] == "none"
    assert cfg["metadata"]["sae_lens_version"].startswith("6.")
    assert cfg["metadata"]["trained_architecture"] == sae.architecture
    assert cfg["metadata"]["run_name"] == "r1"
    if expected_arch == "topk":
        assert cfg["k"] == K and cfg["rescale_acts_by_decoder_norm"] is False
    else:
        assert "k" not in cfg
    if arch.startswith("matryoshka"):  # what SAELens' inference ignores, kept for whoever reads the folder
        assert cfg["metadata"]["matryoshka_widths"] == [D_SAE // 4, D_SAE // 2, D_SAE]
        assert cfg["metadata"]["matryoshka_selection"] == ("batch" if arch in BATCH_LEVEL else "sample")


def test_default_density_and_overwrite(tmp_path):
    sae = trained_sae("standard")
    export_saelens(sae, tmp_path / "a")
    assert (load_file(str(tmp_path / "a" / "sparsity.safetensors"))["sparsity"] == -10).all()
    export_saelens(trained_sae("standard", seed=3), tmp_path / "a")  # same folder again: replaced
    assert torch.equal(load_sae(tmp_path / "a").W_enc, trained_sae("standard", seed=3).W_enc)


def test_load_on_given_device(tmp_path):
    export_saelens(trained_sae("topk"), tmp_path / "s")
    assert load_sae(str(tmp_path / "s"), device="cpu").W_enc.device.type == "cpu"


# ---------------------------------------------------------------- SAELens-only options we fold


def test_topk_rescale_by_decoder_norm_is_folded(tmp_path):
    """SAELens TopK files may keep unnormalised decoder rows with rescale_acts_by_decoder_norm."""
    sae = trained_sae("topk")
    out = export_saelens(sae, tmp_path / "s")
    w = load_file(str(out / "sae_weights.safetensors"))
    norms = torch.rand(D_SAE, generator=torch.Generator().manual_seed(2)) * 2 + 0.2
    w["W_dec"] = w["W_dec"] * norms[:, None]
    save_file(w, str(out / "sae_weights.safetensors"))
    cfg = json.loads((out / "cfg.json").read_text())
    cfg["rescale_acts_by_decoder_norm"] = True
    (out / "cfg.json").write_text(json.dumps(cfg))

    x = inputs()
    # SAELens' TopKSAE: hidden_pre * |W_dec row|, topk, relu; decode acts / |row| @ W_dec + b_dec
    pre = ((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) * norms
    vals, idx = pre.topk(K, dim=-1)
    acts = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
    recon = (acts / norms) @ w["W_dec"] + w["b_dec"]
    loaded = load_sae(out)
    with torch.no_grad():
        assert_close(loaded.encode(x), acts)
        assert_close(loaded.decode(loaded.encode(x)), recon)


def test_no_b_dec_on_input_is_folded(tmp_path):
    sae = trained_sae("standard")
    out = export_saelens(sae, tmp_path / "s")
    cfg = json.loads((out / "cfg.json").read_text())
    cfg["apply_b_dec_to_input"] = False
    (out / "cfg.json").write_text(json.dumps(cfg))
    x = inputs()
    with torch.no_grad():
        expect = (x @ sae.W_enc + sae.b_enc).relu()
        assert_close(load_sae(out).encode(x), expect)


# ---------------------------------------------------------------- bad inputs


@pytest.fixture
def exported(tmp_path) -> Path:
    return export_saelens(trained_sae("jumprelu"), tmp_path / "sae")


def test_missing_folder_or_cfg(tmp_path, exported):
    with pytest.raises(UserError, match="cfg.json"):
        load_sae(tmp_path / "nowhere")
    (exported / "cfg.json").unlink()
    with pytest.raises(UserError, match=r"not an SAE folder.*cfg\.json"):
        load_sae(exported)


def test_missing_weights(tmp_path, exported):
    (exported / "sae_weights.safetensors").unlink()
    with pytest.raises(UserError, match="sae_weights.safetensors"):
        load_sae(exported)


@pytest.mark.parametrize("arch", ["gated", "matryoshka_batchtopk", "nonsense"])
def test_unknown_architecture(exported, arch):
    cfg = json.loads((exported / "cfg.json").read_text())
    cfg["architecture"] = arch
    (exported / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=f"architecture '{arch}'"):
        load_sae(exported)


@pytest.mark.parametrize("field,value", [("d_in", D_IN + 1), ("d_sae", D_SAE * 2)])
def test_cfg_shapes_do_not_match_weights(exported, field, value):
    cfg = json.loads((exported / "cfg.json").read_text())
    cfg[field] = value
    (exported / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="weight shapes do not match"):
        load_sae(exported)


@pytest.mark.parametrize("name", ["b_enc", "b_dec", "threshold", "W_dec"])
def test_one_tensor_has_the_wrong_shape(exported, name):
    path = exported / "sae_weights.safetensors"
    w = load_file(str(path))
    w[name] = torch.cat([w[name], w[name][:1]])  # one row too many
    save_file(w, str(path))
    with pytest.raises(UserError, match=f"weight shapes do not match.*{name}"):
        load_sae(exported)


@pytest.mark.parametrize("name", ["threshold", "b_enc"])
def test_missing_tensor(exported, name):
    path = exported / "sae_weights.safetensors"
    w = load_file(str(path))
    del w[name]
    save_file(w, str(path))
    with pytest.raises(UserError, match=f"lacks {name}"):
        load_sae(exported)


def test_unsupported_activation_normalisation(exported):
    cfg = json.loads((exported / "cfg.json").read_text())
    cfg["normalize_activations"] = "expected_average_only_in"
    (exported / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="normalize_activations"):
        load_sae(exported)


# ---------------------------------------------------------------- the real SAELens

SAELENS_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from sae_lens import SAE

root = Path(sys.argv[1])
x = load_file(str(root / "input.safetensors"))["x"]
outs, classes = {}, {}
for name in json.loads((root / "names.json").read_text()):
    sae = SAE.load_from_disk(str(root / name), device="cpu")
    sae.eval()
    with torch.no_grad():
        feats = sae.encode(x)
        outs[name + ".encode"] = feats.contiguous()
        outs[name + ".decode"] = sae.decode(feats).contiguous()
        outs[name + ".forward"] = sae(x).contiguous()  # a skip transcoder's adds its skip path
    classes[name] = type(sae).__name__
save_file(outs, str(root / "saelens_out.safetensors"))
(root / "classes.json").write_text(json.dumps(classes))
"""


def prepare_saelens(root: Path) -> tuple[str, list]:
    """Export every architecture (plus two folded SAELens-only options) into root, with the input
    rows: the script that loads and runs them all with the real sae-lens, and its arguments
    (tests/saelens_once.py runs it, in the one sae-lens process of the session)."""
    names = []
    for i, arch in enumerate(ARCHS):
        export_saelens(trained_sae(arch, seed=10 + i), root / arch,
                       feature_density=torch.rand(D_SAE) * 0.1)
        names.append(arch)
    # SAELens-style files our loader folds: unnormalised TopK decoder rows, no b_dec on input
    out = export_saelens(trained_sae("topk", seed=20), root / "topk_rescaled")
    w = load_file(str(out / "sae_weights.safetensors"))
    w["W_dec"] = w["W_dec"] * (torch.rand(D_SAE, generator=torch.Generator().manual_seed(4)) * 2 + 0.2)[:, None]
    save_file(w, str(out / "sae_weights.safetensors"))
    cfg = json.loads((out / "cfg.json").read_text())
    cfg["rescale_acts_by_decoder_norm"] = True
    (out / "cfg.json").write_text(json.dumps(cfg))
    out = export_saelens(trained_sae("jumprelu", seed=21), root / "jumprelu_no_bdec_in")
    cfg = json.loads((out / "cfg.json").read_text())
    cfg["apply_b_dec_to_input"] = False
    (out / "cfg.json").write_text(json.dumps(cfg))
    names += ["topk_rescaled", "jumprelu_no_bdec_in"]

    save_file({"x": inputs(seed=7, shape=(40, D_IN))}, str(root / "input.safetensors"))
    (root / "names.json").write_text(json.dumps(names))
    return SAELENS_SCRIPT, [root]


@pytest.fixture(scope="module")
def saelens_run(tmp_path_factory):
    """Our exports loaded and run by the real sae-lens: the folder, the input rows, sae-lens' outputs
    and the classes it loaded them as."""
    from saelens_once import saelens_folder

    root = saelens_folder("export", tmp_path_factory)
    x = load_file(str(root / "input.safetensors"))["x"]
    return root, x, load_file(str(root / "saelens_out.safetensors")), json.loads((root / "classes.json").read_text())


@pytest.mark.slow
@pytest.mark.saelens
@pytest.mark.parametrize("name", ARCHS + ["topk_rescaled", "jumprelu_no_bdec_in"])
def test_saelens_loads_our_export(saelens_run, name):
    root, x, outs, classes = saelens_run
    expected_class = SAELENS_CLASS[SAELENS_ARCH.get(name, "topk" if name.startswith("topk") else "jumprelu")]
    assert classes[name] == expected_class
    ours = load_sae(root / name)
    with torch.no_grad():
        enc = ours.encode(x)
        dec = ours.decode(enc)
    assert ((enc > 0).sum(-1) > 0).all() and (enc == 0).any()  # a nontrivial comparison
    assert_close(outs[name + ".encode"], enc)
    assert_close(outs[name + ".decode"], dec)
