"""The tokenizer of a Hugging Face style model folder (chat templates: `layerzoo.tokenization.chat_template`;
incremental detokenization: `layerzoo.tokenization.detokenizer`).

`Tokenizer.from_dir` reads the files a `transformers` tokenizer saves (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`, `chat_templates/*.jinja`, `chat_template.json`,
`generation_config.json`) with the `tokenizers` library and jinja2 only, and encodes, decodes and
renders chat templates the way `transformers.AutoTokenizer` does for the same files.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping

import tokenizers
from tokenizers import AddedToken

from layerzoo.errors import ConfigError
from layerzoo.loading.hf_files import eos_ids as _eos_ids
from layerzoo.loading.hf_files import one_line as _one_line
from layerzoo.loading.hf_files import read_json_object as _read_json_object
from layerzoo.tokenization.chat_template import compile_template, load_chat_templates

__all__ = ["Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"

# The named special tokens transformers knows (and hands to chat templates as variables).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Names a message's reasoning is passed under; the first is the one chat templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _token_content(value: Any, path: Path, key: str) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict `{"content": ...}`."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError(
        f'{path}: "{key}" must be a string or an object with a string "content", got {value!r}'
    )


class Tokenizer:
    """A model's tokenizer: encode/decode with the `tokenizers` library, chat templates with jinja2."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
        chat_template_source: str = "chat_template",
        clean_up_tokenization_spaces: bool = False,
    ):
        self.backend = backend
        self.special_tokens: dict[str, str] = {
            name: value for name, value in (special_tokens or {}).items() if value is not None
        }
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self._chat_template_source = chat_template_source
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._compiled: dict[str, Any] = {}

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: dict | None = None) -> "Tokenizer":
        """Load the tokenizer saved in `model_dir`.

        `config` is the parsed config.json (read from `model_dir` when not given); it is only used
        as a fallback for the EOS token ids when generation_config.json has none.
        """
        model_dir = Path(model_dir)
        from layerzoo.loading.gguf_loading import find_gguf

        gguf_path = find_gguf(model_dir)
        if gguf_path is not None:  # a GGUF file carries its tokenizer in its metadata
            from layerzoo.tokenization.gguf_tokenizer import gguf_tokenizer_parts

            return cls(**gguf_tokenizer_parts(gguf_path))
        tok_path = model_dir / TOKENIZER_FILE
        if not tok_path.is_file():
            raise ConfigError(f"{tok_path}: tokenizer file not found (expected a tokenizers tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ConfigError(f"{tok_path}: cannot be parsed as a tokenizer ({_one_line(exc)})") from None

        tok_config: dict = {}
        tok_config_path = model_dir / TOKENIZER_CONFIG_FILE
        if tok_config_path.is_file():
            tok_config = _read_json_object(tok_config_path)

        special = {
            name: _token_content(tok_config.get(name), tok_config_path, name) for name in SPECIAL_TOKEN_NAMES
        }

        # Like transformers: named special tokens missing from tokenizer.json are added as special tokens.
        missing = [
            AddedToken(content, special=True, normalized=False)
            for content in dict.fromkeys(v for v in special.values() if v is not None)
            if backend.token_to_id(content) is None
        ]
        if missing:
            backend.add_special_tokens(missing)

        # transformers 5 ignores add_bos_token / add_eos_token when tokenizer.json exists: the
        # post-processor saved in tokenizer.json alone decides which special tokens encode() adds.
        for key in ("add_bos_token", "add_eos_token"):
            if key in tok_config and tok_config[key] is not None and not isinstance(tok_config[key], bool):
                raise ConfigError(f'{tok_config_path}: "{key}" must be true or false, got {tok_config[key]!r}')

        chat_templates, template_source = load_chat_templates(model_dir, tok_config, tok_config_path)

        clean_up = tok_config.get("clean_up_tokenization_spaces", False)
        if not isinstance(clean_up, bool):
            raise ConfigError(
                f'{tok_config_path}: "clean_up_tokenization_spaces" must be true or false, got {clean_up!r}'
            )

        eos_ids = cls._load_eos_ids(model_dir, config, backend, special["eos_token"], tok_config_path)

        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=eos_ids,
            chat_templates=chat_templates,
            chat_template_source=template_source,
            clean_up_tokenization_spaces=clean_up,
        )

    @staticmethod
    def _load_eos_ids(
        model_dir: Path,
        config: dict | None,
        backend: tokenizers.Tokenizer,
        eos_token: str | None,
        tok_config_path: Path,
    ) -> tuple[int, ...]:
        gen_path = model_dir / GENERATION_CONFIG_FILE
        if gen_path.is_file():
            ids = _eos_ids(_read_json_object(gen_path).get("eos_token_id"), str(gen_path))
            if ids:
                return ids

        config_where = "config.json"
        if config is None:
            config_path = model_dir / CONFIG_FILE
            if config_path.is_file():
                config = _read_json_object(config_path)
                config_where = str(config_path)
        if config:
            ids = _eos_ids(config.get("eos_token_id"), config_where)
            if ids:
                return ids
            text_config = config.get("text_config")
            if isinstance(text_config, dict):
                ids = _eos_ids(text_config.get("eos_token_id"), f"{config_where} text_config")
                if ids:
                    return ids

        if eos_token is not None:
            token_id = backend.token_to_id(eos_token)
            if token_id is None:  # pragma: no cover - from_dir adds missing special tokens
                raise ConfigError(f'{tok_config_path}: "eos_token" {eos_token!r} is not in the vocabulary')
            return (token_id,)
        return ()

    # ------------------------------------------------------------------ properties

    @cached_property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the size of `len(AutoTokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @cached_property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` puts the BOS token first (the tokenizer.json
        post-processor decides, as in transformers 5)."""
        bos = self.bos_token_id
        if bos is None:
            return False
        ids = self.backend.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == bos and self.backend.encode("a", add_special_tokens=False).ids[:1] != [bos]

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (the one to pad with or append); `eos_token_ids` holds all of them."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (the ones `skip_special_tokens` drops)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            # transformers applies this WordPiece-era cleanup only to non-BPE tokenizers.
            text = _clean_up_tokenization(text)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` does. Extra kwargs become template variables."""
        import jinja2

        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        template = self.chat_templates.get(name)
        if template is None:
            if self.chat_templates:
                raise ConfigError(
                    f"{self._chat_template_source}: chat_template has no 'default' template "
                    f"(has {', '.join(sorted(self.chat_templates))})"
                )
            raise ConfigError(
                f"{self._chat_template_source}: the model has no chat template "
                "(no chat_template in tokenizer_config.json, no chat_template.jinja)"
            )
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ConfigError("chat_template: messages must be a non-empty list of {role, content} dicts")
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise ConfigError(f"chat_template: each message must be a dict, got {message!r}")
            # Like transformers: drop None values, alias the reasoning field names.
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)

        if tools is not None and not (
            isinstance(tools, (list, tuple)) and all(isinstance(tool, Mapping) for tool in tools)
        ):
            raise ConfigError("chat_template: tools must be a list of JSON-schema dicts")

        variables = {**self.special_tokens, **kwargs}
        variables.setdefault("documents", None)
        try:
            compiled = self._compiled.get(template)
            if compiled is None:
                compiled = self._compiled[template] = compile_template(template)
            return compiled.render(
                messages=chat,
                tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            where = f" line {exc.lineno}" if getattr(exc, "lineno", None) else ""
            raise ConfigError(
                f"{self._chat_template_source}: chat_template{where}: {_one_line(exc.message or exc)}"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # Python errors raised by template code, e.g. `'text' + message.content` on a list content.
            raise ConfigError(
                f"{self._chat_template_source}: chat_template failed on these messages: "
                f"{type(exc).__name__}: {_one_line(exc)}"
            ) from None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos_ids={self.eos_token_ids}, chat_template={'yes' if self.chat_templates else 'no'})"
        )


def _clean_up_tokenization(text: str) -> str:
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


