"""The stand-in for a tokenizer under ``skip_tokenizer_init=True``: token ids in, token ids out.

vLLM users pass ``skip_tokenizer_init`` to serve a model whose tokenizer files are missing or
handled elsewhere. The engine still needs the EOS ids (from generation_config.json or
config.json, as `Tokenizer` reads them) and something to detokenize with: here every decode is
empty, so outputs carry token ids and no text. Text in, stop strings and chat templates are
refused with a message saying why.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from layerzoo.errors import UserError
from layerzoo.loading.hf_files import eos_ids, read_json_object
from layerzoo.tokenization.tokenizer import GENERATION_CONFIG_FILE


class TokenIdsOnly:
    """What the engine asks of a tokenizer, without one: EOS ids, a vocabulary size, empty text."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = ()):
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.chat_templates: dict[str, str] = {}

    @classmethod
    def from_dir(cls, model_dir: Path, hf_config: dict) -> TokenIdsOnly:
        eos: tuple[int, ...] = ()
        gen_path = Path(model_dir) / GENERATION_CONFIG_FILE
        if gen_path.is_file():
            eos = eos_ids(read_json_object(gen_path).get("eos_token_id"), str(gen_path)) or ()
        if not eos:
            eos = eos_ids(hf_config.get("eos_token_id"), "config.json") or ()
        return cls(int(hf_config.get("vocab_size", 0)), eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise UserError("prompt: skip_tokenizer_init=True takes token ids only ({'prompt_token_ids': [...]}), got text")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return ""

    def apply_chat_template(self, *args, **kwargs) -> str:
        raise UserError("chat template: skip_tokenizer_init=True loads no tokenizer, so there is no chat template")
