"""From a checkpoint directory to a built, loaded model with its capabilities.

`load_model` reads ``config.json``, finds the plugin serving the architecture, builds the model on
the meta device, loads the weights strictly (`layerzoo.loader`), packs linear weights for the CPU
and asks every layer the capability queries. The model classes (`layerzoo.model`) know nothing of
checkpoints; the runtime receives a `LoadedModel`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from layerzoo.capabilities import LayerCapabilities, ModelCapabilities
from layerzoo.compressed_tensors import DequantizedCheckpoint, compressed_int8_scheme
from layerzoo.config import DecoderConfig, architecture_of, parse_dtype, read_hf_config
from layerzoo.engine_args import EngineArgs
from layerzoo.kv_cache import parse_kv_cache_dtype
from layerzoo.layers.linear import pack_linears
from layerzoo.loader import Checkpoint, load_weights
from layerzoo.model import CausalLM

log = logging.getLogger(__name__)


@attrs.frozen
class LoadedModel:
    model: CausalLM
    config: DecoderConfig
    hf_config: dict[str, Any]
    architecture: str
    plugin: str
    model_dir: Path
    dtype: torch.dtype


def resolve_dtype(requested: Any, hf_config: dict[str, Any], device: str) -> torch.dtype:
    """The compute dtype: ``auto`` follows the checkpoint, except on CPU where it is fp32.

    CPUs without native bf16 arithmetic (AVX2) run bf16 matmuls emulated and slower than fp32.
    """
    if requested == "auto" and device == "cpu":
        return torch.float32
    return parse_dtype(requested, hf_config.get("dtype") or hf_config.get("torch_dtype"))


def gather_capabilities(model: CausalLM, registry, engine_config: EngineArgs | None) -> ModelCapabilities:
    """Ask the capability queries about every decoder layer and reduce the answers."""
    layers = [
        LayerCapabilities.gather(
            registry.pm,
            layer_index=i,
            layer_kind=registry.layer_kind_of(layer),
            layer=layer,
            engine_config=engine_config,
        )
        for i, layer in enumerate(model.layers)
    ]
    return ModelCapabilities.from_layers(layers)


def load_model(model_dir: Path, engine_config: EngineArgs | None = None, registry=None) -> LoadedModel:
    """Build the architecture named in ``config.json`` and load its weights strictly."""
    from layerzoo.plugins import get_registry
    from layerzoo.runtime.fp8_calibration import kv_scale_name_map

    registry = registry or get_registry()
    engine_config = engine_config or EngineArgs()
    model_dir = Path(model_dir)
    hf_config = read_hf_config(model_dir)
    architecture = architecture_of(hf_config, str(model_dir / "config.json"))
    registration = registry.architecture(architecture)
    model_cls = registry.model_class(architecture)
    config = model_cls.config_class.from_hf(hf_config, str(model_dir / "config.json"))
    dtype = resolve_dtype(engine_config.dtype, hf_config, engine_config.device)
    checkpoint = Checkpoint.open(model_dir)  # fail on a bad checkpoint before building anything
    quantization = engine_config.quantization
    if compressed_int8_scheme(hf_config, model_dir / "config.json") is not None:
        checkpoint, quantization = DequantizedCheckpoint.wrap(checkpoint), "int8"

    # Built on the meta device so that no time goes into random init of weights we overwrite.
    with torch.device("meta"):
        model = model_cls(config, engine_config)
    model = model.to_empty(device=engine_config.device).to(dtype)
    model.reset_buffers()
    mapping = registry.weight_mapping(architecture)
    name_map = mapping(config) if mapping is not None else None
    # FP8 KV scales the checkpoint carries load only into a model whose KV cache is FP8.
    fp8_kv = parse_kv_cache_dtype(engine_config.kv_cache_dtype) is not None
    name_map = kv_scale_name_map(model, checkpoint, fp8_kv, name_map)
    load_weights(model, checkpoint, dtype=dtype, name_map=name_map, tied=model.tied_weights())
    model.eval()
    shared = {id(model.get_parameter(name)) for pair in model.tied_weights().items() for name in pair}
    packed = pack_linears(model, shared, quantization)
    log.debug("packed %d linear weights (%s)", packed, quantization or "oneDNN fp32")
    model.capabilities = gather_capabilities(model, registry, engine_config)
    model.capabilities.log_disabled(log)
    return LoadedModel(model, config, hf_config, architecture, registration.plugin, model_dir, dtype)
