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
    import transformers

    from layerzoo.testing import write_word_tokenizer

    config = dict(config)
    architecture = config["architectures"][0]
    model_type = config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    model = random_transformers_model(hf_config, architecture, seed)
    path = Path(path)
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    assert saved.get("architectures") == [architecture], saved.get("architectures")
    write_word_tokenizer(path, hf_config.get_text_config().vocab_size)


def random_transformers_model(hf_config, architecture: str, seed: int = 0):
    """transformers' ``architecture`` class built from ``hf_config`` (eager attention and experts),
    random at `INIT_RANGE`, with the parameters that start at an identity (``(1 + w)`` norms,
    ``A_log``, ``dt_bias``, router biases) perturbed so a wrong formula cannot hide."""
    import torch
    import transformers

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
    return model


def write_random_checkpoint(path: str | Path, config: dict[str, Any], seed: int = 0) -> None:
    """Write a random checkpoint for an architecture that no transformers class builds (a new
    architecture, Kimi K3): the registered layerzoo model class itself, random parameters, saved in
    safetensors under the model's own parameter names, with ``config.json`` and a word tokenizer.

    The architecture's weight mapping must load the model's own names unchanged (every mapping
    that renames only the checkpoint's spelling does). Parameters draw from ``N(0, INIT_RANGE)``;
    1-D ones (norms, biases, ``A_log``, ``dt_bias``) from ``1 + N(0, 0.2)`` for norm weights and
    ``N(0, 0.2)`` otherwise, so no formula hides behind an identity. Tied parameters are saved once.
    """
    import torch
    from safetensors.torch import save_file

    from layerzoo.config import architecture_of, read_hf_config
    from layerzoo.engine_args import EngineArgs
    from layerzoo.plugins.manager import get_registry
    from layerzoo.testing import write_word_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = str(path / "config.json")
    (path / "config.json").write_text(json.dumps(config, indent=1))
    hf_config = read_hf_config(path)  # a wrapper's text_config, flattened as the loader reads it
    model_cls = get_registry().model_class(architecture_of(hf_config, source))
    model_config = model_cls.config_class.from_hf(hf_config, source)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = model_cls(model_config, EngineArgs())
    model = model.to_empty(device="cpu").to(torch.float32)
    model.reset_buffers()
    tied = set(model.tied_weights())
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in tied:
                continue
            tensors[name] = _random_like(name, tensor, generator).contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    write_word_tokenizer(path, hf_config["vocab_size"])


def _random_like(name: str, tensor, generator):
    import torch

    if not tensor.is_floating_point():
        return tensor.clone()  # index buffers and the like keep what the model built
    noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
    if tensor.dim() >= 2:
        return noise * INIT_RANGE
    if name.endswith("norm.weight"):
        return 1 + noise * 0.2
    return noise * 0.2


def add_mtp_head(path: str | Path, layout: str, source_layer: int, seed: int = 0) -> list[str]:
    """Write an MTP head into the tiny checkpoint at ``path`` (transformers saves none: it drops the
    heads on load) and declare it in ``config.json``; returns the keys added.

    ``layout`` ``"nextn"`` (DeepSeek / GLM-5: ``model.layers.{L}.*`` with enorm, hnorm, eh_proj,
    shared_head.norm, ``num_nextn_predict_layers``) or ``"qwen"`` (Qwen3-Next / Qwen3.5: ``mtp.*``
    with pre_fc_norm_embedding / _hidden, fc, norm, ``mtp_num_hidden_layers``). The block is a
    perturbed copy of decoder layer ``source_layer`` (pick one of the kind the head's block is:
    full attention, MoE), so its keys and shapes are the model's own; norms are ``1 + noise`` (a
    zero-centred norm reads them as ``2 + noise``: any scale does for a random model).
    """
    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    file = path / "model.safetensors"
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    prefixes = [p for p in ("model.language_model.layers.", "model.layers.") if any(k.startswith(p) for k in tensors)]
    source = f"{prefixes[0]}{source_layer}."
    if layout == "nextn":
        head, block, names, key = f"model.layers.{layers}.", f"model.layers.{layers}.", ("enorm", "hnorm", "shared_head.norm"), "num_nextn_predict_layers"
        proj = "eh_proj"
    elif layout == "qwen":
        head, block, names, key = "mtp.", "mtp.layers.0.", ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"), "mtp_num_hidden_layers"
        proj = "fc"
    else:
        raise ValueError(f"layout: expected 'nextn' or 'qwen', got {layout!r}")
    added = {}
    for name, tensor in tensors.items():
        if name.startswith(source):
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
            added[block + name[len(source):]] = (tensor + 0.3 * noise * tensor.float().std().clamp(min=0.05).to(tensor.dtype)).contiguous()
    dtype = next(iter(tensors.values())).dtype
    for name in names:
        added[f"{head}{name}.weight"] = (1 + 0.2 * torch.randn(hidden, generator=generator)).to(dtype)
    added[f"{head}{proj}.weight"] = (INIT_RANGE * torch.randn(hidden, 2 * hidden, generator=generator)).to(dtype)
    tensors.update(added)
    save_file(tensors, file, metadata={"format": "pt"})
    text[key] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return sorted(added)


def copy_checkpoint(src: str | Path, dst: str | Path, edit) -> Path:
    """Copy the checkpoint folder ``src`` to ``dst`` with ``edit(tensors)`` applied to its
    ``model.safetensors`` (a dict of name -> tensor, changed in place): a broken or altered copy
    for a loader test."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
