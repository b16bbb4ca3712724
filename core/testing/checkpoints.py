"""Tiny random checkpoints written by transformers, for the conformance kit's test configs.

transformers is a test dependency only: it is imported when a checkpoint is written, never when a
plugin registers its test configs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Large enough that greedy steps are not near-ties between two tokens.
INIT_RANGE = 0.25


def write_transformers_checkpoint(path: str | Path, config: dict[str, Any], seed: int = 0) -> None:
    """Build the random transformers model ``config`` names (``architectures[0]``, ``model_type``),
    perturb the parameters that start at an identity (``(1 + w)`` norms, ``A_log``, ``dt_bias``,
    router biases) so a wrong formula cannot hide, and save it (safetensors) with a word tokenizer.
    """
    import torch
    import transformers

    from layerzoo.testing import write_word_tokenizer

    config = dict(config)
    architecture = config["architectures"][0]
    model_type = config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    hf_config.initializer_range = INIT_RANGE
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"  # grouped_mm experts reject odd shapes on CPU
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    path = Path(path)
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    assert saved.get("architectures") == [architecture], saved.get("architectures")
    write_word_tokenizer(path, hf_config.get_text_config().vocab_size)
