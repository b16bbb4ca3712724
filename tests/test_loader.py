"""Checkpoint and load_weights: strict safetensors loading into small modules."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from layerzoo.errors import CheckpointError
from layerzoo.loading.loader import Checkpoint, Target, load_weights


class Tiny(nn.Module):
    """A linear layer with a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("cache", torch.zeros(4), persistent=False)


class LM(nn.Module):
    """An embedding and an output head that may be tied."""

    def __init__(self, vocab: int = 5, hidden: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


class Experts(nn.Module):
    """Stacked MoE experts: gate and up fused per expert, down stacked."""

    def __init__(self, experts: int = 3, inter: int = 4, hidden: int = 2):
        super().__init__()
        self.gate_up = nn.Parameter(torch.zeros(experts, 2 * inter, hidden))
        self.down = nn.Parameter(torch.zeros(experts, hidden, inter))


def tiny_tensors() -> dict[str, torch.Tensor]:
    return {
        "proj.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "proj.bias": torch.tensor([0.5, -0.5]),
        "scale": torch.tensor([2.0, 3.0]),
    }


def save(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / name))
    return tmp_path / name


def shard(tmp_path: Path, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Writes `shards` (file name -> tensors) and their model.safetensors.index.json."""
    weight_map = {}
    for name, tensors in shards.items():
        save(tmp_path, tensors, name)
        weight_map.update(dict.fromkeys(tensors, name))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def load_error(module: nn.Module, model_dir: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_weights(module, Checkpoint.open(model_dir), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def open_error(model_dir: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(model_dir)
    message = str(info.value)
    assert "\n" not in message
    return message


def assert_loaded(module: Tiny) -> None:
    expected = tiny_tensors()
    assert torch.equal(module.proj.weight, expected["proj.weight"])
    assert torch.equal(module.proj.bias, expected["proj.bias"])
    assert torch.equal(module.scale, expected["scale"])


# --- opening checkpoints ----------------------------------------------------------------------


def test_single_file(tmp_path):
    save(tmp_path, tiny_tensors())
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.keys() == ["proj.bias", "proj.weight", "scale"]
    assert "proj.weight" in checkpoint and "nope" not in checkpoint
    assert checkpoint.shape("proj.weight") == (2, 3)
    assert checkpoint.dtype("proj.weight") == torch.float32
    assert checkpoint.file("scale") == tmp_path / "model.safetensors"
    module = Tiny()
    load_weights(module, checkpoint)
    assert_loaded(module)


def test_sharded_with_index(tmp_path):
    tensors = tiny_tensors()
    shard(
        tmp_path,
        {
            "model-00001-of-00002.safetensors": {"proj.weight": tensors["proj.weight"]},
            "model-00002-of-00002.safetensors": {
                "proj.bias": tensors["proj.bias"],
                "scale": tensors["scale"],
            },
        },
    )
    save(tmp_path, {"stray": torch.zeros(1)}, "consolidated.safetensors")  # not in the index: ignored
    checkpoint = Checkpoint.open(tmp_path)
    assert checkpoint.keys() == ["proj.bias", "proj.weight", "scale"]
    assert checkpoint.file("proj.weight").name == "model-00001-of-00002.safetensors"
    module = Tiny()
    load_weights(module, checkpoint)
    assert_loaded(module)


def test_several_files_without_index(tmp_path):
    tensors = tiny_tensors()
    save(tmp_path, {"proj.weight": tensors["proj.weight"]}, "a.safetensors")
    save(tmp_path, {"proj.bias": tensors["proj.bias"], "scale": tensors["scale"]}, "b.safetensors")
    module = Tiny()
    load_weights(module, Checkpoint.open(tmp_path))
    assert_loaded(module)


def test_header_metadata_and_get_for_common_dtypes(tmp_path):
    tensors = {
        "f64": torch.randn(2, dtype=torch.float64),
        "f16": torch.randn(2, 2).half(),
        "bf16": torch.randn(3).bfloat16(),
        "i64": torch.arange(3),
        "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(3, dtype=torch.int8),
        "u8": torch.arange(3, dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "f8_e4m3": torch.randn(4).to(torch.float8_e4m3fn),
        "f8_e5m2": torch.randn(4).to(torch.float8_e5m2),
        "scalar": torch.tensor(1.5),
    }
    save(tmp_path, tensors)
    checkpoint = Checkpoint.open(tmp_path)
    for name, tensor in tensors.items():
        assert checkpoint.dtype(name) == tensor.dtype, name
        assert checkpoint.shape(name) == tuple(tensor.shape), name
        got = checkpoint.get(name)
        assert got.dtype == tensor.dtype and torch.equal(
            got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
        ), name


def test_same_key_in_two_files(tmp_path):
    save(tmp_path, {"w": torch.zeros(1)}, "a.safetensors")
    save(tmp_path, {"w": torch.zeros(1)}, "b.safetensors")
    message = open_error(tmp_path)
    assert "'w'" in message and "a.safetensors" in message and "b.safetensors" in message


def test_index_naming_a_missing_shard(tmp_path):
    index = shard(tmp_path, {"model-00001-of-00002.safetensors": {"w": torch.zeros(1)}})
    data = json.loads(index.read_text())
    data["weight_map"]["v"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(data))
    message = open_error(tmp_path)
    assert str(index) in message and "model-00002-of-00002.safetensors" in message and "'v'" in message


def test_key_missing_from_its_shard(tmp_path):
    index = shard(
        tmp_path, {"s1.safetensors": {"w": torch.zeros(1)}, "s2.safetensors": {"v": torch.zeros(1)}}
    )
    data = json.loads(index.read_text())
    data["weight_map"]["ghost"] = "s1.safetensors"
    index.write_text(json.dumps(data))
    message = open_error(tmp_path)
    assert "s1.safetensors" in message and "'ghost'" in message


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"metadata": {}}), json.dumps({"weight_map": [1]})]
)
def test_bad_index(tmp_path, content):
    save(tmp_path, {"w": torch.zeros(1)})
    (tmp_path / "model.safetensors.index.json").write_text(content)
    message = open_error(tmp_path)
    assert "model.safetensors.index.json" in message
    assert "weight_map" in message or "unreadable" in message


@pytest.mark.parametrize("keep", [5, 20], ids=["inside-length-prefix", "inside-json-header"])
def test_file_truncated_in_its_header(tmp_path, keep):
    path = save(tmp_path, tiny_tensors())
    path.write_bytes(path.read_bytes()[:keep])
    message = open_error(tmp_path)
    assert str(path) in message and "not a valid safetensors file (truncated or corrupt" in message


def test_file_truncated_in_its_data_section(tmp_path):
    path = save(tmp_path, tiny_tensors())
    path.write_bytes(path.read_bytes()[:-4])
    message = open_error(tmp_path)
    # Our own size check catches it (and names the key whose data is cut), not only safe_open.
    assert str(path) in message and "truncated" in message and "ends at data byte" in message


def test_corrupt_file_rejected_by_safe_open_is_wrapped(tmp_path):
    # Two tensors claiming the same bytes: sizes fit, but safetensors refuses the layout.
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        }
    ).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    message = open_error(tmp_path)
    assert message.startswith(f"{path}: not a valid safetensors file (truncated or corrupt: ")


def test_no_safetensors_at_all(tmp_path):
    message = open_error(tmp_path)
    assert str(tmp_path) in message and "no *.safetensors" in message


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    message = open_error(tmp_path)
    assert str(tmp_path) in message and "pytorch_model.bin" in message and "arbitrary code" in message


# --- strict loading ---------------------------------------------------------------------------


def test_missing_keys_are_listed_with_a_count(tmp_path):
    save(tmp_path, {"layers.0.weight": torch.zeros(1, 1)})
    module = nn.Module()
    module.layers = nn.ModuleList(nn.Linear(1, 1) for _ in range(4))
    message = load_error(module, tmp_path)
    assert str(tmp_path) in message and "lacks 7 tensor(s)" in message
    assert "layers.0.bias" in message and "and 2 more" in message


def test_persistent_buffer_is_required_but_not_a_non_persistent_one(tmp_path):
    tensors = tiny_tensors()
    del tensors["scale"]
    save(tmp_path, tensors)
    message = load_error(Tiny(), tmp_path)
    assert "scale" in message and "cache" not in message


def test_unexpected_key(tmp_path):
    save(tmp_path, {**tiny_tensors(), "extra.weight": torch.zeros(1)})
    message = load_error(Tiny(), tmp_path)
    assert "'extra.weight'" in message and str(tmp_path / "model.safetensors") in message


def test_shape_mismatch(tmp_path):
    save(tmp_path, {**tiny_tensors(), "proj.weight": torch.zeros(3, 2)})
    message = load_error(Tiny(), tmp_path)
    assert str(tmp_path / "model.safetensors") in message and "'proj.weight'" in message
    assert "(3, 2)" in message and "expected (2, 3)" in message


def test_int_tensor_for_float_parameter(tmp_path):
    save(tmp_path, {**tiny_tensors(), "proj.bias": torch.tensor([1, 2])})
    message = load_error(Tiny(), tmp_path)
    assert str(tmp_path / "model.safetensors") in message and "'proj.bias'" in message
    assert "torch.int64" in message and "torch.float32" in message


def test_bf16_checkpoint_converts_to_fp32_parameters(tmp_path):
    tensors = {k: v.bfloat16() for k, v in tiny_tensors().items()}
    tensors["proj.bias"] = torch.tensor([0.1, 1 / 3]).bfloat16()
    save(tmp_path, tensors)
    module = Tiny()
    load_weights(module, Checkpoint.open(tmp_path))
    assert module.proj.bias.dtype == torch.float32
    assert torch.equal(module.proj.bias, tensors["proj.bias"].float())


def test_dtype_argument_casts_floating_parameters(tmp_path):
    save(tmp_path, tiny_tensors())
    module = Tiny()
    load_weights(module, Checkpoint.open(tmp_path), dtype=torch.bfloat16)
    assert module.proj.weight.dtype == module.scale.dtype == torch.bfloat16
    assert torch.equal(module.proj.weight, tiny_tensors()["proj.weight"].bfloat16())


def test_name_map_renames_and_skips(tmp_path):
    tensors = {f"model.{k}": v for k, v in tiny_tensors().items()}
    save(tmp_path, {**tensors, "mtp.0.weight": torch.zeros(2)})

    def name_map(key: str) -> str | None:
        return None if key.startswith("mtp.") else key.removeprefix("model.")

    module = Tiny()
    load_weights(module, Checkpoint.open(tmp_path), name_map=name_map)
    assert_loaded(module)


def test_unexpected_mapped_key_names_both_names(tmp_path):
    save(tmp_path, tiny_tensors())
    message = load_error(Tiny(), tmp_path, name_map=lambda k: "model." + k)
    assert "unexpected key 'proj.bias' (mapped to 'model.proj.bias')" in message


def test_two_keys_into_one_parameter(tmp_path):
    save(tmp_path, {**tiny_tensors(), "proj.weight_copy": torch.zeros(2, 3)})
    message = load_error(Tiny(), tmp_path, name_map=lambda k: k.removesuffix("_copy"))
    assert "'proj.weight'" in message and "'proj.weight_copy'" in message


# --- tied parameters --------------------------------------------------------------------------

TIED = {"lm_head.weight": "embed.weight"}


def test_tied_target_missing_from_checkpoint_shares_the_source(tmp_path):
    embed = torch.randn(5, 4)
    save(tmp_path, {"embed.weight": embed})
    model = LM()
    load_weights(model, Checkpoint.open(tmp_path), tied=TIED)
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.lm_head.weight, embed)
    assert len(list(model.parameters())) == 1


def test_tied_target_present_in_checkpoint_loads_untied(tmp_path):
    embed = torch.randn(5, 4)
    save(tmp_path, {"embed.weight": embed, "lm_head.weight": embed.clone()})
    model = LM()
    model.lm_head.weight = model.embed.weight  # built tied, as HF models with tie_word_embeddings are
    load_weights(model, Checkpoint.open(tmp_path), tied=TIED)
    assert model.lm_head.weight is not model.embed.weight
    assert model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, embed) and torch.equal(model.embed.weight, embed)


def test_module_tied_without_tied_argument(tmp_path):
    embed = torch.randn(5, 4)
    save(tmp_path, {"embed.weight": embed})
    model = LM()
    model.lm_head.weight = model.embed.weight
    load_weights(model, Checkpoint.open(tmp_path))  # one key fills the one shared tensor
    assert torch.equal(model.lm_head.weight, embed)

    save(tmp_path, {"embed.weight": embed, "lm_head.weight": embed.clone()})
    message = load_error(model, tmp_path)
    assert "'lm_head.weight'" in message and "'embed.weight'" in message and "tied=" in message


# --- grid targets -----------------------------------------------------------------------------


def expert_tensors(experts: int = 3, inter: int = 4, hidden: int = 2) -> dict[str, torch.Tensor]:
    tensors = {}
    for e in range(experts):
        for proj, shape in [
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ]:
            tensors[f"experts.{e}.{proj}.weight"] = torch.randn(shape)
    return tensors


def expert_map(experts: int = 3):
    def name_map(key: str) -> Target:
        _, e, proj, _ = key.split(".")
        if proj == "down_proj":
            return Target("down", index=(int(e),), grid=(experts,))
        return Target("gate_up", index=(int(e), 0 if proj == "gate_proj" else 1), grid=(experts, 2))

    return name_map


def test_grid_targets_stack_experts_and_fuse_gate_up(tmp_path):
    tensors = expert_tensors()
    save(tmp_path, tensors)
    module = Experts()
    load_weights(module, Checkpoint.open(tmp_path), name_map=expert_map())
    for e in range(3):
        gate, up = module.gate_up[e].chunk(2)
        assert torch.equal(gate, tensors[f"experts.{e}.gate_proj.weight"])
        assert torch.equal(up, tensors[f"experts.{e}.up_proj.weight"])
        assert torch.equal(module.down[e], tensors[f"experts.{e}.down_proj.weight"])


def test_fused_gate_up_without_experts(tmp_path):
    gate, up = torch.randn(4, 2), torch.randn(4, 2)
    save(tmp_path, {"gate": gate, "up": up})
    module = nn.Module()
    module.gate_up = nn.Parameter(torch.zeros(8, 2))
    load_weights(
        module, Checkpoint.open(tmp_path), name_map=lambda k: Target("gate_up", (int(k == "up"),), (2,))
    )
    assert torch.equal(module.gate_up, torch.cat([gate, up]))


def test_incomplete_grid_is_an_error(tmp_path):
    tensors = expert_tensors()
    del tensors["experts.1.up_proj.weight"]
    save(tmp_path, tensors)
    message = load_error(Experts(), tmp_path, name_map=expert_map())
    assert "gate_up" in message and "(1, 1)" in message and "grid (3, 2)" in message


@pytest.mark.parametrize("layout", ["transposed", "flattened"])
def test_cell_of_right_size_but_wrong_layout_is_refused(tmp_path, layout):
    tensors = expert_tensors()
    down = tensors["experts.2.down_proj.weight"]
    tensors["experts.2.down_proj.weight"] = down.T if layout == "transposed" else down.reshape(-1)
    save(tmp_path, tensors)
    message = load_error(Experts(), tmp_path, name_map=expert_map())
    assert str(tmp_path / "model.safetensors") in message and "'experts.2.down_proj.weight'" in message
    assert ("(4, 2)" if layout == "transposed" else "(8,)") in message
    assert "expected (2, 4)" in message and "grid (3,)" in message


def test_same_grid_cell_twice_is_an_error(tmp_path):
    save(tmp_path, expert_tensors())
    base = expert_map()

    def name_map(key: str) -> Target:
        target = base(key)
        return Target("down", (0,), (3,)) if target.name == "down" else target

    message = load_error(Experts(), tmp_path, name_map=name_map)
    assert "cell (0,)" in message and "'down'" in message and "down_proj.weight" in message


def test_target_index_outside_grid():
    with pytest.raises(ValueError, match="grid"):
        Target("w", index=(2,), grid=(2,))
