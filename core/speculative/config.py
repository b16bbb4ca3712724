"""The speculative-decoding settings, written the way vLLM users write ``speculative_config``.

``SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})``
checks every key and value and raises a one-line ``UserError`` naming the key and what was
expected. Whether ``method`` names a registered proposer is checked when the proposer is built
(``layerzoo.speculative.build_proposer``), where the registry can list the known methods.
Importing this module stays cheap (no torch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from layerzoo.errors import UserError

_WHERE = "speculative_config"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(predicate, expected: str):
    """An attrs validator raising a one-line UserError that names ``speculative_config.<key>``."""

    def validate(_instance, attribute, value) -> None:
        if not predicate(value):
            raise UserError(f"{_WHERE}.{attribute.name}: expected {expected}, got {value!r}")

    return validate


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """How to draft tokens for speculative decoding.

    ``method`` names a proposer registered through ``register_proposers`` (``"ngram"`` built in);
    ``num_speculative_tokens`` is k, the most draft tokens proposed per sequence and step. The
    ``prompt_lookup_*`` keys are the n-gram proposer's: it matches the last n tokens, n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``, against earlier ones.
    """

    method: str = attrs.field(validator=_check(lambda v: isinstance(v, str) and bool(v), "a non-empty string"))
    num_speculative_tokens: int = attrs.field(validator=_check(lambda v: _is_int(v) and v >= 1, "an int >= 1"))
    prompt_lookup_max: int = attrs.field(default=3, validator=_check(lambda v: _is_int(v) and v >= 1, "an int >= 1"))
    prompt_lookup_min: int = attrs.field(default=1, validator=_check(lambda v: _is_int(v) and v >= 1, "an int >= 1"))
    # Per sequence, draft only as many tokens as its recent acceptance makes worth verifying, down
    # to none (layerzoo.speculative.adaptive); False: always num_speculative_tokens.
    adaptive: bool = attrs.field(default=True, validator=_check(lambda v: isinstance(v, bool), "true or false"))

    def __attrs_post_init__(self):
        # The one check that spans two keys; per-field validators cannot see both.
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise UserError(
                f"{_WHERE}.prompt_lookup_min: expected at most prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min!r}"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """A config from a dict (vLLM's keys), a JSON object string (a CLI flag), or a config as it is.

        Unknown or missing keys and wrong values raise ``UserError`` naming the key.
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise UserError(f"{_WHERE}: expected a JSON object, got {value!r} ({exc})") from None
        if not isinstance(value, Mapping):
            raise UserError(f"{_WHERE}: expected a dict of settings, got {type(value).__name__} {value!r}")
        known = [f.name for f in attrs.fields(cls)]
        for key in value:
            if key not in known:
                raise UserError(f"{_WHERE}: unknown key {key!r} (expected one of: {', '.join(known)})")
        for field in attrs.fields(cls):
            if field.default is attrs.NOTHING and field.name not in value:
                raise UserError(f"{_WHERE}.{field.name}: required key is missing")
        if value.get("method") == "mtp":  # the head drafts from hidden states: no prompt lookup to tune
            for key in ("prompt_lookup_max", "prompt_lookup_min"):
                if key in value:
                    raise UserError(f"{_WHERE}.{key}: only the 'ngram' method looks up the prompt; method 'mtp' drafts with the model's MTP head")
        return cls(**value)
