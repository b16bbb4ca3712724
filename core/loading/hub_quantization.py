"""Hub checkpoints stored in packed quantized formats: which linears get which linear method.

``config.json``'s ``quantization_config`` names the format:

- compressed-tensors ``pack-quantized`` 4-bit int weights (W4A16, group or channel scales,
  symmetric or with packed zero points, optional ``weight_g_idx``) → `Int4Linear`;
- compressed-tensors ``float-quantized`` FP8 e4m3 weights (``weight_scale`` per channel, per
  tensor or per block) → `FP8Linear`;
- ``quant_method: "fp8"`` (``weight_scale_inv`` per ``weight_block_size`` block, or per tensor) → `FP8Linear`;
- ``quant_method: "awq"`` (``version: "gemm"``, 4 bits) and ``"gptq"`` (4 bits, any ``group_size``,
  ``desc_act``; the classic ``checkpoint_format: "gptq"`` stores zero - 1, ``"gptq_v2"`` the zero) → `Int4Linear`.

Activations are not quantized whatever the config says (FP8 ``input_activations``/``activation_scheme``):
the methods multiply the run dtype's activations by the exact weights; static ``input_scale``
tensors are not loaded. Compressed-tensors int8 (``int-quantized``) stays `layerzoo.loading.compressed_tensors`'.
Anything else is a `UserError` naming the key and its value.

A linear gets its method's module where its checkpoint tensors are packed (``weight_packed``,
``qweight``, an FP8 ``weight``); the module's parameters are named like the checkpoint's tensors, so
the strict loader fills them. A module the config's ``ignore`` / ``modules_to_not_convert`` names
keeps its plain linear, and so do stacked MoE experts and plugins' own modules: their packed
tensors, if any, load dequantized (exactly) into the plain weight. Under tensor parallelism a
method's module is cut like the plain column- or row-parallel linear it replaces (its `split`):
each rank reads only its slices of the packed tensors; a cut inside a packed word, scale group
or FP8 block is a `SplitError` naming the layer.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import attrs
import torch
from torch import nn

from layerzoo.errors import UserError
from layerzoo.loading.loader import Checkpoint

log = logging.getLogger(__name__)

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn",) if hasattr(torch, n))
HIDDEN = ("input_scale", "input_zero_point")  # activation quantization we do not apply


@attrs.frozen
class Scheme:
    """What a checkpoint's linears are stored as."""

    method: str  # "int4" or "fp8"
    fmt: str  # int4: compressed | awq | gptq; fp8: compressed | fp8
    group: int = 0  # int4: input columns per scale (0: the whole row)
    symmetric: bool = True
    zero_offset: int = 0  # gptq: added to the stored zero
    ignore: tuple[str, ...] = ()
    substrings: bool = False  # ignore entries match as substrings (AWQ's modules_to_not_convert)
    block: tuple[int, int] | None = None  # fp8: the weight block of a scale


def _refuse(where: str, key: str, value: Any, expected: str) -> UserError:
    return UserError(f"{where}: quantization_config.{key}: {value!r} is not supported; expected {expected}")


def scheme_of(hf_config: dict[str, Any], where: str = "config.json") -> Scheme | None:
    """The format of a config's ``quantization_config`` this module reads, None without one (or for
    compressed-tensors int8, which `layerzoo.loading.compressed_tensors` reads); a `UserError` otherwise."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UserError(f"{where}: quantization_config: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_scheme(qc, where)
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse(where, "fmt", fmt, "'e4m3'")
        block = qc.get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2):
            raise _refuse(where, "weight_block_size", block, "[rows, columns] or null")
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise _refuse(where, "activation_scheme", qc.get("activation_scheme"), "'dynamic' or 'static'")
        return Scheme("fp8", "fp8", ignore=tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()),
                      block=None if block is None else (int(block[0]), int(block[1])))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(where, "version", qc.get("version"), "'gemm'")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise _refuse(where, "bits", bits, "4")
        if qc.get("zero_point", True) is not True:
            raise _refuse(where, "zero_point", qc.get("zero_point"), "true")
        group = qc.get("group_size", qc.get("q_group_size"))
        return Scheme("int4", "awq", _group(group, where, "group_size"), symmetric=False,
                      ignore=tuple(qc.get("modules_to_not_convert") or ()), substrings=True)
    if method == "gptq":
        if qc.get("bits") != 4:
            raise _refuse(where, "bits", qc.get("bits"), "4")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse(where, "checkpoint_format", fmt, "'gptq' or 'gptq_v2'")
        if qc.get("static_groups"):
            raise _refuse(where, "static_groups", qc.get("static_groups"), "false")
        return Scheme("int4", "gptq", _group(qc.get("group_size"), where, "group_size"), symmetric=bool(qc.get("sym", True)),
                      zero_offset=1 if fmt == "gptq" else 0,
                      ignore=tuple(qc.get("modules_to_not_convert") or ()), substrings=True)
    raise _refuse(where, "quant_method", method, "'compressed-tensors', 'fp8', 'awq' or 'gptq'")


def _group(group: Any, where: str, key: str) -> int:
    if group in (-1, None, 0):
        return 0
    if not isinstance(group, int) or group <= 0 or group % 32:
        raise _refuse(where, key, group, "a positive multiple of 32 or -1 (per channel)")
    return group


def _compressed_scheme(qc: dict[str, Any], where: str) -> Scheme | None:
    for key in ("sparsity_config", "transform_config"):
        value = qc.get(key)
        if value:
            shown = value.get("format", value) if isinstance(value, dict) else value
            if not (key == "sparsity_config" and shown == "dense"):
                raise _refuse(where, f"{key}.format" if isinstance(value, dict) else key, shown, "none")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UserError(f"{where}: quantization_config.config_groups: expected a non-empty object of quantization groups")
    schemes = set()
    for name, group in groups.items():
        group = group or {}
        fmt = group.get("format") or qc.get("format")
        key = f"config_groups.{name}"
        if fmt in ("int-quantized", "naive-quantized"):
            schemes.add(None)  # int8: layerzoo.loading.compressed_tensors reads it
            continue
        weights = group.get("weights") or {}
        acts = group.get("input_activations")
        if fmt == "pack-quantized":
            for field, expected in (("num_bits", 4), ("type", "int")):
                if weights.get(field) != expected:
                    raise _refuse(where, f"{key}.weights.{field}", weights.get(field), repr(expected))
            strategy = weights.get("strategy")
            if strategy not in ("group", "channel"):
                raise _refuse(where, f"{key}.weights.strategy", strategy, "'group' or 'channel'")
            if weights.get("dynamic"):
                raise _refuse(where, f"{key}.weights.dynamic", weights.get("dynamic"), "false")
            if acts:
                raise _refuse(where, f"{key}.input_activations", acts, "null (W4A16)")
            size = _group(weights.get("group_size"), where, f"{key}.weights.group_size") if strategy == "group" else 0
            if strategy == "group" and size == 0:
                raise _refuse(where, f"{key}.weights.group_size", weights.get("group_size"), "a positive multiple of 32")
            schemes.add(Scheme("int4", "compressed", size, symmetric=weights.get("symmetric", True) is not False,
                               ignore=tuple(qc.get("ignore") or ())))
        elif fmt == "float-quantized":
            for field, expected in (("num_bits", 8), ("type", "float")):
                if weights.get(field) != expected:
                    raise _refuse(where, f"{key}.weights.{field}", weights.get(field), repr(expected))
            if weights.get("strategy") not in ("channel", "tensor", "block"):
                raise _refuse(where, f"{key}.weights.strategy", weights.get("strategy"), "'channel', 'tensor' or 'block'")
            if weights.get("symmetric", True) is False:
                raise _refuse(where, f"{key}.weights.symmetric", False, "true")
            if acts and (acts.get("type") != "float" or acts.get("num_bits") != 8):
                raise _refuse(where, f"{key}.input_activations", acts, "null or FP8 (activations stay unquantized)")
            block = weights.get("block_structure")
            schemes.add(Scheme("fp8", "compressed", ignore=tuple(qc.get("ignore") or ()),
                               block=tuple(block) if weights.get("strategy") == "block" and block else None))
        else:
            raise _refuse(where, "format" if group.get("format") is None else f"{key}.format", fmt,
                          "'pack-quantized', 'float-quantized', 'int-quantized' or 'naive-quantized'")
    if len(schemes) > 1:
        raise UserError(f"{where}: quantization_config.config_groups: groups in different formats "
                        f"({', '.join(sorted(str(s.method if s else 'int8') for s in schemes))}) are not supported together")
    return schemes.pop()


def _ignored(scheme: Scheme, name: str) -> bool:
    for entry in scheme.ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry) or (scheme.substrings and entry in name):
            return True
    return False


# The tensors of a linear in each format (besides bias); the first one marks the format.
INT4_LEAVES = {
    "compressed": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
}
FP8_LEAVES = {"compressed": ("weight", "weight_scale"), "fp8": ("weight", "weight_scale_inv", "weight_scale")}


class _View(Checkpoint):
    """The checkpoint as the loader sees it: activation scales hidden, and the packed tensors of a
    linear that keeps a plain module (stacked experts, a plugin's own module, one the ignore list
    names) shown as one fp32 ``<prefix>.weight``, dequantized exactly when read."""

    def __init__(self, source: Checkpoint, hidden: set[str], dequantized: dict):
        tensors = {k: v for k, v in source._tensors.items() if k not in hidden}
        for key, (_, leaves, shape) in dequantized.items():
            tensors[key] = attrs.evolve(source._info(leaves[min(leaves)]), dtype=torch.float32, shape=shape)
        super().__init__(source.directory, tensors)
        self._source, self._dequantized = source, dequantized

    def get(self, name: str) -> torch.Tensor:
        self._info(name)
        entry = self._dequantized.get(name)
        if entry is None:
            return self._source.get(name)
        scheme, leaves, (n, k) = entry
        shapes = {lf: (tuple(self._source.shape(ck)), self._source.dtype(ck)) for lf, ck in leaves.items()}
        module = _method(scheme, k, n, shapes, False, torch.float32, name)
        for lf, ck in leaves.items():
            setattr(module, lf, nn.Parameter(self._source.get(ck), requires_grad=False))
        module.process_weights_after_loading()
        return module.dequantized_weight()

    def get_part(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """A tensor-parallel rank's rows: read as a slice where the source stores the tensor as it
        loads (the packed tensors of a split method), cut from the whole where dequantized."""
        if name in self._dequantized:
            return super().get_part(name, dim, ranges)
        self._info(name)
        return self._source.get_part(name, dim, ranges)

    def _handle(self, path):
        return self._source._handle(path)


def quantized_linears(model: nn.Module, hf_config: dict[str, Any], checkpoint: Checkpoint, name_map, dtype: torch.dtype,
                      source: str = "config.json") -> Checkpoint | None:
    """Replace the (meta-device) ``nn.Linear`` modules whose checkpoint tensors are packed by their
    method's module; returns the checkpoint to load (None: unchanged, no such format). Packed
    tensors of anything else (stacked experts, a plugin's own module, a module the ignore list
    names) load dequantized, exactly, into its plain weight."""
    config_cls = type(getattr(model, "config", None))
    if attrs.has(config_cls) and "quantization_config" in attrs.fields_dict(config_cls):
        return None  # the plugin reads its own (Kimi K3's MXFP4 experts)
    scheme = scheme_of(hf_config, source)
    if scheme is None:
        return None
    leaves = INT4_LEAVES[scheme.fmt] if scheme.method == "int4" else FP8_LEAVES[scheme.fmt]
    keys = set(checkpoint.keys())
    mapped = name_map or (lambda key: key)
    replaced = 0
    hidden: set[str] = set()
    dequantized: dict[str, tuple[Scheme, dict[str, str], tuple[int, int]]] = {}
    for key in sorted(keys):
        prefix, _, leaf = key.rpartition(".")
        if leaf in HIDDEN:
            hidden.add(key)
            continue
        if leaf != leaves[0] or (scheme.method == "fp8" and checkpoint.dtype(key) not in FP8_DTYPES):
            continue
        tensors = {lf: f"{prefix}.{lf}" for lf in leaves if f"{prefix}.{lf}" in keys}
        target = mapped(f"{prefix}.weight")
        name = getattr(target, "name", target)
        path = name[: -len(".weight")] if isinstance(name, str) and name.endswith(".weight") else None
        keep = (path is not None and not getattr(target, "grid", ()) and not _ignored(scheme, path)
                and not _ignored(scheme, prefix) and _plain_linear(model, path)
                and all(getattr(mapped(ck), "name", mapped(ck)) == f"{path}.{lf}" for lf, ck in tensors.items()))
        if keep:
            _replace(model, path, scheme, {lf: (tuple(checkpoint.shape(ck)), checkpoint.dtype(ck)) for lf, ck in tensors.items()},
                     dtype)
            replaced += 1
        else:
            shapes = {lf: tuple(checkpoint.shape(ck)) for lf, ck in tensors.items()}
            dequantized[f"{prefix}.weight"] = (scheme, tensors, _logical_shape(scheme, shapes))
            hidden.update(tensors.values())
    log.info("%s: %d linears kept as %s (%s) weights, %d dequantized (stacked experts, other modules, ignored)",
             source, replaced, scheme.method, scheme.fmt, len(dequantized))
    return _View(checkpoint, hidden, dequantized) if hidden or dequantized else None


def _logical_shape(scheme: Scheme, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """``(out, in)`` of a packed linear from its tensors' shapes (headers only)."""
    if scheme.method == "fp8":
        return tuple(shapes["weight"])
    if scheme.fmt == "compressed":
        rows, words = shapes["weight_packed"]
        return rows, words * 8
    rows, cols = shapes["qweight"]
    return (cols * 8, rows) if scheme.fmt == "awq" else (cols, rows * 8)


def _plain_linear(model: nn.Module, path: str) -> bool:
    parent_path, _, attr = path.rpartition(".")
    try:
        parent = model.get_submodule(parent_path) if parent_path else model
    except AttributeError:
        return False
    return type(getattr(parent, attr, None)) is nn.Linear


def _method(scheme: Scheme, in_features: int, out_features: int, tensors: dict, bias: bool, dtype: torch.dtype, name: str):
    """The linear method module of ``scheme`` for tensors ``leaf -> (shape, dtype)``."""
    if scheme.method == "int4":
        from layerzoo.layers.int4_linear import Int4Linear

        return Int4Linear(in_features, out_features, scheme.fmt, tensors, scheme.group, bias, dtype, symmetric=scheme.symmetric,
                          zero_offset=scheme.zero_offset, name=name)
    from layerzoo.layers.fp8_linear import FP8Linear

    return FP8Linear(in_features, out_features, tensors, bias, dtype, block=scheme.block, name=name)


def _replace(model: nn.Module, path: str, scheme: Scheme, tensors: dict, dtype: torch.dtype) -> None:
    """Put the method's module in place of the plain linear at ``path``, cut to the piece that
    linear holds under tensor parallelism (a `SplitError` where the format's blocks forbid it)."""
    from layerzoo.layers.parallel_linear import split_like, whole_features

    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    module = getattr(parent, attr)
    in_features, out_features = whole_features(module)
    with torch.device("meta"):
        replacement = _method(scheme, in_features, out_features, tensors, module.bias is not None, dtype, path)
        split_like(replacement, module)
    setattr(parent, attr, replacement)
