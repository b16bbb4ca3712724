"""Helpers for tests of layerzoo and its plugins: tiny checkpoints that need no download.

Nothing here imports transformers; plugin test suites build their reference models with it and
use these helpers for the rest of a checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_word_tokenizer(model_dir: str | Path, vocab_size: int, eos_token_id: int | None = None) -> None:
    """A word-level ``tokenizer.json`` whose ids 0..vocab_size-1 are the words ``t0 t1 ...``.

    Every id a tiny random model can produce decodes, so generated ids round-trip as text.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    model_dir = Path(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if eos_token_id is not None:
        config["eos_token"] = f"t{eos_token_id}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
