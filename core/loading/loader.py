"""Strict safetensors loading: every parameter written exactly once, every checkpoint key used.

`Checkpoint` indexes the tensors of a model directory from the safetensors headers alone and
reads each tensor on demand through memory-mapped `safe_open` handles. `load_weights` copies
them into a module, after checking the whole plan (names, shapes, dtypes, coverage) against the
headers, so a mismatch is reported before any data is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import attrs
import torch
from safetensors import safe_open

from layerzoo.distributed.sharding import Shard, parameter_shards
from layerzoo.entrypoints.progress import weight_loading_bar
from layerzoo.errors import CheckpointError
from layerzoo.loading.hub import refuse_pickle_only

__all__ = ["Checkpoint", "Target", "load_weights"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype names -> torch dtypes; the optional ones depend on the torch version.
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in [
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E8M0", "float8_e8m0fnu"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
]:
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

# A header larger than this is not a real safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


# --- reading headers --------------------------------------------------------------------------


@attrs.frozen
class _TensorInfo:
    """Where one checkpoint tensor lives and what it is, as its file's header says."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def _nbytes(info: _TensorInfo) -> int:
    return math.prod(info.shape) * info.dtype.itemsize


def _corrupt(path: Path, reason: str) -> CheckpointError:
    """Answers the error for a safetensors file that cannot be read."""
    return CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupt: {reason})")


def _read_header(path: Path) -> dict[str, _TensorInfo]:
    """Answers the tensors described by the header of `path`, checked against the file's size.

    The format is an 8-byte little-endian header length N, N bytes of JSON, then the data; a
    tensor whose data would end past the end of the file means the file was cut short.
    """
    _check_weight_file(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _corrupt(path, f"file is {size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8 or header_len > _MAX_HEADER:
                raise _corrupt(path, f"header of {header_len} bytes does not fit in a {size}-byte file")
            raw = f.read(header_len)
    except OSError as error:  # unreadable (permissions, I/O): one line naming the file
        raise CheckpointError(f"{path}: cannot read the safetensors file ({error.strerror or error})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(path, f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    data_size = size - 8 - header_len
    return {
        name: _tensor_info(path, name, entry, data_size)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def _check_weight_file(path: Path, expected: str = "a safetensors file") -> None:
    """Raises CheckpointError unless `path` is a file: a dangling symbolic link (a Hugging Face cache
    whose blob was deleted keeps the snapshot's link to it) or a directory of that name is named
    with what was expected there, instead of surfacing as a raw FileNotFoundError / IsADirectoryError."""
    if path.is_symlink() and not path.exists():
        raise CheckpointError(
            f"{path}: a symbolic link to {os.readlink(path)}, which does not exist (a partly deleted "
            f"Hugging Face cache?); expected {expected}: download the model again"
        )
    if path.is_dir():
        raise CheckpointError(f"{path}: a directory, expected {expected}")


def _tensor_info(path: Path, name: str, entry: object, data_size: int) -> _TensorInfo:
    """Answers the checked header entry `name` of `path`, whose data section has `data_size` bytes."""
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        shape = tuple(int(d) for d in shape)
        begin, end = int(begin), int(end)
    except (TypeError, KeyError, ValueError):
        raise _corrupt(path, f"header entry for key {name!r} is malformed") from None
    if dtype_name not in _DTYPES:
        raise CheckpointError(
            f"{path}: key {name!r} has dtype {dtype_name}, which layerzoo does not load "
            f"(supported: {', '.join(_DTYPES)})"
        )
    dtype = _DTYPES[dtype_name]
    if end > data_size:
        raise _corrupt(
            path,
            f"key {name!r} ends at data byte {end} but the file holds only {data_size} data bytes",
        )
    if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise _corrupt(path, f"key {name!r}: data_offsets {[begin, end]} do not fit shape {list(shape)}")
    return _TensorInfo(file=path, dtype=dtype, shape=shape, offset=begin)


# --- the checkpoint ---------------------------------------------------------------------------


class Checkpoint:
    """The safetensors tensors of a model directory, memory-mapped and read one at a time."""

    def __init__(self, directory: Path, tensors: dict[str, _TensorInfo]):
        self.directory = directory
        self._tensors = tensors
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, model_dir: str | Path) -> Checkpoint:
        """Answers the checkpoint in `model_dir`.

        Its tensors come from the shards of model.safetensors.index.json, else model.safetensors,
        else every *.safetensors file in the directory.
        """
        directory = Path(model_dir)
        index = directory / INDEX_NAME
        if index.is_symlink() or index.exists():
            _check_weight_file(index, "a safetensors index (JSON)")
        if not index.is_file():
            others = sorted(directory.glob("*.safetensors.index.json"))
            index = others[0] if len(others) == 1 else index
        if index.is_file():
            tensors = _sharded_tensors(directory, index)
        else:
            tensors = _unindexed_tensors(directory)
        checkpoint = cls(directory, tensors)
        for path in sorted({info.file for info in tensors.values()}):
            checkpoint._handle(path)
        return checkpoint

    def keys(self) -> list[str]:
        """Answers every tensor name in the checkpoint, sorted."""
        return sorted(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """Answers the shape of tensor `name`, read from its file's header."""
        return self._info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """Answers the torch dtype of tensor `name`, read from its file's header."""
        return self._info(name).dtype

    def file(self, name: str) -> Path:
        """Answers the safetensors file that holds tensor `name`."""
        return self._info(name).file

    def get(self, name: str) -> torch.Tensor:
        """Answers tensor `name`, read from its memory-mapped file (only this tensor is read)."""
        info = self._info(name)
        return self._handle(info.file).get_tensor(name)

    def get_part(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Answers the rows ``[start, end)`` of each range along `dim` of tensor `name`, side by side.

        Only those rows are read (a safetensors slice), so a tensor-parallel rank never holds the
        whole tensor. A checkpoint that transforms tensors as it reads them (a subclass with its own
        `get`: dequantized or GGUF weights) reads the whole tensor and cuts it.
        """
        if type(self).get is not Checkpoint.get:
            whole = self.get(name)
            parts = [whole.narrow(dim, a, b - a) for a, b in ranges]
        else:
            view = self._handle(self._info(name).file).get_slice(name)
            lead = (slice(None),) * dim
            parts = [view[(*lead, slice(a, b))] for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def close(self) -> None:
        """Drops the open file handles; `get` reopens them when called again."""
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.directory)!r}, {len(self)} tensors)"

    def _info(self, name: str) -> _TensorInfo:
        """Answers the header entry of `name`; a KeyError names the key and the directory."""
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint at {self.directory}") from None

    def _handle(self, path: Path):
        """Answers the cached `safe_open` handle of `path`, opening it on first use."""
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as error:  # safetensors raises its own (non-public) error type
                raise _corrupt(path, " ".join(str(error).split())) from None
            self._handles[path] = handle
        return handle


def _unindexed_tensors(directory: Path) -> dict[str, _TensorInfo]:
    """Answers the tensors of model.safetensors, or of every *.safetensors file when it is absent."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    single = directory / SINGLE_NAME
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        refuse_pickle_only(directory)
        raise CheckpointError(f"{directory}: no *.safetensors weights found")
    tensors: dict[str, _TensorInfo] = {}
    for path in files:
        _merge(tensors, _read_header(path))
    return tensors


def _sharded_tensors(directory: Path, index: Path) -> dict[str, _TensorInfo]:
    """Answers the tensors of the shards named by `index`, checking the index against them."""
    weight_map = _read_weight_map(index)
    tensors: dict[str, _TensorInfo] = {}
    for shard_name in sorted(set(weight_map.values())):
        shard = directory / shard_name
        _check_weight_file(shard, f"a safetensors shard listed in {index.name}")
        if not shard.is_file():
            key = next(k for k, v in weight_map.items() if v == shard_name)
            raise CheckpointError(
                f"{index}: shard {shard_name!r} (holding key {key!r}) is missing from {directory}"
            )
        _merge(tensors, _read_header(shard))
    for key, shard_name in weight_map.items():
        info = tensors.get(key)
        if info is None or info.file != directory / shard_name:
            raise CheckpointError(
                f"{directory / shard_name}: key {key!r} listed in {index.name} is not in this shard"
            )
    return tensors


def _read_weight_map(index: Path) -> dict[str, str]:
    """Answers the `weight_map` (tensor name -> shard file name) of a safetensors index file."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{index}: unreadable index ({' '.join(str(error).split())})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index}: expected a 'weight_map' object mapping tensor names to shard file names"
        )
    return weight_map


def _merge(tensors: dict[str, _TensorInfo], more: dict[str, _TensorInfo]) -> None:
    """Adds `more` to `tensors`, refusing a key that two files both hold."""
    for name, info in more.items():
        if name in tensors:
            raise CheckpointError(f"key {name!r} is in two files: {tensors[name].file} and {info.file}")
        tensors[name] = info


# --- where tensors go -------------------------------------------------------------------------


@attrs.frozen
class Target:
    """Where a checkpoint tensor goes: parameter `name`, whole or one cell of a grid.

    With `index=()` the tensor is the whole parameter. Otherwise the parameter is viewed as
    `[*grid, *checkpoint_shape]` and the tensor fills `view[index]`: stacked MoE experts
    `[E, I, H]` use grid (E,) and index (e,); a fused gate_up `[2I, H]` uses grid (2,) and
    index (0) or (1); both at once use grid (E, 2) and index (e, 0|1).
    """

    name: str
    index: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    grid: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if len(self.index) != len(self.grid) or not all(
            0 <= i < g for i, g in zip(self.index, self.grid, strict=True)
        ):
            raise ValueError(f"Target {self.name!r}: index {self.index} does not lie in grid {self.grid}")


@attrs.frozen
class _Copy:
    """One planned copy: checkpoint key -> target parameter (only this rank's `part` of the tensor
    when the parameter is split across tensor-parallel ranks)."""

    key: str
    target: Target
    part: Shard | None = None


# --- loading ----------------------------------------------------------------------------------


def load_weights(
    module: torch.nn.Module,
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype | None = None,
    name_map: Callable[[str], str | Target | None] | None = None,
    tied: Mapping[str, str] | None = None,
) -> None:
    """Fills every parameter and persistent buffer of `module` from `checkpoint`, strictly.

    `name_map(key)` answers the parameter a checkpoint key loads into (a name or a `Target`), or
    None to skip the key on purpose. `tied` maps a parameter to the one it shares storage with
    when the checkpoint lacks it (e.g. {"lm_head.weight": "model.embed_tokens.weight"}).
    `dtype`, when given, is the dtype of the module's floating tensors after loading.
    """
    if dtype is not None:
        module.to(dtype)
    plan = _plan(checkpoint, name_map or (lambda key: key))
    _apply_ties(module, {c.target.name for c in plan}, tied or {})
    slots = _state_slots(module)
    plan = _localize(checkpoint, plan, slots, parameter_shards(module))
    _check_plan(checkpoint, plan, slots)
    _copy(checkpoint, plan, slots)


def _plan(checkpoint: Checkpoint, name_map: Callable[[str], str | Target | None]) -> list[_Copy]:
    """Answers the copies `name_map` asks for, one per checkpoint key that is not skipped."""
    plan = []
    for key in checkpoint.keys():
        target = name_map(key)
        if target is None:
            continue
        plan.append(_Copy(key, target if isinstance(target, Target) else Target(target)))
    return plan


def _apply_ties(module: torch.nn.Module, loaded: set[str], tied: Mapping[str, str]) -> None:
    """Shares each tied target with its source when the checkpoint lacks it, else unshares them."""
    for target, source in tied.items():
        source_param = module.get_parameter(source)
        owner, attr = _owner(module, target)
        current = getattr(owner, attr)
        if target not in loaded:
            setattr(owner, attr, source_param)
        elif current is source_param:
            # The checkpoint has its own copy, so the target gets its own storage to load it into.
            setattr(owner, attr, torch.nn.Parameter(torch.empty_like(current), current.requires_grad))


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """Answers the submodule holding the attribute `name` (dotted) and the attribute's own name."""
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


@attrs.define
class _Slot:
    """One tensor of the module, with every state-dict name that refers to it."""

    names: list[str]
    tensor: torch.Tensor


def _state_slots(module: torch.nn.Module) -> dict[str, _Slot]:
    """Answers each state-dict name of `module` -> its slot; tied names share one slot."""
    by_tensor: dict[int, _Slot] = {}
    slots: dict[str, _Slot] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        slot = by_tensor.setdefault(id(tensor), _Slot([], tensor))
        slot.names.append(name)
        slots[name] = slot
    return slots


def _check_plan(checkpoint: Checkpoint, plan: list[_Copy], slots: dict[str, _Slot]) -> None:
    """Raises CheckpointError unless `plan` fits the module and writes every slot exactly once."""
    writes: dict[int, dict[tuple[int, ...], _Copy]] = {}
    grids: dict[int, tuple[tuple[int, ...], _Copy]] = {}
    for copy in plan:
        slot = slots.get(copy.target.name)
        if slot is None:
            raise CheckpointError(_unexpected(checkpoint, copy))
        _check_fit(checkpoint, copy, slot.tensor)
        first = grids.setdefault(id(slot), (copy.target.grid, copy))
        if first[0] != copy.target.grid:
            raise CheckpointError(_clash(checkpoint, copy, first[1]))
        earlier = writes.setdefault(id(slot), {}).setdefault(copy.target.index, copy)
        if earlier is not copy:
            raise CheckpointError(_clash(checkpoint, copy, earlier))
    _check_coverage(checkpoint, slots, writes, grids)


def _check_fit(checkpoint: Checkpoint, copy: _Copy, param: torch.Tensor, full_shape: tuple[int, ...] | None = None) -> None:
    """Raises CheckpointError when the tensor of `copy` does not fit `param` in shape or kind.

    `full_shape` is the shape of the whole parameter when `param` is this rank's shard of it.
    """
    key, target = copy.key, copy.target
    shape, dtype = _source_shape(checkpoint, copy), checkpoint.dtype(key)
    where = f"{checkpoint.file(key)}: key {key!r}"
    param_shape = full_shape or tuple(param.shape)
    fits = shape == (_cell_shape(param_shape, target.grid) if target.grid else param_shape)
    if not fits:
        raise CheckpointError(
            f"{where} has shape {tuple(shape)}, expected {_expected_shape(param_shape, target.grid)} "
            f"for parameter {target.name!r} of shape {param_shape}"
            + (f" split into grid {target.grid}" if target.grid else "")
            + (f" (split across tensor-parallel ranks; this rank holds {tuple(param.shape)})" if full_shape else "")
        )
    if dtype.is_floating_point != param.dtype.is_floating_point or (
        not dtype.is_floating_point and dtype != param.dtype
    ):
        raise CheckpointError(
            f"{where} has dtype {dtype}, which cannot load into parameter {target.name!r} "
            f"of dtype {param.dtype}"
        )


def _source_shape(checkpoint: Checkpoint, copy: _Copy) -> tuple[int, ...]:
    """The shape of what `copy` reads: the checkpoint tensor, or this rank's part of it (padded)."""
    shape = tuple(checkpoint.shape(copy.key))
    part = copy.part
    if part is None or part.count == 1 or len(shape) <= part.dim or shape[part.dim] != part.full_size:
        return shape
    return (*shape[: part.dim], part.local_size, *shape[part.dim + 1 :])


def _localize(checkpoint: Checkpoint, plan: list[_Copy], slots: dict[str, _Slot], shards: dict[str, Shard]) -> list[_Copy]:
    """The copies this rank makes: each copy into a split parameter checked against the whole
    parameter, then cut to this rank's part (a slice of the tensor, or only the stacked experts
    this rank holds: the others' keys are checked and skipped)."""
    if not shards:
        return plan
    local = []
    for copy in plan:
        slot = slots.get(copy.target.name)
        shard = next((shards[name] for name in slot.names if name in shards), None) if slot else None
        if shard is None:
            local.append(copy)
            continue
        full = shard.full_shape(tuple(slot.tensor.shape))
        _check_fit(checkpoint, copy, slot.tensor, full)
        target = copy.target
        if not target.grid:
            local.append(_Copy(copy.key, target, shard))
            continue
        if shard.dim != 0 or len(shard.sections) != 1 or target.grid[0] != full[0]:
            raise CheckpointError(
                f"{checkpoint.file(copy.key)}: key {copy.key!r} loads into cell {target.index} of parameter "
                f"{target.name!r}, which is split across tensor-parallel ranks along dim {shard.dim}; "
                "only a split of the stacked dim (experts) combines with grid cells"
            )
        (start, end), = shard.ranges()
        if start <= target.index[0] < end:
            grid = (shard.local_size, *target.grid[1:])
            local.append(_Copy(copy.key, Target(target.name, (target.index[0] - start, *target.index[1:]), grid)))
    return local


def _cell_shape(param_shape: tuple[int, ...], grid: tuple[int, ...]) -> tuple[int, ...] | None:
    """Answers the shape of one cell of a parameter split into `grid`, or None if it cannot split.

    Grid dimensions peel off the parameter's leading dimensions in order: one equal to the grid
    dimension is consumed (stacked experts [E, I, H] -> [I, H]); a multiple of it is divided
    (fused gate_up [2I, H] -> [I, H]). That is the row-major layout of `view(*grid, *cell)`, and
    it refuses a tensor of the right size but the wrong layout (flattened or transposed).
    """
    cell = list(param_shape)
    for g in grid:
        if not cell or cell[0] % g:
            return None
        if cell[0] == g:
            cell.pop(0)
        else:
            cell[0] //= g
    return tuple(cell)


def _expected_shape(param_shape: tuple[int, ...], grid: tuple[int, ...]) -> str:
    """Answers, for error messages, the checkpoint shape that would fit the parameter (or its grid)."""
    expected = _cell_shape(param_shape, grid) if grid else param_shape
    return str(expected) if expected is not None else f"a shape that splits it into grid {grid}"


def _check_coverage(
    checkpoint: Checkpoint,
    slots: dict[str, _Slot],
    writes: dict[int, dict[tuple[int, ...], _Copy]],
    grids: dict[int, tuple[tuple[int, ...], _Copy]],
) -> None:
    """Raises CheckpointError naming the parameters (or grid cells) that nothing writes."""
    missing: list[str] = []
    seen: set[int] = set()
    for name, slot in slots.items():
        if id(slot) in seen:
            continue
        seen.add(id(slot))
        if id(slot) not in writes:
            missing.append(name)
            continue
        grid, _ = grids[id(slot)]
        cells = math.prod(grid)
        if len(writes[id(slot)]) < cells:
            absent = [i for i in _cells(grid) if i not in writes[id(slot)]]
            missing.append(f"{name} (grid cells {_first(absent, 4)} of grid {grid})")
    if missing:
        raise CheckpointError(
            f"checkpoint {checkpoint.directory} lacks {len(missing)} tensor(s) of the model: "
            f"{_first(missing, 5)}"
        )


def _cells(grid: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Answers every index of `grid` in row-major order."""
    if not grid:
        yield ()
        return
    for i in range(grid[0]):
        for rest in _cells(grid[1:]):
            yield (i, *rest)


def _first(items: list, n: int) -> str:
    """Answers the first `n` of `items` joined, with how many more there are."""
    shown = ", ".join(str(x) for x in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def _unexpected(checkpoint: Checkpoint, copy: _Copy) -> str:
    """Answers the message for a checkpoint key that loads into no parameter of the module."""
    mapped = f" (mapped to {copy.target.name!r})" if copy.target.name != copy.key else ""
    return (
        f"{checkpoint.file(copy.key)}: unexpected key {copy.key!r}{mapped}: "
        "the model has no such parameter or buffer"
    )


def _clash(checkpoint: Checkpoint, copy: _Copy, earlier: _Copy) -> str:
    """Answers the message for two checkpoint keys that write one parameter twice or inconsistently."""
    where = f"{checkpoint.file(copy.key)}: key {copy.key!r} and key {earlier.key!r}"
    if copy.target.name != earlier.target.name:
        return (
            f"{where} load into {copy.target.name!r} and {earlier.target.name!r}, which are one shared "
            f"(tied) tensor; pass tied={{{copy.target.name!r}: {earlier.target.name!r}}} to load them untied"
        )
    if copy.target.grid != earlier.target.grid:
        return (
            f"{where} load parameter {copy.target.name!r} split into different grids "
            f"({copy.target.grid} and {earlier.target.grid})"
        )
    cell = f"cell {copy.target.index} of " if copy.target.index else ""
    return f"{where} both load into {cell}parameter {copy.target.name!r}"


def _copy(checkpoint: Checkpoint, plan: list[_Copy], slots: dict[str, _Slot]) -> None:
    """Copies each planned tensor into its place, one tensor in memory at a time."""
    # Reading file by file, in data order, keeps the memory-mapped reads sequential.
    order = sorted(plan, key=lambda c: (str(checkpoint.file(c.key)), checkpoint._info(c.key).offset))
    sizes = [_nbytes(checkpoint._info(c.key)) for c in order]
    with torch.no_grad():
        for copy in weight_loading_bar(order, sizes):  # a bar once loading takes more than a moment
            param = slots[copy.target.name].tensor
            part = copy.part
            if part is not None and part.zeros:
                param.zero_()  # held as zeros on this rank (a row-parallel bias off rank 0)
                continue
            source = checkpoint.get(copy.key) if part is None else checkpoint.get_part(copy.key, part.dim, part.ranges())
            _check_finite(checkpoint, copy.key, source)
            if copy.target.grid:
                param.view(*copy.target.grid, *source.shape)[copy.target.index].copy_(source)
            elif part is not None and source.shape[part.dim] < param.shape[part.dim]:
                # the short last piece of an uneven split (a vocabulary): the padding rows are zeros
                param.zero_()
                param.narrow(part.dim, 0, source.shape[part.dim]).copy_(source)
            else:
                param.copy_(source)
            del source


# Elements checked per step for NaN/inf: bounds the float32 copy a narrow dtype (FP8) is widened to.
_FINITE_CHUNK = 1 << 24
_NATIVE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_finite(checkpoint: Checkpoint, key: str, tensor: torch.Tensor) -> None:
    """Raises CheckpointError naming the file and `key` when `tensor` holds NaN or infinity.

    Such weights make every output NaN (or fail deep in a kernel check); they mean a broken export
    or download, so they are refused at load rather than served. A min/max reduction per chunk
    reads the tensor once without a tensor-sized mask; integer tensors (packed quantized weights,
    GGUF blocks, indices) have no NaN to find.
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        chunk = flat[start : start + _FINITE_CHUNK]
        if chunk.dtype not in _NATIVE_FLOATS:
            chunk = chunk.float()  # FP8 / E8M0 have no min/max kernels; widening keeps NaN and inf
        low, high = torch.aminmax(chunk)
        low, high = float(low), float(high)
        if math.isnan(low) or math.isnan(high):
            raise CheckpointError(_non_finite(checkpoint, key, "NaN"))
        if math.isinf(low) or math.isinf(high):
            raise CheckpointError(_non_finite(checkpoint, key, "infinite"))


def _non_finite(checkpoint: Checkpoint, key: str, what: str) -> str:
    return (
        f"{checkpoint.file(key)}: tensor {key!r} holds {what} values; the checkpoint is broken "
        "(re-download or re-export it)"
    )
