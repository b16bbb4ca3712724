"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers` tokenizer.

A GGUF stores no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), the
BPE merges, each token's type (control tokens are special), the special ids, the chat template and
the name of the pre-tokenizer its merges were learned with (``tokenizer.ggml.pre``). This builds
the byte-level BPE tokenizer that transformers builds from the same metadata; sentencepiece
(``llama``) vocabularies and other models are refused by name.
"""

from __future__ import annotations

from layerzoo.errors import ConfigError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

# How text is split before BPE, by ``tokenizer.ggml.pre``; any other name splits as GPT-2 does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def build_backend(gguf):
    """The `tokenizers.Tokenizer` of the opened `layerzoo.loading.gguf_loading.GGUFModel` ``gguf``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    where = gguf.path
    kind = gguf.value("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"{where}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', byte-level BPE)"
        )
    tokens = gguf.value("tokenizer.ggml.tokens")
    merges = gguf.value("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ConfigError(f"{where}: tokenizer.ggml.tokens and tokenizer.ggml.merges are required")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token spelled outside the byte alphabet (a control token like <|im_end|> usually is not) is
    # respelled byte by byte, as transformers does, so the vocabulary keeps one id per token.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)
    }
    bpe = models.BPE(
        vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
    )
    backend = Tokenizer(bpe)
    split = PRE_TOKENIZER_SPLITS.get(gguf.value("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    types = gguf.value("tokenizer.ggml.token_type") or []
    control = [t for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab]
    specials = [gguf.value(f"tokenizer.ggml.{n}_token_id") for n in ("bos", "eos", "unknown", "padding")]
    control += [tokens[i] for i in specials if i is not None and i < len(tokens)]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(control)])
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    bos = gguf.value("tokenizer.ggml.bos_token_id")
    if gguf.value("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_token = tokens[bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_token}:0 $A:0", pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1", special_tokens=[(bos_token, bos)]
        )
    return backend


def gguf_tokenizer_parts(path) -> dict:
    """What a `layerzoo.tokenization.tokenizer.Tokenizer` is built from, read from the GGUF file at `path`:
    ``Tokenizer(**gguf_tokenizer_parts(path))`` (its backend, special tokens, EOS ids, chat template)."""
    from layerzoo.loading.gguf_loading import GGUFModel

    gguf = GGUFModel.open(path)
    backend = build_backend(gguf)
    tokens = gguf.value("tokenizer.ggml.tokens")

    def token(key: str):
        index = gguf.value(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and index < len(tokens) else None

    special = {
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
    }
    # llama.cpp ends generation at any end-of-generation token: eos, and eot/eom where given.
    eos = [gguf.value(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    template = gguf.value("tokenizer.chat_template")
    return dict(
        backend=backend,
        special_tokens=special,
        eos_token_ids=[i for i in dict.fromkeys(eos) if i is not None],
        chat_templates={"default": template} if template else {},
        chat_template_source=f"{gguf.path} (tokenizer.chat_template)",
    )
