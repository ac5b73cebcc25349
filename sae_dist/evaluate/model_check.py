"""The model's own check of an SAE trained on harvested activations.

A low FVU says the SAE reconstructs the rows; it does not say the model still works on the
reconstruction. So the SAE is spliced into the model the shards were harvested from, at the same
site and on the same positions (text tokens, never special tokens or padding), and we measure
how much of the model's output survives, next to a zero-ablation of the site for scale:

- an encoder (BERT-like, e.g. all-MiniLM-L6-v2): the mean cosine between the sentence embedding
  (mean pooling over the attention mask, then normalisation, as sentence-transformers does) with
  the splice and without; likewise with the site zero-ablated;
- a causal LM: next-token cross-entropy clean, spliced and ablated, and SAELens' ce_loss_score
  = (CE_ablated - CE_spliced) / (CE_ablated - CE_clean): 1 when the splice loses nothing, 0 when
  it is as bad as ablating the site; and SAEBench's KL scores: the mean over positions of
  KL(clean next-token distribution || spliced one), likewise ablated, and kl_div_score =
  (KL_ablated - KL_spliced) / KL_ablated (SAELens' `_kl` and formula). A spliced or ablated batch
  runs the clean model again beside it, since the clean distributions are too large to keep.

Texts come from the harvest's own text source, cut into contexts exactly as the harvest cut them;
contexts after the harvested ones are used when the harvest stopped early (--max-tokens), so the
check runs on text the SAE never saw, else on harvested contexts (the result says which). The
model is read from disk only, as the harvest reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sae_dist.data.harvest.contexts import batch_inputs, framing_from_examples, join_documents, make_contexts
from sae_dist.data.harvest.sites import INPUT_SITES, site_module_path
from sae_dist.data.shard_format import shard_pair
from sae_dist.errors import UserError

ENCODER_TYPES = ("bert", "roberta", "distilbert")  # sentence embeddings; every other model: causal LM
BATCH = 16  # contexts per forward pass

log = logging.getLogger(__name__)


def model_check(sae: Any, shards_dir: str | Path, max_texts: int = 64, max_tokens: int = 8192,
                device: str | torch.device | None = None) -> dict | None:
    """Splice `sae` (any object with encode(x) and decode(acts)) into the harvest's model.

    None when the shards were not harvested from a model (no manifest, or no model in it).
    {"kind": "unavailable", "reason": ...} when they were, but the model or text cannot be read
    now. Otherwise a "sentence_cosine" or "ce_loss_score" result (see the module docstring); at
    most max_texts contexts and about max_tokens tokens are run, three times each.
    """
    return ModelCheck(shards_dir, max_texts, max_tokens)(sae, device)


class ModelCheck:
    """model_check for any number of SAEs of the same shards (a sweep's): the model and the
    contexts are loaded once, and the clean and zero-ablated runs (the same for every SAE) run
    once per device; each SAE adds its spliced run."""

    def __init__(self, shards_dir: str | Path, max_texts: int = 64, max_tokens: int = 8192):
        self.model = None
        self.outcome: dict | None = None  # every SAE's result when there is no model to run
        self.manifest = _manifest(Path(shards_dir))
        if self.manifest is None or not self.manifest.get("model"):
            return
        try:
            self.texts, self.texts_from, _, self.config = _contexts(self.manifest, max_texts, max_tokens)
            self.kind = "sentence_cosine" if self.config.model_type in ENCODER_TYPES else "ce_loss_score"
            log.info("model check: loading %s", self.manifest["model"])  # once per ModelCheck (tests count it)
            self.model = _load(self.manifest["model"], causal=self.kind == "ce_loss_score")
        except UserError as e:
            self.outcome = {"kind": "unavailable", "reason": str(e)}
        self._plain: dict[torch.device, tuple[list, list]] = {}  # device -> (clean, ablated) outputs

    def __call__(self, sae: Any, device: str | torch.device | None = None) -> dict | None:
        if self.model is None:
            return self.outcome
        device = torch.device(device) if device is not None else _device_of(sae)
        self.model.to(device).eval()
        base = getattr(self.model, "base_model", self.model)  # site paths name modules of the base model
        manifest, layer = self.manifest, int(self.manifest["layer"])
        # Paired shards (a transcoder's): its output replaces the target site's, computed from what
        # the input site held in the same forward pass (the input's hook runs first).
        pair = shard_pair(manifest)
        splice = _Splice(sae)
        handles = []
        if pair:
            reader = base.get_submodule(site_module_path(self.config, pair[0], layer))
            handles.append(reader.register_forward_hook(splice.capture_input(pair[0] in INPUT_SITES)))
        name = pair[1] if pair else manifest["site"]
        site = base.get_submodule(site_module_path(self.config, name, layer))
        if name in INPUT_SITES:  # an SAE of what a module reads (mlp_in): that input is replaced
            handles.append(site.register_forward_pre_hook(splice.on_input))
        else:
            handles.append(site.register_forward_hook(splice))
        forward = _embed if self.kind == "sentence_cosine" else _losses
        try:
            kl = self.kind == "ce_loss_score"
            if device not in self._plain:
                self._plain[device] = (_runs(self.model, self.texts, splice, device, forward, None),
                                       _runs(self.model, self.texts, splice, device, forward, "zero", kl))
            spliced = _runs(self.model, self.texts, splice, device, forward, "sae", kl)
        finally:
            for handle in handles:
                handle.remove()
        clean, ablated = self._plain[device]
        result = (_sentence_cosine(clean, spliced, ablated, self.texts) if self.kind == "sentence_cosine"
                  else _ce_loss(clean, spliced, ablated))
        return {"kind": self.kind, **result, "texts": len(self.texts), "texts_from": self.texts_from,
                "model": manifest["model"], "layer": layer, "site": ":".join(pair) if pair else manifest["site"]}


# ---------------------------------------------------------------- the splice


class _Splice:
    """A forward hook on the site (a pre-hook for a module's input): passes the output through
    (mode None), or replaces it at the harvested positions by the SAE's reconstruction ("sae")
    or by zeros ("zero"). A transcoder's output is its prediction from the input site's rows
    (`capture_input`'s hook)."""

    def __init__(self, sae: Any):
        self.sae = sae
        self.mode: str | None = None
        self.keep: Tensor | None = None  # [batch, positions] bool: the harvested positions
        self._dtype = _dtype_of(sae)
        self.source: Tensor | None = None  # a transcoder's input, this forward pass's

    def capture_input(self, reads_input: bool):
        def hook(_module, inputs, output):
            held = inputs[0] if reads_input else output
            self.source = held[0] if isinstance(held, tuple) else held
        return hook

    def on_input(self, module, args):
        """A forward pre-hook: the same replacement, of the module's input (a site like mlp_in)."""
        replaced = self(module, (), args[0])
        return None if replaced is None else (replaced, *args[1:])

    def __call__(self, _module, _inputs, output):
        if self.mode is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden.clone()
        if self.mode == "zero":
            hidden[self.keep] = 0
        else:
            rows = hidden[self.keep]
            with torch.no_grad():
                if self.source is not None:  # a transcoder
                    x = self.source[self.keep].to(self._dtype)
                    new = self.sae.predict(x, self.sae.encode(x))
                else:
                    new = self.sae.decode(self.sae.encode(rows.to(self._dtype)))
            hidden[self.keep] = new.to(device=hidden.device, dtype=hidden.dtype)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def _runs(model, contexts, splice: _Splice, device, forward, mode: str | None, kl: bool = False) -> list:
    """forward(batch outputs) for each batch, with the splice in `mode`: None (clean), "sae" or
    "zero" (ablated); with `kl`, each result also carries the summed KL divergence of the clean
    run's next-token distributions from this run's (the clean batch run again beside it)."""
    out = []
    for start in range(0, len(contexts), BATCH):
        batch = contexts[start:start + BATCH]
        ids, attention, splice.keep = batch_inputs(batch, device)
        with torch.inference_mode():
            clean = None
            if kl:
                splice.mode = None
                clean = model(input_ids=ids, attention_mask=attention).logits
            splice.mode = mode
            output = model(input_ids=ids, attention_mask=attention)
            result = forward(output, ids, attention)
            out.append((*result, *kl_sum(clean, output.logits, attention)) if kl else result)
    splice.mode = None
    return out


def kl_sum(clean_logits: Tensor, new_logits: Tensor, attention: Tensor) -> tuple[float, int]:
    """(sum over the real positions of KL(softmax(clean) || softmax(new)), as SAELens' `_kl`; the
    number of those positions)."""
    real = attention.bool()
    log_new = torch.nn.functional.log_softmax(new_logits[real].float(), dim=-1)
    log_clean = torch.nn.functional.log_softmax(clean_logits[real].float(), dim=-1)
    return float((log_clean.exp() * (log_clean - log_new)).sum()), int(real.sum())


def _embed(output, _ids, attention) -> Tensor:
    mask = attention[..., None].to(output.last_hidden_state.dtype)
    pooled = (output.last_hidden_state * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled.float(), dim=-1)


def _losses(output, ids, attention) -> tuple[float, int]:
    # Next-token loss wherever both the token and its successor are in the context.
    logits = output.logits[:, :-1].float()
    valid = (attention[:, :-1] * attention[:, 1:]).bool()
    ce = torch.nn.functional.cross_entropy(logits[valid], ids[:, 1:][valid], reduction="sum")
    return float(ce), int(valid.sum())


def _sentence_cosine(clean: list, spliced: list, ablated: list, contexts) -> dict:
    clean, spliced, ablated = (torch.cat(x) for x in (clean, spliced, ablated))
    return {"spliced_cosine": float((clean * spliced).sum(-1).mean()),
            "ablated_cosine": float((clean * ablated).sum(-1).mean()),
            "tokens": sum(sum(c.harvest) for c in contexts)}


def _ce_loss(clean_run: list, spliced_run: list, ablated_run: list) -> dict:
    tokens = sum(r[1] for r in clean_run)
    clean, spliced, ablated = (sum(r[0] for r in run) / max(tokens, 1) for run in (clean_run, spliced_run, ablated_run))
    gap = ablated - clean
    score = (ablated - spliced) / gap if gap != 0 else float("nan")  # SAELens' ce_loss_score
    return {"ce_clean": clean, "ce_spliced": spliced, "ce_ablated": ablated,
            "ce_loss_score": None if math.isnan(score) else score, "tokens": tokens,
            **kl_scores(spliced_run, ablated_run)}


def kl_scores(spliced_run: list, ablated_run: list) -> dict:
    """SAEBench's KL figures from runs whose results end with (summed KL, positions): the mean KL
    with the splice and with the ablation, and kl_div_score = (KL_ablated - KL_spliced) / KL_ablated."""
    positions = sum(r[3] for r in spliced_run)
    with_sae, with_ablation = (sum(r[2] for r in run) / max(positions, 1) for run in (spliced_run, ablated_run))
    score = (with_ablation - with_sae) / with_ablation if with_ablation > 0 else None
    return {"kl_div_with_sae": with_sae, "kl_div_with_ablation": with_ablation, "kl_div_score": score}


# ---------------------------------------------------------------- the harvest's model and text


def _manifest(directory: Path) -> dict | None:
    from sae_dist.data.shard_format import MANIFEST

    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _contexts(manifest: dict, max_texts: int, max_tokens: int):
    """(contexts, where they come from, tokenizer, config): the harvest's contexts of its text,
    those after the harvested ones where there are any.

    Cut as the harvest cuts them (sae_dist.data.harvest.run.plan), but documents are tokenised only as
    far as the check reaches: a harvest's text may be far larger than the check needs."""
    from sae_dist.data.harvest.run import _read_text, load_tokenizer

    tokenizer, config = load_tokenizer(manifest["model"])
    names = manifest.get("text_files") or []
    if not names:
        raise UserError("the manifest names no text files")
    missing = [f for f in names if not Path(f).is_file()]
    if missing:
        raise UserError(f"the harvest's text {missing[0]} is no longer there")
    tokenizer.model_max_length = 1 << 40  # whole documents, as the harvest tokenises them
    sample = "harvest"
    framing = framing_from_examples(tokenizer(sample)["input_ids"],
                                    tokenizer(sample, add_special_tokens=False)["input_ids"],
                                    tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    context_length = int(manifest["context_length"])
    room = framing.window(context_length)
    # The harvest took the first total_rows text tokens, room a context; a context cut short by
    # --max-tokens is partly seen, so the unseen ones start after it.
    first_unseen = -(-int(manifest.get("total_rows", 0)) // room)
    enough = (first_unseen + 1) * room + max_tokens
    digest, documents, have = hashlib.sha256(), [], 0
    for name in names:
        path = Path(name)
        text = _read_text(path)
        digest.update(path.name.encode() + b"\0" + text.encode() + b"\0")
        if have < enough:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            documents.append(ids)
            have += len(ids) + 1
    separator = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    contexts = make_contexts(join_documents(documents, separator), framing, context_length)
    if not contexts:
        raise UserError("the harvest's text holds no tokens now")
    unseen = contexts[first_unseen:]
    if digest.hexdigest() != manifest.get("text_sha256"):
        texts_from = "text changed since the harvest"
        contexts = unseen or contexts
    elif unseen:
        contexts, texts_from = unseen, "not harvested"
    else:
        texts_from = "harvested"
    chosen, tokens = [], 0
    for c in contexts:
        if len(chosen) >= max_texts or (chosen and tokens + sum(c.harvest) > max_tokens):
            break
        chosen.append(c)
        tokens += sum(c.harvest)
    return chosen, texts_from, tokenizer, config


def _load(name: str, causal: bool):
    from sae_dist.data.harvest.run import _from_disk, _transformers

    t = _transformers()  # sets HF_HUB_OFFLINE before anything is loaded
    loader = t.AutoModelForCausalLM if causal else t.AutoModel
    return _from_disk(name, loader)[0]


def _weight(sae: Any) -> Tensor | None:
    """A tensor of the SAE's, for its device and dtype: a module's first parameter, or W_dec
    (a plain object such as sae_dist.evaluate.LoadedSae)."""
    for p in getattr(sae, "parameters", lambda: [])():
        return p
    weight = getattr(sae, "W_dec", None)
    return weight if isinstance(weight, Tensor) else None


def _device_of(sae: Any) -> torch.device:
    weight = _weight(sae)
    return weight.device if weight is not None else torch.device("cpu")


def _dtype_of(sae: Any) -> torch.dtype:
    weight = _weight(sae)
    return weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
