"""Text into fixed-length model contexts: pure functions over token ids, tested with plain lists.

Documents are tokenised without special tokens and joined by a separator token, then cut into
windows that fill a context exactly once the model's own special tokens (BERT's [CLS] ... [SEP],
a decoder's BOS) are wrapped around them. The last window may be short: it is padded, and the
mask says which positions hold text. Special tokens and padding are never harvested.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sae_dist.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


def text_files(paths: list[str]) -> list[Path]:
    """Every text file named, or found below a named directory, in a stable order."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        elif path.is_file():
            found.append(path)
        else:
            raise UserError(f"--text {raw}: no such file or directory")
    if not found:
        raise UserError(f"--text {' '.join(paths)}: no text files ({', '.join(TEXT_SUFFIXES)}) found")
    return found


@dataclass(frozen=True)
class Framing:
    """The special tokens a tokenizer wraps around a text, and what pads a short context."""

    prefix: list[int]
    suffix: list[int]
    pad_id: int

    def window(self, context_length: int) -> int:
        room = context_length - len(self.prefix) - len(self.suffix)
        if room < 1:
            raise UserError(f"--context-length {context_length}: leaves no room for text besides the "
                            f"model's {len(self.prefix) + len(self.suffix)} special tokens")
        return room


def framing_from_examples(with_special: list[int], without: list[int], pad_id: int) -> Framing:
    """Read the prefix and suffix off one text encoded with and without special tokens."""
    n = len(without)
    for start in range(len(with_special) - n + 1):
        if with_special[start:start + n] == without:
            return Framing(with_special[:start], with_special[start + n:], pad_id)
    raise UserError("the tokenizer's special tokens do not wrap the text; this tokenizer is not supported")


def join_documents(documents: list[list[int]], separator: int | None) -> list[int]:
    """One token stream; documents apart by the separator (SEP or EOS) where the tokenizer has one."""
    out: list[int] = []
    for i, doc in enumerate(d for d in documents if d):
        if i and separator is not None:
            out.append(separator)
        out += doc
    return out


@dataclass(frozen=True)
class Context:
    ids: list[int]  # context_length token ids, padded
    harvest: list[bool]  # True where a text token sits (not a special token, not padding)
    length: int  # tokens before the padding (the attention mask's ones)


def batch_inputs(batch: list[Context], device) -> tuple:
    """A batch of contexts as the model reads them, on `device`: (token ids, the attention mask:
    ones before each context's padding, where text tokens sit: the rows a harvest keeps). Torch is
    imported here only: this module stays torch-free."""
    import torch

    ids = torch.tensor([c.ids for c in batch], device=device)
    lengths = torch.tensor([c.length for c in batch], device=device)
    attention = (torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]).long()
    return ids, attention, torch.tensor([c.harvest for c in batch], device=device)


def make_contexts(tokens: list[int], framing: Framing, context_length: int,
                  max_tokens: int | None = None) -> list[Context]:
    """The contexts of a token stream; max_tokens bounds the text tokens harvested (the last
    context is cut short)."""
    room = framing.window(context_length)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    contexts = []
    for start in range(0, len(tokens), room):
        text = tokens[start:start + room]
        ids = framing.prefix + text + framing.suffix
        mask = [False] * len(framing.prefix) + [True] * len(text) + [False] * len(framing.suffix)
        pad = context_length - len(ids)
        contexts.append(Context(ids + [framing.pad_id] * pad, mask + [False] * pad, len(ids)))
    return contexts
