"""A broken checkpoint is one line naming the file and what was expected (issue 34, "Checkpoints"):
non-finite weights, a dangling ``model.safetensors`` link (a half-deleted Hugging Face cache), a
directory of that name, an EOS id outside the vocabulary, and a bad ``ssm_*`` engine argument."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402

from layerzoo.engine_args import EngineArgs  # noqa: E402
from layerzoo.entrypoints.cli import main  # noqa: E402
from layerzoo.errors import CheckpointError, ConfigError, UserError  # noqa: E402
from layerzoo.llm import LLM  # noqa: E402
from layerzoo.loading.loader import Checkpoint, load_weights  # noqa: E402
from layerzoo.loading.model_loading import load_model  # noqa: E402

KEY = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def checkpoint(tiny_qwen3_dir, tmp_path) -> Path:
    """A private copy of the tiny Qwen3 checkpoint, for a test to break."""
    path = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, path)
    return path


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message, message
    return message


def cli_error(model: Path, capsys) -> str:
    """`layerzoo generate` on `model`: exit code 2 and the one-line error it printed."""
    assert main(["generate", "--model", str(model), "--prompt", "t1", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def rewrite(path: Path, change) -> None:
    """Applies `change(tensors)` to the checkpoint's model.safetensors in place."""
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


# --- non-finite weights -------------------------------------------------------------------------


@pytest.mark.parametrize("value, word", [(float("nan"), "NaN"), (float("inf"), "infinite"), (float("-inf"), "infinite")])
def test_non_finite_weights_are_refused_naming_file_and_tensor(checkpoint, value, word):
    def plant(tensors):
        tensors[KEY][3, 5] = value

    rewrite(checkpoint, plant)
    with pytest.raises(CheckpointError) as exc:
        load_model(checkpoint)
    message = one_line(exc)
    assert str(checkpoint / "model.safetensors") in message and repr(KEY) in message
    assert f"holds {word} values" in message


def test_nan_weights_are_one_line_on_the_cli(checkpoint, capsys):
    def plant(tensors):
        tensors[KEY].fill_(float("nan"))

    rewrite(checkpoint, plant)
    err = cli_error(checkpoint, capsys)
    assert repr(KEY) in err and "NaN" in err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_non_finite_values_are_found_in_every_stored_float_dtype(tmp_path, dtype):
    """Half-precision and FP8 tensors (FP8 has no min/max kernel: it is widened chunk by chunk)."""
    weight = torch.full((3, 4), 0.5).to(dtype)
    weight.view(-1)[7] = float("nan")
    save_file({"weight": weight}, str(tmp_path / "model.safetensors"))
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(3, 4))
    with pytest.raises(CheckpointError) as exc:
        load_weights(module, Checkpoint.open(tmp_path))
    assert "tensor 'weight' holds NaN values" in one_line(exc)


def test_finite_weights_and_integer_tensors_load(tmp_path):
    save_file({"weight": torch.full((2, 2), 65504.0, dtype=torch.float16), "ids": torch.tensor([-1, 7])},
              str(tmp_path / "model.safetensors"))
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(2, 2))
    module.register_buffer("ids", torch.zeros(2, dtype=torch.int64))
    load_weights(module, Checkpoint.open(tmp_path))
    assert float(module.weight.detach().max()) == 65504.0 and module.ids.tolist() == [-1, 7]


# --- what stands where the weights should be ------------------------------------------------------


def test_a_dangling_model_safetensors_link_names_the_link_and_its_target(checkpoint, capsys):
    # A Hugging Face cache snapshot links model.safetensors to ../../blobs/<hash>; deleting the blob
    # leaves the link behind.
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors").symlink_to("../blobs/0123abcd")
    with pytest.raises(CheckpointError) as exc:
        load_model(checkpoint)
    message = one_line(exc)
    assert message.startswith(f"{checkpoint / 'model.safetensors'}: a symbolic link to ../blobs/0123abcd, which does not exist")
    assert "expected a safetensors file" in message
    assert "a symbolic link" in cli_error(checkpoint, capsys)


def test_a_directory_named_model_safetensors_is_refused(checkpoint, capsys):
    (checkpoint / "model.safetensors").unlink()
    (checkpoint / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError) as exc:
        Checkpoint.open(checkpoint)
    assert one_line(exc) == f"{checkpoint / 'model.safetensors'}: a directory, expected a safetensors file"
    assert "a directory, expected a safetensors file" in cli_error(checkpoint, capsys)


def test_a_dangling_shard_or_index_link_is_named(checkpoint):
    shard = "model-00001-of-00001.safetensors"
    (checkpoint / "model.safetensors").rename(checkpoint / shard)
    keys = list(load_file(str(checkpoint / shard)))
    index = checkpoint / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys(keys, shard)}))
    (checkpoint / shard).unlink()
    (checkpoint / shard).symlink_to("../blobs/feed")
    with pytest.raises(CheckpointError) as exc:
        Checkpoint.open(checkpoint)
    message = one_line(exc)
    assert message.startswith(f"{checkpoint / shard}: a symbolic link to ../blobs/feed, which does not exist")
    assert "expected a safetensors shard listed in model.safetensors.index.json" in message

    index.unlink()
    index.symlink_to("../blobs/beef")
    with pytest.raises(CheckpointError) as exc:
        Checkpoint.open(checkpoint)
    assert one_line(exc).startswith(f"{index}: a symbolic link to ../blobs/beef, which does not exist")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_weights_file_is_one_line(checkpoint):
    (checkpoint / "model.safetensors").chmod(0)
    with pytest.raises(CheckpointError) as exc:
        Checkpoint.open(checkpoint)
    assert one_line(exc).startswith(f"{checkpoint / 'model.safetensors'}: cannot read the safetensors file")


# --- EOS ids outside the vocabulary ---------------------------------------------------------------


def edit_json(path: Path, **values) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(values)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("eos", [64, [3, 64], -1])
def test_an_eos_id_outside_the_vocabulary_in_config_json_is_refused(checkpoint, eos):
    edit_json(checkpoint / "config.json", eos_token_id=eos)
    with pytest.raises(ConfigError) as exc:
        load_model(checkpoint)
    bad = eos[1] if isinstance(eos, list) else eos
    assert one_line(exc) == (
        f"{checkpoint / 'config.json'}: key 'eos_token_id': {bad} is outside the vocabulary (vocab_size 64: ids 0..63)"
    )


def test_an_eos_id_outside_the_vocabulary_in_generation_config_is_refused(checkpoint, capsys):
    edit_json(checkpoint / "generation_config.json", eos_token_id=[5, 70])
    with pytest.raises(ConfigError) as exc:
        load_model(checkpoint)
    assert one_line(exc) == (
        f"{checkpoint / 'generation_config.json'}: key 'eos_token_id': 70 is outside the vocabulary "
        "(vocab_size 64: ids 0..63)"
    )
    assert "generation_config.json: key 'eos_token_id': 70" in cli_error(checkpoint, capsys)


def test_eos_ids_at_the_ends_of_the_vocabulary_load(checkpoint):
    edit_json(checkpoint / "config.json", eos_token_id=[0, 63])
    edit_json(checkpoint / "generation_config.json", eos_token_id=63)
    assert load_model(checkpoint).config.eos_token_id == [0, 63]


# --- recurrent-state engine arguments -------------------------------------------------------------


@pytest.mark.parametrize("field", ["ssm_snapshot_slots", "ssm_ring_depth", "ssm_snapshot_interval"])
@pytest.mark.parametrize("value", [-1, 2.0, True, "4"])
def test_ssm_arguments_are_refused_naming_the_field_and_the_range(field, value):
    with pytest.raises(UserError) as exc:
        EngineArgs(**{field: value})
    assert one_line(exc) == f"{field}: expected an int >= 0, got {value!r}"


def test_a_negative_snapshot_count_is_a_user_error_from_llm(tiny_qwen3_dir):
    with pytest.raises(UserError, match=r"^ssm_snapshot_slots: expected an int >= 0, got -1$"):
        LLM(tiny_qwen3_dir, dtype="float32", ssm_snapshot_slots=-1)
