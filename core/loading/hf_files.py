"""Reading the JSON files of a Hugging Face model folder, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerzoo.errors import ConfigError


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({one_line(exc)})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({one_line(exc)})") from None


def read_json_object(path: Path) -> dict:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def eos_ids(value: Any, where: str) -> tuple[int, ...] | None:
    """`eos_token_id` from a config file: an int or a list of ints (None when absent)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f'{where}: "eos_token_id" must be an int or a list of ints, got {value!r}')
    if isinstance(value, int):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(dict.fromkeys(value))
    raise ConfigError(f'{where}: "eos_token_id" must be an int or a list of ints, got {value!r}')
