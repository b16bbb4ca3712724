"""resolve_model / pull: local directories, and hub repos fetched from a fake hub on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save as save_safetensors

from layerzoo.errors import CheckpointError, ModelNotFoundError
from layerzoo.loading import hub
from layerzoo.loading.hub import pull, resolve_model


def _load_hubserver():
    """Answers tests/hubserver.py as a module (tests/ is not a package under importlib mode)."""
    spec = importlib.util.spec_from_file_location(
        "layerzoo_tests_hubserver", Path(__file__).with_name("hubserver.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


hubserver = _load_hubserver()

WEIGHTS = save_safetensors({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)})


def tiny_repo(config: dict | None = None) -> dict[str, bytes]:
    """Answers the files of a tiny model repo, including two the download must skip."""
    return {
        "config.json": json.dumps(config or {"model_type": "tiny"}).encode(),
        "tokenizer.json": b'{"version": "1.0"}',
        "model.safetensors": WEIGHTS,
        "pytorch_model.bin": b"not really a pickle",
        "README.md": b"# tiny",
    }


REPOS = {
    "acme/tiny": {
        "main": tiny_repo(),
        "v2": tiny_repo({"model_type": "tiny", "version": 2}),
    },
    "acme/pickled": {
        "main": {
            "config.json": b"{}",
            "pytorch_model.bin": b"not really a pickle",
        }
    },
}


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """Points huggingface_hub at an empty cache under tmp_path, online; answers the hub cache dir."""
    home = tmp_path / "hf"
    cache = home / "hub"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads these variables once, at import: patch the constants it derived.
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return cache


@pytest.fixture
def fake_hub(hf_cache, monkeypatch):
    """A running fake hub serving REPOS, with huggingface_hub's endpoint pointed at it."""
    with hubserver.serve(REPOS) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        yield server


def go_offline(monkeypatch) -> None:
    """Sets HF_HUB_OFFLINE=1 the way a user would, after huggingface_hub was imported."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# --- local directories ------------------------------------------------------------------------


def test_local_directory_is_returned_resolved(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(WEIGHTS)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("model") == model.resolve()
    assert resolve_model(str(model)) == model.resolve()


@pytest.mark.parametrize(
    "spec", ["/no/such/model", "./missing", "../missing", "~/no-such-model-dir", "a/b/c"]
)
def test_path_that_is_not_a_directory_is_refused(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="not an existing directory") as info:
        resolve_model(spec)
    assert spec in str(info.value)


def test_file_is_not_a_model_directory(tmp_path, monkeypatch):
    (tmp_path / "weights.safetensors").write_bytes(WEIGHTS)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="weights.safetensors.*is a file"):
        resolve_model("weights.safetensors")


@pytest.mark.parametrize("spec", ["justaname", "owner/na me", "owner/", "own--er/name", "owner/na..me"])
def test_malformed_repo_id_is_refused(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match="'owner/name'") as info:
        resolve_model(spec)
    assert repr(spec) in str(info.value)


def test_local_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and "pytorch_model.bin" in message
    assert "arbitrary code" in message and "safe_serialization=True" in message
    assert "\n" not in message


def test_revision_with_local_directory_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(WEIGHTS)
    with pytest.raises(ModelNotFoundError, match="local directory"):
        resolve_model(str(tmp_path), revision="v2")


# --- hub downloads ----------------------------------------------------------------------------


def test_download_fetches_only_model_files_into_standard_cache(fake_hub, hf_cache):
    path = resolve_model("acme/tiny")
    commit = fake_hub.commit("acme/tiny")
    assert path == hf_cache / "models--acme--tiny" / "snapshots" / commit
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (hf_cache / "models--acme--tiny" / "refs" / "main").read_text() == commit
    assert "README.md" not in fake_hub.fetched() and "pytorch_model.bin" not in fake_hub.fetched()
    assert (path / "model.safetensors").read_bytes() == WEIGHTS


def test_revision_picks_another_commit(fake_hub, hf_cache):
    main = resolve_model("acme/tiny")
    v2 = resolve_model("acme/tiny", revision="v2")
    assert v2.name == fake_hub.commit("acme/tiny", "v2") != main.name
    assert json.loads((v2 / "config.json").read_text())["version"] == 2
    assert "version" not in json.loads((main / "config.json").read_text())
    # A commit sha is a revision too.
    assert resolve_model("acme/tiny", revision=v2.name) == v2


def test_offline_reuses_cached_snapshot_without_contacting_the_hub(fake_hub, monkeypatch):
    path = resolve_model("acme/tiny")
    seen = len(fake_hub.requests)
    go_offline(monkeypatch)
    assert resolve_model("acme/tiny") == path
    assert len(fake_hub.requests) == seen
    fake_hub.stop()
    assert resolve_model("acme/tiny") == path


def test_offline_without_cache_says_so(fake_hub, monkeypatch):
    go_offline(monkeypatch)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("acme/tiny")
    message = str(info.value)
    assert "'acme/tiny'" in message and "not in the local cache" in message and "HF_HUB_OFFLINE" in message
    assert "\n" not in message
    assert fake_hub.requests == []


def test_unknown_repo_is_named(fake_hub):
    with pytest.raises(ModelNotFoundError, match="no repo 'acme/nothing'"):
        resolve_model("acme/nothing")


def test_unknown_revision_is_named(fake_hub):
    with pytest.raises(ModelNotFoundError, match="'acme/tiny' has no revision 'v9'"):
        resolve_model("acme/tiny", revision="v9")


def test_unreachable_hub_without_cache(fake_hub):
    fake_hub.stop()
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("acme/tiny")
    message = str(info.value)
    assert "'acme/tiny'" in message and "could not be reached" in message and fake_hub.url in message
    assert "\n" not in message


def test_pickle_only_repo_is_refused(fake_hub):
    with pytest.raises(CheckpointError) as info:
        resolve_model("acme/pickled")
    message = str(info.value)
    assert "'acme/pickled'" in message and "pytorch_model.bin" in message and "arbitrary code" in message
    assert "pytorch_model.bin" not in fake_hub.fetched()


def test_cache_filled_by_huggingface_hub_is_reused(fake_hub, hf_cache, monkeypatch):
    import huggingface_hub

    # What transformers does: fetch single files into the standard cache.
    for name in ("config.json", "model.safetensors"):
        huggingface_hub.hf_hub_download("acme/tiny", name)
    before = len(fake_hub.fetched())
    path = resolve_model("acme/tiny")
    assert fake_hub.fetched()[before:] == ["tokenizer.json"]
    assert path == hf_cache / "models--acme--tiny" / "snapshots" / fake_hub.commit("acme/tiny")

    fake_hub.stop()
    go_offline(monkeypatch)
    assert resolve_model("acme/tiny") == path


def test_progress_bars_only_when_asked(fake_hub, capfd, monkeypatch):
    # Force tqdm to draw even though stderr is not a terminal.
    monkeypatch.setenv("TQDM_POSITION", "-1")
    resolve_model("acme/tiny", progress=False)
    assert "Fetching" not in capfd.readouterr().err
    path = pull("acme/tiny", revision="v2")
    assert path.name == fake_hub.commit("acme/tiny", "v2")
    if not constants.HF_HUB_DISABLE_PROGRESS_BARS:
        assert "Fetching" in capfd.readouterr().err


def test_pull_ignores_a_local_directory_of_the_same_name(fake_hub, tmp_path, monkeypatch):
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme/tiny") == (tmp_path / "acme" / "tiny").resolve()
    assert pull("acme/tiny").name == fake_hub.commit("acme/tiny")


def test_environment_variables_alone_configure_the_download(fake_hub, tmp_path):
    """HF_ENDPOINT and HF_HOME, set before huggingface_hub is imported, are all it takes."""
    home = tmp_path / "fresh-home"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_ENDPOINT": fake_hub.url, "HF_HOME": str(home)}
    code = "from layerzoo.loading.hub import resolve_model; print(resolve_model('acme/tiny'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    expected = home / "hub" / "models--acme--tiny" / "snapshots" / fake_hub.commit("acme/tiny")
    assert Path(out.stdout.strip()) == expected


def test_error_messages_are_one_line():
    assert "\n" not in hub.pickle_refusal("somewhere", ["a.bin", "b.bin", "c.pt", "d.pth"])
    assert hub._one_line(ValueError("first\n\nsecond")) == "first second"
