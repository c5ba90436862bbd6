"""Variants of a test checkpoint folder, made by copying it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def with_other_tokenizer(model: Path, out: Path) -> Path:
    """A copy of `model` whose tokenizer swaps the ids of two tokens: the same size, other ids
    (a draft model speculative decoding must refuse)."""
    shutil.copytree(model, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.__getitem__)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out
