"""`python -m sae_dist harvest`: a local transformer's activations at one site, as shards.

The model is read from disk only (HF_HUB_OFFLINE): a model that is not there is an error, never a
download. Contexts go through the model in batches; a hook at the site takes the activations of
the text tokens (never special tokens or padding) and stops the forward pass there, since later
layers are not needed. Every `shard_contexts` contexts become one shard, written atomically, and
`harvest.json` records the finished ones: an interrupted harvest run again with the same command
keeps them and goes on after the last. `manifest.json` is written at the end, so the trainer's
`shards` source only ever sees a complete harvest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sae_dist.data.harvest.contexts import (
    Context,
    batch_inputs,
    framing_from_examples,
    join_documents,
    make_contexts,
    text_files,
)
from sae_dist.data.harvest.sites import INPUT_SITES, site_module_path
from sae_dist.data.shard_format import MANIFEST, SUFFIX, write_manifest, write_shard_file
from sae_dist.errors import UserError

log = logging.getLogger(__name__)

PROGRESS = "harvest.json"  # the settings; shard_NNNNN.json beside each finished shard
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class HarvestSpec:
    model: str
    layer: int
    site: str
    texts: list[str]
    out: str
    max_tokens: int | None = None
    context_length: int = 128
    batch_size: int = 32
    shard_rows: int = 65536
    device: str = "auto"
    dtype: str = "float32"
    transcode: tuple[str, str] | None = None  # (input site, output site): paired rows [x | y] for a transcoder

    def key(self, text_digest: str) -> dict:
        """What must match for a harvest to be resumed (not the batch size or the device)."""
        key = {"model": self.model, "layer": self.layer, "site": self.site, "context_length": self.context_length,
               "max_tokens": self.max_tokens, "shard_rows": self.shard_rows, "dtype": self.dtype, "text": text_digest}
        if self.transcode:
            key["transcode"] = list(self.transcode)
        return key

    @property
    def sites(self) -> list[tuple[int, str]]:
        """The (layer, site) hooked: one, or a transcoder's input and output."""
        return [(self.layer, s) for s in self.transcode] if self.transcode else [(self.layer, self.site)]


@dataclass
class HarvestResult:
    out: Path
    tokens: int  # text tokens harvested by this call (resumed shards not counted)
    total_rows: int
    seconds: float  # the harvest loop
    total_seconds: float  # with reading the text and loading the model
    shards: list[dict] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


class _StopForward(Exception):
    """Raised by the hook: the layers after the site are not needed."""


@dataclass
class Plan:
    """What every process of a harvest agrees on: the contexts and how they fall into shards."""

    out: Path
    files: list[Path]
    key: dict
    config: object
    contexts: list[Context]
    per_shard: int

    @property
    def n_shards(self) -> int:
        return (len(self.contexts) + self.per_shard - 1) // self.per_shard


def plan(spec: HarvestSpec, tokenizer, config) -> Plan:
    out = Path(spec.out).expanduser()
    files = text_files(spec.texts)
    documents = [_read_text(f) for f in files]
    if not any(d.strip() for d in documents):
        raise UserError(f"--text: the {len(files)} text file(s) are empty")
    digest = hashlib.sha256()
    for f, d in zip(files, documents):
        digest.update(f.name.encode() + b"\0" + d.encode() + b"\0")
    for layer, site in spec.sites:
        site_module_path(config, site, layer)  # a bad layer or site fails here
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_positions and spec.context_length > max_positions:
        raise UserError(f"--context-length {spec.context_length}: the model takes at most {max_positions} tokens")
    tokenizer.model_max_length = 1 << 40  # whole documents are tokenised, then cut into contexts
    tokens = join_documents(tokenizer(documents, add_special_tokens=False)["input_ids"],
                            tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id)
    sample = "harvest"
    framing = framing_from_examples(tokenizer(sample)["input_ids"],
                                    tokenizer(sample, add_special_tokens=False)["input_ids"],
                                    tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    contexts = make_contexts(tokens, framing, spec.context_length, spec.max_tokens)
    if not contexts:
        raise UserError("--text: no tokens to harvest")
    per_shard = max(1, spec.shard_rows // framing.window(spec.context_length))
    return Plan(out, files, spec.key(digest.hexdigest()), config, contexts, per_shard)


def harvest(spec: HarvestSpec, workers: int = 1, device_kind: str = "cpu") -> HarvestResult:
    """Harvest with `workers` processes (one per device), each taking every workers-th shard."""
    started = time.perf_counter()
    out = Path(spec.out).expanduser()
    if (out / MANIFEST).exists():
        raise UserError(f"--out {out} already holds a finished harvest (manifest.json); choose another directory")
    tokenizer, config = load_tokenizer(spec.model)
    the_plan = plan(spec, tokenizer, config)
    out.mkdir(parents=True, exist_ok=True)
    kept = _start_or_resume(out, the_plan.key, the_plan.n_shards)
    if kept:
        log.info("resuming: %d finished shard(s) kept", len(kept))
    loop_started = time.perf_counter()
    if workers == 1:
        harvested = harvest_worker(spec, 0, 1, the_plan)
    else:
        harvested = _run_workers(spec, workers, device_kind)
    seconds = time.perf_counter() - loop_started
    done = _finished_shards(out, the_plan.n_shards)
    missing = [i for i in range(the_plan.n_shards) if i not in done]
    if missing:
        raise UserError(f"shards {missing[:5]} were not written; run the same command again to finish them")
    entries = [{k: done[i][k] for k in ("file", "rows", "sha256")} for i in range(the_plan.n_shards)]
    store = _DTYPES[spec.dtype]
    site = {"pair": list(spec.transcode)} if spec.transcode else {"site": spec.site}  # see data/sources/paired.py
    write_manifest(out, entries, _d_in_of(out / entries[0]["file"]), store, {
        "model": spec.model, "model_type": config.model_type, "layer": spec.layer, **site,
        "context_length": spec.context_length, "special_tokens": "excluded", "text_sha256": the_plan.key["text"],
        "text_files": [str(f) for f in the_plan.files]})
    return HarvestResult(out, harvested, sum(e["rows"] for e in entries), seconds,
                         time.perf_counter() - started, entries)


class SiteReader:
    """The model on a device, hooked at the site: contexts in, text-token activations out.

    `sites` (a list of (layer, site)) hooks several instead, in one forward pass: rows come out
    shaped [rows, len(sites), d_in], each token's sites together. The forward stops once every
    hook has fired (after the deepest needed block), as it does for one site."""

    def __init__(self, spec: HarvestSpec, device: torch.device, sites: list[tuple[int, str]] | None = None):
        self.tokenizer, self.model, self.config = load_model(spec.model)
        self.sites = list(sites) if sites else [(spec.layer, spec.site)]
        modules = [self.model.get_submodule(site_module_path(self.config, site, layer)) for layer, site in self.sites]
        self.device = device
        self.model.to(device).eval()
        self.captured: dict[int, torch.Tensor] = {}

        def hook_for(index: int):
            reads_input = self.sites[index][1] in INPUT_SITES

            def hook(_module, inputs, output):
                if reads_input:
                    output = inputs[0]
                self.captured[index] = output[0] if isinstance(output, tuple) else output
                if len(self.captured) == len(modules):
                    raise _StopForward  # the layers after the deepest site are not needed
            return hook

        self.handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(modules)]

    def rows(self, contexts: list[Context], batch_size: int, store=torch.float32, progress=None) -> torch.Tensor:
        return _activations(self.model, contexts, batch_size, self.device, self.captured, store, progress,
                            len(self.sites))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def harvest_worker(spec: HarvestSpec, worker: int, workers: int, the_plan: Plan | None = None) -> int:
    """Write this worker's unfinished shards (index % workers == worker); the text tokens harvested."""
    reader = SiteReader(spec, _device(spec.device), spec.sites)
    the_plan = the_plan or plan(spec, reader.tokenizer, reader.config)
    done = _finished_shards(the_plan.out, the_plan.n_shards)
    mine = [i for i in range(worker, the_plan.n_shards, workers) if i not in done]
    per = the_plan.per_shard
    chunks = [the_plan.contexts[i * per:(i + 1) * per] for i in mine]
    progress = _Progress(sum(sum(c.harvest) for chunk in chunks for c in chunk) if worker == 0 else 0)
    harvested = 0
    try:
        for index, chunk in zip(mine, chunks):
            rows = reader.rows(chunk, spec.batch_size, _DTYPES[spec.dtype], progress)
            rows = rows.reshape(rows.shape[0], -1)  # a transcoder's [rows, 2, d] side by side: [x | y]
            entry = _write_shard(the_plan.out, index, rows, len(done))
            entry["contexts"] = [index * per, index * per + len(chunk)]
            _write_json(the_plan.out / f"shard_{index:05d}.json", entry)  # marks the shard finished
            harvested += rows.shape[0]
    finally:
        reader.close()
        progress.close()
    return harvested


def _run_workers(spec: HarvestSpec, workers: int, device_kind: str) -> int:
    """One process per device (CUDA_VISIBLE_DEVICES picks its GPU; CPU workers share the cores)."""
    import subprocess

    args = [sys.executable, "-m", "sae_dist", "harvest", "--model", spec.model, "--layer", str(spec.layer),
            "--site", spec.site, "--text", *spec.texts, "--out", spec.out, "--context-length", str(spec.context_length),
            "--batch-size", str(spec.batch_size), "--shard-rows", str(spec.shard_rows), "--dtype", spec.dtype]
    if spec.transcode:
        args += ["--transcode", ":".join(spec.transcode)]
    if spec.max_tokens is not None:
        args += ["--max-tokens", str(spec.max_tokens)]
    procs = []
    for w in range(workers):
        env = dict(os.environ)
        if device_kind == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[w] if visible else str(w)
            device = "cuda"
        else:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
            device = "cpu"
        procs.append(subprocess.Popen([*args, "--devices", device, "--worker", f"{w}/{workers}"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    harvested, errors = 0, []
    for w, proc in enumerate(procs):
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"worker {w}: {(stderr.strip().splitlines() or ['exit %d' % proc.returncode])[-1]}")
        found = [line for line in stdout.splitlines() if line.startswith("worker harvested ")]
        harvested += int(found[-1].split()[2]) if found else 0
    if errors:
        raise UserError("; ".join(errors) + " (finished shards are kept: run the same command again)")
    return harvested


def _transformers():
    os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers reads it: never a download
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import transformers
    except ImportError:
        raise UserError("harvest needs the transformers package: pip install -e '.[harvest]'") from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _from_disk(name: str, *loaders):
    """Each loader's from_pretrained(name), from disk only; a clear error for anything else."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise UserError(f"--model {name}: not a model directory (it has no config.json)")
        name = str(path)
    # Each read of a model from disk, said (at debug level): a sweep reads one once, not per SAE.
    log.debug("reading %s: %s", name, ", ".join(loader.__name__ for loader in loaders))
    try:
        return [loader.from_pretrained(name, local_files_only=True) for loader in loaders]
    except (OSError, ValueError) as e:
        if not path.exists():
            raise UserError(f"--model {name}: not on disk (not a directory here, not in the Hugging Face "
                            f"cache); harvest never downloads: copy the model here first") from None
        raise UserError(f"--model {name}: cannot be loaded as a transformers model: {str(e).splitlines()[0]}") from None


def load_tokenizer(name: str):
    """(tokenizer, config): enough to plan a harvest without the weights."""
    t = _transformers()
    config, tokenizer = _from_disk(name, t.AutoConfig, t.AutoTokenizer)
    return tokenizer, config


def load_model(name: str):
    """(tokenizer, base model, config) from disk only."""
    t = _transformers()
    config, tokenizer, model = _from_disk(name, t.AutoConfig, t.AutoTokenizer, t.AutoModel)
    return tokenizer, model, config


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"--text {path}: not UTF-8 text") from None


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {spec}: no CUDA GPU is visible here")
    return torch.device(spec)


def _activations(model, contexts: list[Context], batch_size: int, device, captured: dict, store,
                 progress=None, n_sites: int = 1) -> torch.Tensor:
    """Rows [tokens, d_in] for one hooked site; [tokens, n_sites, d_in] for several."""
    pieces = []
    for start in range(0, len(contexts), batch_size):
        batch = contexts[start:start + batch_size]
        ids, attention, keep = batch_inputs(batch, device)
        captured.clear()
        with torch.inference_mode():
            try:
                model(input_ids=ids, attention_mask=attention)
            except _StopForward:
                pass
        if len(captured) < n_sites:
            raise RuntimeError("a site's hook did not run; the model skipped the hooked module")
        if n_sites == 1:
            pieces.append(captured[0][keep].to(store))
        else:
            pieces.append(torch.stack([captured[i][keep] for i in range(n_sites)], dim=1).to(store))
        if progress is not None:
            progress.update(int(keep.sum()))
    return torch.cat(pieces)  # on the model's device: the writer moves it, the trainer keeps it


def _write_shard(out: Path, index: int, rows: torch.Tensor, kept: int) -> dict:
    path = out / f"shard_{index:05d}{SUFFIX}"
    try:
        return write_shard_file(path, rows)
    except OSError as e:
        if e.errno in _DISK_FULL:
            raise UserError(f"the disk is full while writing {path.name} ({e.strerror}): the partial shard was "
                            f"removed, the {kept} finished shard(s) are kept; free some space and run the same "
                            f"command again to continue") from None
        raise


def _start_or_resume(out: Path, key: dict, n_shards: int) -> dict[int, dict]:
    """Record this harvest's settings, or check them against the interrupted one; its finished shards."""
    path = out / PROGRESS
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            changed = sorted(k for k in key if saved.get("key", {}).get(k) != key[k])
            raise UserError(f"--out {out} holds a different harvest (it differs in {', '.join(changed)}); "
                            f"use the same settings to continue it, or choose another directory")
    elif any(out.glob("*" + SUFFIX)):
        raise UserError(f"--out {out} holds shards that are not from a harvest; choose another directory")
    else:
        _write_json(path, {"key": key})
    _remove_dead_writers_files(out)
    done = _finished_shards(out, n_shards)
    for entry in done.values():
        file = out / entry["file"]
        if not file.exists() or hashlib.sha256(file.read_bytes()).hexdigest() != entry["sha256"]:
            raise UserError(f"--out {out}: finished shard {entry['file']} is missing or changed; "
                            f"delete the directory to start again")
    return done


def _remove_dead_writers_files(out: Path) -> None:
    """A harvest killed while writing a shard leaves its temporary file (`.NAME.tmp-PID`, never
    a finished shard): the resume removes those of writers no longer alive."""
    for leftover in out.glob(".*.tmp-*"):
        pid = leftover.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _finished_shards(out: Path, n_shards: int) -> dict[int, dict]:
    """Shard index -> its entry, for every shard whose marker (written after the shard) exists."""
    done = {}
    for i in range(n_shards):
        marker = out / f"shard_{i:05d}.json"
        if marker.exists():
            done[i] = json.loads(marker.read_text())
    return done


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _d_in_of(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return int(f.get_slice("activations").get_shape()[1])


class _Progress:
    """A tokens progress bar on a terminal; nothing in a log file (the summary line says it all)."""

    def __init__(self, total: int):
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="tok", unit_scale=True, desc="harvest", file=sys.stderr)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
