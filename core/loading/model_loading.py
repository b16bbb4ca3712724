"""From a checkpoint directory to a built, loaded model with its capabilities.

`load_model` reads ``config.json``, finds the plugin serving the architecture, builds the model on
the meta device, loads the weights strictly (`layerzoo.loading.loader`), packs linear weights for the CPU
and asks every layer the capability queries. The model classes (`layerzoo.layers.model`) know nothing of
checkpoints; the runtime receives a `LoadedModel`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from layerzoo.config import DecoderConfig, architecture_of, check_generation_config, parse_dtype, read_hf_config
from layerzoo.distributed.sharding import check_shardable
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import CheckpointError
from layerzoo.layers.kv_cache import parse_kv_cache_dtype
from layerzoo.layers.linear import pack_linears
from layerzoo.layers.linear_method import LinearMethod
from layerzoo.layers.model import CausalLM
from layerzoo.loading.compressed_tensors import DequantizedCheckpoint, compressed_int8_scheme
from layerzoo.loading.hub_quantization import quantized_linears
from layerzoo.loading.loader import Checkpoint, load_weights
from layerzoo.plugins.capabilities import LayerCapabilities, ModelCapabilities

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
    return ModelCapabilities.from_layers(layers, stateful_layers=model.state_specs())


# Answers that promise methods: a layer giving one must override these `DecoderLayer` methods.
PROMISED_METHODS = {
    ("is_ssm_layer", True): ("prefill_phase1", "prefill_phase3"),
    ("uses_ssm_pool", False): ("alloc_state",),  # release_state defaults to doing nothing
    ("keeps_per_draft_states", True): ("keep_verified_rows",),
}


def check_promised_methods(model: CausalLM, caps: ModelCapabilities) -> None:
    """Fail at build, naming the layer, when an answer promises methods its class does not have
    (rather than a NotImplementedError at the first step that needs them)."""
    from layerzoo.errors import PluginError
    from layerzoo.layers.base import DecoderLayer
    from layerzoo.layers.split_prefill import SplitPrefillLayer

    for lc in caps.layers:
        cls = type(model.layers[lc.layer_index])
        for (query, value), methods in PROMISED_METHODS.items():
            if lc.answers[query] != value:
                continue
            missing = [m for m in methods if _is_stub(getattr(cls, m, None), m, (DecoderLayer, SplitPrefillLayer))]
            if missing:
                raise PluginError(
                    f"layer {lc.layer_index} ({cls.__name__}, kind {lc.layer_kind}) answers {query}={value} "
                    f"(plugin {lc.answered_by[query] or 'default'}) but does not implement {', '.join(missing)}"
                )


def _is_stub(method, name: str, bases: tuple[type, ...]) -> bool:
    """Absent, or the stub of a base class that declares ``name``."""
    return method is None or any(method is getattr(base, name, object()) for base in bases)


def open_gguf(model_dir: Path):
    """The opened GGUF file `model_dir` names (the file, or a directory holding one), or None."""
    from layerzoo.loading.gguf_loading import GGUFModel, find_gguf

    path = find_gguf(model_dir)
    return GGUFModel.open(path) if path is not None else None


def keep_gguf_blocks(model: CausalLM, gguf, name_map, engine_config: EngineArgs, dtype: torch.dtype):
    """Give the linears (and the embedding) whose GGUF weights are in a block format the C++ kernels
    multiply their GGUF modules (routed experts too: `layerzoo.layers.gguf_experts`), and return the
    checkpoint that serves those weights as blocks; None where the weights are dequantized instead: ``dtype=`` or ``quantization=`` asked for another
    format, or no C++ kernels to run them (CUDA, none built). Under tensor parallelism each rank
    keeps its piece of the blocks (`GGUFLinear.split`); a layer whose input columns do not split
    on block boundaries is dequantized alone, with a warning."""
    from layerzoo.kernels.gguf_matmul import cpu as gguf_cpu
    from layerzoo.layers.gguf_experts import keep_expert_blocks
    from layerzoo.layers.gguf_linear import keep_blocks

    why = None
    if engine_config.dtype != "auto" or engine_config.quantization is not None:
        why = f"dtype={engine_config.dtype!r}, quantization={engine_config.quantization!r} asked for"
    elif engine_config.device != "cpu" or not gguf_cpu.available():
        why = f"no C++ kernels for them on {engine_config.device}"
    if why is not None:
        log.info("%s: weights dequantized to %s (%s)", gguf.path.name, dtype, why)
        return None
    native = keep_blocks(model, gguf.block_types(), name_map, model.tied_weights(), dtype, gguf_cpu.SUPPORTED_TYPES)
    native |= keep_expert_blocks(model, gguf.expert_block_types(), name_map, gguf_cpu.SUPPORTED_TYPES)
    log.info("%s: %d weights kept in their GGUF block formats", gguf.path.name, len(native))
    return gguf.checkpoint(native) if native else None


def mtp_name_map(model: CausalLM, checkpoint, name_map):
    """The name map for the model's MTP head: without a head, keys that would load into one are
    skipped; with one, the head's own tensors must be in the checkpoint (named as it spells them)."""
    from layerzoo.layers.mtp import drop_head_targets

    if model.mtp is None:
        return drop_head_targets(name_map) if name_map is not None else None
    spellings = [key if isinstance(key, tuple) else (key,) for key in model.mtp_checkpoint_keys()]
    missing = [keys[0] for keys in spellings if not any(key in checkpoint for key in keys)]
    if missing:
        raise CheckpointError(
            f"checkpoint {checkpoint.directory} lacks the MTP head's tensor {missing[0]} (its config declares "
            f"{model.num_mtp_layers()} MTP layer(s), and speculative_config method 'mtp' loads it); use another "
            f"speculative method, or none, to serve the model without its head"
        )
    return name_map


def bare_decoder_architecture(architecture: str, checkpoint: Checkpoint, registry) -> str | None:
    """The ``...Model`` architecture to load a ``...ForCausalLM`` checkpoint as, when it holds only
    the bare decoder (transformers' ``Qwen3Model`` save: ``embed_tokens.weight`` without the
    ``model.`` prefix, no ``lm_head``) and a plugin registers that architecture; else None.
    Qwen3-Embedding's config names ``Qwen3ForCausalLM`` over such a checkpoint: it loads as the
    embedder it is instead of failing on its first key."""
    bare = architecture.removesuffix("ForCausalLM") + "Model"
    if bare == architecture + "Model" or registry.architectures.get(bare) is None:
        return None
    if "embed_tokens.weight" not in checkpoint or "lm_head.weight" in checkpoint or "model.embed_tokens.weight" in checkpoint:
        return None
    log.info("%s: the checkpoint holds a bare decoder (no lm_head, keys without 'model.'): loading it as %s, an "
             "embedding model", architecture, bare)
    return bare


def load_model(model_dir: Path, engine_config: EngineArgs | None = None, registry=None) -> LoadedModel:
    """Build the architecture named in ``config.json`` (or a GGUF file's metadata) and load its
    weights strictly."""
    from layerzoo.plugins.manager import get_registry
    from layerzoo.runtime.fp8_calibration import kv_scale_name_map

    registry = registry or get_registry()
    engine_config = engine_config or EngineArgs()
    model_dir = Path(model_dir)
    gguf = open_gguf(model_dir)  # a GGUF file carries config and weights in one file
    hf_config = gguf.hf_config if gguf else read_hf_config(model_dir)
    source = str(gguf.path) if gguf else str(model_dir / "config.json")
    architecture = architecture_of(hf_config, source)
    registration = registry.architecture(architecture)
    model_cls = registry.model_class(architecture)
    config = model_cls.config_class.from_hf(hf_config, source)
    vocab_size = getattr(config, "vocab_size", None)
    if not gguf and vocab_size:  # a GGUF file's EOS ids are its metadata's, checked with its config
        check_generation_config(model_dir, vocab_size)
    dtype = resolve_dtype(engine_config.dtype, hf_config, engine_config.device)
    # fail on a bad checkpoint before building anything
    checkpoint = gguf.checkpoint() if gguf else Checkpoint.open(model_dir)
    if not gguf and (bare := bare_decoder_architecture(architecture, checkpoint, registry)) is not None:
        architecture, registration, model_cls = bare, registry.architecture(bare), registry.model_class(bare)
        config = model_cls.config_class.from_hf(hf_config, source)
    quantization = engine_config.quantization
    # A plugin whose config reads ``quantization_config`` (Kimi K3's MXFP4 experts) handles its own.
    plugin_reads_quantization = attrs.has(model_cls.config_class) and "quantization_config" in attrs.fields_dict(model_cls.config_class)
    if not gguf and not plugin_reads_quantization and compressed_int8_scheme(hf_config, model_dir / "config.json") is not None:
        checkpoint, quantization = DequantizedCheckpoint.wrap(checkpoint), "int8"

    # Built on the meta device so that no time goes into random init of weights we overwrite.
    with torch.device("meta"):
        model = model_cls(config, engine_config)
    check_shardable(model, registry.layer_kind_of)  # tensor parallel: refuse an unsplittable layer now
    mapping = registry.weight_mapping(architecture)
    name_map = mapping(config) if mapping is not None else None
    name_map = mtp_name_map(model, checkpoint, name_map)
    if gguf is not None:
        checkpoint = keep_gguf_blocks(model, gguf, name_map, engine_config, dtype) or checkpoint
    # hub quantization formats: linears whose checkpoint tensors are packed get their method's module here
    checkpoint = quantized_linears(model, hf_config, checkpoint, name_map, dtype, source) or checkpoint
    model = model.to_empty(device=engine_config.device).to(dtype)
    model.reset_buffers()
    model.to(engine_config.device)  # buffers a reset built on the default device (rotary tables on CPU for a CUDA run)
    # FP8 KV scales the checkpoint carries load only into a model whose KV cache is FP8.
    fp8_kv = parse_kv_cache_dtype(engine_config.kv_cache_dtype) is not None
    name_map = kv_scale_name_map(model, checkpoint, fp8_kv, name_map)
    load_weights(model, checkpoint, dtype=dtype, name_map=name_map, tied=model.tied_weights())
    # Weights stored in another form than the model computes with (e.g. MXFP4 experts) become
    # the model's own here, after the strict load and before packing.
    getattr(model, "process_weights_after_loading", lambda: None)()
    for module in model.modules():  # linear methods repack what they loaded into their kernels' layout
        if isinstance(module, LinearMethod):
            module.process_weights_after_loading()
    model.eval()
    shared = {id(model.get_parameter(name)) for pair in model.tied_weights().items() for name in pair}
    packed = pack_linears(model, shared, quantization)
    log.debug("packed %d linear weights (%s)", packed, quantization or "oneDNN fp32")
    model.capabilities = gather_capabilities(model, registry, engine_config)
    check_promised_methods(model, model.capabilities)
    model.capabilities.log_disabled(log)
    return LoadedModel(model, config, hf_config, architecture, registration.plugin, model_dir, dtype)
