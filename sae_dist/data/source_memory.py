"""What the model source holds on a device beside the SAEs: the model's weights, one forward
pass's activations and the fill (sae_dist/data/sources/model.py). Every rank runs the model over its
share of each fill's contexts and holds the whole fill, so a sweep's placement adds this to every
device of the job (sae_dist/sweeps/placement.py).

An estimate, pure and torch-free, not a measurement:
  * weights: the model's tensors as stored (transformers loads them in the stored dtype), read
    from the safetensors headers without reading the weights (`safetensors_bytes`), or counted on
    the loaded model where a rank has it;
  * forward pass: READ_BATCH contexts of context_length tokens through one block at a time
    (no gradients: a block's tensors are freed before the next), its peak in the attention and
    the MLP: about 6 hidden-wide tensors (queries, keys, values, context, output, residual), 2
    intermediate-wide ones (the MLP's pre-activation and activation), 2 of the attention scores
    (heads x tokens x tokens: scores and their softmax), and each hooked site's output, kept;
  * fill: FILL_BATCHES global batches of rows, n_sites x d_in floats each, 4 times over while a
    fill loads (the last one, which the step being read may still view, the ranks' gathered
    parts, their concatenation in context order and its shuffled copy).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from sae_dist.format import fmt_bytes

FILL_COPIES = 4  # see the module docstring
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class SourceMemory:
    weights: int | None  # None: unknown (no safetensors file to read)
    forward: int
    fill: int  # the fill's peak, FILL_COPIES x fill_rows rows
    fill_rows: int
    n_sites: int
    read_batch: int
    context_length: int

    @property
    def total(self) -> int:
        """Bytes on each device; unknown weights count as 0 (the text says they are unknown)."""
        return (self.weights or 0) + self.forward + self.fill

    def describe(self) -> str:
        weights = "unknown" if self.weights is None else fmt_bytes(self.weights)
        sites = f" x {self.n_sites} sites" if self.n_sites > 1 else ""
        return (f"the model source runs on every device: {fmt_bytes(self.total)} estimated (weights {weights}, "
                f"forward pass of {self.read_batch} contexts x {self.context_length} tokens "
                f"{fmt_bytes(self.forward)}, fill {FILL_COPIES} x {self.fill_rows:,} rows{sites} "
                f"{fmt_bytes(self.fill)})")


def estimate_source_memory(weights: int | None, hidden: int, heads: int, intermediate: int, context_length: int,
                           read_batch: int, fill_rows: int, n_sites: int, d_in: int,
                           act_bytes: int = 4) -> SourceMemory:
    """The model source's bytes per device (see the module docstring)."""
    tokens = read_batch * context_length
    forward = act_bytes * (tokens * (6 * hidden + 2 * intermediate + n_sites * hidden)
                           + 2 * read_batch * heads * context_length ** 2)
    fill = FILL_COPIES * fill_rows * n_sites * d_in * act_bytes
    return SourceMemory(weights, forward, fill, fill_rows, n_sites, read_batch, context_length)


def config_sizes(config) -> tuple[int, int, int]:
    """(hidden, attention heads, MLP width) of a transformers config, across the names models use
    (GPT-2's n_inner None means 4 x n_embd)."""
    hidden = int(_first(config, "hidden_size", "n_embd", "d_model", "dim") or 0)
    heads = int(_first(config, "num_attention_heads", "n_head", "n_heads") or 1)
    inner = int(_first(config, "intermediate_size", "n_inner", "ffn_dim", "hidden_dim") or 4 * hidden)
    return hidden, heads, inner


def _first(config, *names: str):
    return next((getattr(config, n) for n in names if getattr(config, n, None)), None)


def safetensors_bytes(directory: Path) -> int | None:
    """The bytes of every tensor in a model directory's safetensors files, from their headers
    (8 bytes of length, then JSON: each tensor's dtype and shape); None without such a file."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(_DTYPE_BYTES.get(t["dtype"], 4) * math.prod(t["shape"])
                     for name, t in header.items() if name != "__metadata__")
    return total


def for_model_config(config, weights: int | None, n_sites: int, d_in: int, context_length: int, global_batch: int,
                     read_batch: int, fill_batches: int, total_rows: int | None = None) -> SourceMemory:
    """The estimate for a model (its transformers config) read as the model source reads it: fills
    of `fill_batches` global batches (at most the text's `total_rows`, where known), forward
    passes of `read_batch` contexts."""
    hidden, heads, inner = config_sizes(config)
    fill_rows = fill_batches * global_batch if total_rows is None else min(fill_batches * global_batch, total_rows)
    return estimate_source_memory(weights, hidden, heads, inner, context_length, read_batch, fill_rows, n_sites, d_in)


def model_directory(name: str) -> Path | None:
    """A model's directory on disk: the path itself, or the Hugging Face cache's snapshot of that
    name (never a download); None when neither is there."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache, or no hub client: the weights stay unknown
        return None
