"""layerzoo.tokenization.tokenizer against transformers.AutoTokenizer on tokenizers built and saved here."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from layerzoo.errors import ConfigError, UserError  # noqa: E402
from layerzoo.tokenization.detokenizer import IncrementalDetokenizer  # noqa: E402
from layerzoo.tokenization.tokenizer import Tokenizer  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A Qwen2.5-style chat template: system default, tools rendered with tojson, tool calls and
# tool responses, raise_exception on a bad role, generation prompt.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# No whitespace-control dashes: exercises trim_blocks / lstrip_blocks, plus tojson options,
# namespace, loop controls and a template kwarg.
PLAIN_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}] {{ m['role'] }}: {{ m['content'] }}{{ eos_token }}
{% endfor %}
{% if tools %}{{ tools | tojson(indent=2, sort_keys=True) }}
{% endif %}
{% if extra_flag is defined %}flag={{ extra_flag }}
{% endif %}
{% if add_generation_prompt %}assistant:{% endif %}"""

CORPUS = [
    "def hello_world():\n    print('hello world')\n    return 42\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\n\nfor i in range(10):\n    x = i * 2\n",
    "class Foo(object):\n    def __init__(self, value):\n        self.value = value\n",
    "Don't stop, it's fine; they're here, we've seen.",
    "naïve café résumé",
]

TEXTS = [
    "hello world",
    "def f(x):\n    return x + 1\n",
    "  leading and trailing spaces  ",
    "Ünïcödé: naïve café — “quotes” …",
    "emoji 😀👍🏽🇫🇷 and family 👨‍👩‍👧",
    "中文字符 日本語のテキスト 한국어",
    "tab\tnewline\n\nmix<|im_start|>special<|im_end|>inside<|endoftext|>",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write hello world 👋"},
        {"role": "assistant", "content": "print('hello world')"},
        {"role": "user", "content": "Now in 中文"},
    ],
    [
        {"role": "user", "content": "What's the weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "°C"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"wind": "<none>"}'},
        {"role": "assistant", "content": "21 °C & calm"},
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather <in> a city & \"quote\" — ünïcode",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["°C", "°F"]}},
                "required": ["city"],
            },
        },
    }
]


def _train_backend(vocab_size: int = 320) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


@pytest.fixture(scope="module")
def backend() -> HFTokenizer:
    return _train_backend()


def _save(
    backend: HFTokenizer,
    path: Path,
    *,
    chat_template=QWEN_TEMPLATE,
    save_jinja_files: bool = True,
    **special,
) -> Path:
    special.setdefault("eos_token", "<|im_end|>")
    special.setdefault("pad_token", "<|endoftext|>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer.from_str(backend.to_str()), chat_template=chat_template, **special
    )
    fast.save_pretrained(str(path), save_jinja_files=save_jinja_files)
    return path


@pytest.fixture(scope="module")
def qwen_dir(backend, tmp_path_factory) -> Path:
    return _save(backend, tmp_path_factory.mktemp("qwen"))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


# ---------------------------------------------------------------- encode / decode


def test_encode_decode_match_transformers(qwen_dir):
    ours = Tokenizer.from_dir(qwen_dir)
    ref = AutoTokenizer.from_pretrained(str(qwen_dir))
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == ref.encode(text, add_special_tokens=add_special), text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    # Unicode round-trips through byte-level BPE.
    for text in TEXTS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_special_token_ids_and_vocab(qwen_dir):
    ours = Tokenizer.from_dir(qwen_dir)
    ref = AutoTokenizer.from_pretrained(str(qwen_dir))
    assert ours.vocab_size == len(ref)
    assert ours.pad_token_id == ref.pad_token_id == ref.convert_tokens_to_ids("<|endoftext|>")
    assert ours.bos_token_id is None and ref.bos_token_id is None
    assert ours.eos_token_ids == (ref.eos_token_id,)
    assert ours.eos_token_id == ref.convert_tokens_to_ids("<|im_end|>")


def test_bos_from_tokenizer_json_post_processor(backend, tmp_path):
    # A Llama-style tokenizer.json whose post-processor adds BOS. Like transformers 5, the
    # tokenizer.json post-processor decides; add_bos_token in tokenizer_config.json is ignored.
    bos_backend = HFTokenizer.from_str(backend.to_str())
    bos_id = bos_backend.token_to_id("<|endoftext|>")
    bos_backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", bos_id)]
    )
    path = _save(bos_backend, tmp_path / "bos", bos_token="<|endoftext|>")
    for add_bos in (None, True, False):
        _edit_json(
            path / "tokenizer_config.json",
            add_bos_token=add_bos,
            bos_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
        )
        ours = Tokenizer.from_dir(path)
        ref = AutoTokenizer.from_pretrained(str(path))
        assert ours.bos_token_id == ref.bos_token_id == bos_id
        assert ours.add_bos_token
        for text in TEXTS:
            ids = ours.encode(text)
            assert ids == ref.encode(text)
            assert ids[0] == bos_id
            assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)

    plain = _save(backend, tmp_path / "nobos", bos_token="<|endoftext|>")
    _edit_json(plain / "tokenizer_config.json", add_bos_token=True)
    ours = Tokenizer.from_dir(plain)
    assert not ours.add_bos_token
    assert ours.encode("hi") == AutoTokenizer.from_pretrained(str(plain)).encode("hi")


def test_special_token_missing_from_vocab_is_added(backend, tmp_path):
    path = _save(backend, tmp_path / "extra", bos_token="<s>")
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(str(path))
    assert ours.bos_token_id == ref.bos_token_id is not None
    assert ours.vocab_size == len(ref)
    assert ours.encode("a <s> b") == ref.encode("a <s> b")


# ---------------------------------------------------------------- chat templates


def test_chat_template_matches_transformers(qwen_dir):
    assert (qwen_dir / "chat_template.jinja").is_file()  # how transformers 5 saves it
    ours = Tokenizer.from_dir(qwen_dir)
    ref = AutoTokenizer.from_pretrained(str(qwen_dir))
    for chat in CHATS:
        for gen in (True, False):
            for tools in (None, TOOLS):
                got = ours.apply_chat_template(chat, add_generation_prompt=gen, tools=tools)
                want = ref.apply_chat_template(chat, add_generation_prompt=gen, tools=tools, tokenize=False)
                assert got == want
    text = ours.apply_chat_template(CHATS[1])
    assert text.endswith("<|im_start|>assistant\n")
    # The rendered prompt tokenizes the control tokens as single special tokens.
    assert ours.encode(text, add_special_tokens=False) == ref.apply_chat_template(
        CHATS[1], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_chat_template_trim_blocks_tojson_and_kwargs(backend, tmp_path):
    path = _save(backend, tmp_path / "plain", chat_template=PLAIN_TEMPLATE, bos_token="<|endoftext|>")
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(str(path))
    chat = [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ß & <b>"},
    ]
    for gen in (True, False):
        for tools in (None, TOOLS):
            for extra in ({}, {"extra_flag": "yes"}):
                got = ours.apply_chat_template(chat, add_generation_prompt=gen, tools=tools, **extra)
                want = ref.apply_chat_template(chat, add_generation_prompt=gen, tools=tools, tokenize=False, **extra)
                assert got == want
    rendered = ours.apply_chat_template(chat, tools=TOOLS)
    assert "ünïcode" in rendered and "<in>" in rendered  # tojson: ensure_ascii=False, no HTML escaping
    # A kwarg overrides a special-token variable, as in transformers.
    assert ours.apply_chat_template(chat, bos_token="BOS").startswith("BOS")


@pytest.mark.parametrize("form", ["string", "list"])
def test_chat_template_in_tokenizer_config(backend, tmp_path, form):
    path = _save(backend, tmp_path / form, chat_template=None)
    value = QWEN_TEMPLATE if form == "string" else [
        {"name": "default", "template": QWEN_TEMPLATE},
        {"name": "other", "template": "other"},
    ]
    _edit_json(path / "tokenizer_config.json", chat_template=value)
    assert not (path / "chat_template.jinja").exists()
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(str(path))
    for chat in CHATS:
        assert ours.apply_chat_template(chat) == ref.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )


def test_chat_template_json_file(backend, tmp_path):
    path = _save(backend, tmp_path / "ctjson", chat_template=None)
    (path / "chat_template.json").write_text(json.dumps({"chat_template": PLAIN_TEMPLATE}))
    ours = Tokenizer.from_dir(path)
    assert ours.chat_template == PLAIN_TEMPLATE
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]).endswith("assistant:")


def test_chat_template_jinja_file_overrides_config(backend, tmp_path):
    path = _save(backend, tmp_path / "override", chat_template="jinja file {{ messages[0]['content'] }}")
    _edit_json(path / "tokenizer_config.json", chat_template="config {{ messages[0]['content'] }}")
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(str(path))
    chat = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False) == "jinja file x"


def test_strftime_now(backend, tmp_path):
    path = _save(backend, tmp_path / "date", chat_template="{{ strftime_now('%Y-%m') }}")
    ours = Tokenizer.from_dir(path)
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == datetime.now().strftime("%Y-%m")


def test_raise_exception_is_config_error(qwen_dir):
    ours = Tokenizer.from_dir(qwen_dir)
    with pytest.raises(ConfigError) as info:
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    message = str(info.value)
    assert "chat_template" in message and "unknown role robot" in message and "\n" not in message
    assert isinstance(info.value, UserError)


def test_template_syntax_error_is_config_error(backend, tmp_path):
    path = _save(backend, tmp_path / "syntax", chat_template="{% for m in messages %}{{ m }}")
    ours = Tokenizer.from_dir(path)
    with pytest.raises(ConfigError, match=r"chat_template.*line 1") as info:
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)


def test_template_python_error_is_config_error(qwen_dir):
    ours = Tokenizer.from_dir(qwen_dir)
    with pytest.raises(ConfigError, match=r"chat_template failed.*TypeError"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    with pytest.raises(ConfigError, match="tools must be"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], tools=["not a schema"])


def test_no_chat_template(backend, tmp_path):
    path = _save(backend, tmp_path / "none", chat_template=None)
    ours = Tokenizer.from_dir(path)
    with pytest.raises(ConfigError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escape(backend, tmp_path):
    path = _save(backend, tmp_path / "escape", chat_template="{{ messages.__class__.__mro__ }}")
    ours = Tokenizer.from_dir(path)
    with pytest.raises(ConfigError, match="chat_template.*unsafe"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------- EOS ids


def test_eos_precedence(backend, tmp_path):
    path = _save(backend, tmp_path / "eos")
    im_end = 2
    assert Tokenizer.from_dir(path).eos_token_ids == (im_end,)  # tokenizer_config eos_token

    (path / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert Tokenizer.from_dir(path).eos_token_ids == (0,)  # config.json read from the folder
    assert Tokenizer.from_dir(path, config={"eos_token_id": [1, 0]}).eos_token_ids == (1, 0)
    assert Tokenizer.from_dir(path, config={"text_config": {"eos_token_id": 1}}).eos_token_ids == (1,)
    assert Tokenizer.from_dir(path, config={"eos_token_id": None}).eos_token_ids == (im_end,)

    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer.from_dir(path, config={"eos_token_id": 1}).eos_token_ids == (2, 0)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert Tokenizer.from_dir(path).eos_token_ids == (1,)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    assert Tokenizer.from_dir(path).eos_token_ids == (0,)  # falls through to config.json


def test_bad_eos_value_names_file(backend, tmp_path):
    path = _save(backend, tmp_path / "badeos")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ConfigError, match=r"generation_config\.json.*eos_token_id"):
        Tokenizer.from_dir(path)


# ---------------------------------------------------------------- file errors


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ConfigError, match=r"tokenizer\.json") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_unparsable_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json: cannot be parsed") as info:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(info.value)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nope"}}))
    with pytest.raises(ConfigError, match=r"tokenizer\.json: cannot be parsed"):
        Tokenizer.from_dir(tmp_path)


def test_bad_tokenizer_config(backend, tmp_path):
    path = _save(backend, tmp_path / "badcfg")
    (path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_dir(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(ConfigError, match=r'tokenizer_config\.json: "eos_token" must be'):
        Tokenizer.from_dir(path)
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(ConfigError, match=r'tokenizer_config\.json: "chat_template" must be'):
        Tokenizer.from_dir(path)


# ---------------------------------------------------------------- incremental detokenizer

DETOK_TEXTS = [
    "print('héllo') # 😀 中文字符 👨‍👩‍👧 done",
    "中文字符日本語😀😀👍🏽",
    "def f():\n    return '🇫🇷'\n",
]


@pytest.mark.parametrize("text", DETOK_TEXTS)
def test_incremental_detokenizer_matches_full_decode(qwen_dir, text):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode(text, add_special_tokens=False)
    # The byte-level vocab is tiny, so multi-byte characters really are split over tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids) == text
    assert detok.flush() == ""


def test_incremental_detokenizer_with_prompt_and_specials(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi 😀"}]))
    gen = tok.encode("Sure: 中文 😀<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
        pieces = [detok.feed(i) for i in gen]
        assert all("\ufffd" not in p for p in pieces)
        assert detok.text == "".join(pieces) == tok.decode(gen, skip_special_tokens=skip)
    assert detok.text.endswith("<|im_end|>")


def test_incremental_detokenizer_window_stays_small(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode("x = 1\n" * 300 + "😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.feed(i)
        assert len(detok._ids) <= 8
    assert detok.text == tok.decode(ids)


def test_incremental_detokenizer_flush_partial_character(qwen_dir):
    tok = Tokenizer.from_dir(qwen_dir)
    ids = tok.encode("ab😀", add_special_tokens=False)
    cut = ids[:-1]  # generation stopped inside the emoji's bytes
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed(i) for i in cut]
    assert "".join(pieces) == "ab"
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert detok.text == tok.decode(cut)


def test_incremental_detokenizer_metaspace(tmp_path):
    # SentencePiece-style: the decoder strips the space of a sequence's first word, so the
    # window must keep earlier tokens in front of the new one.
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    path = tmp_path / "spm"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(str(path))
    ours = Tokenizer.from_dir(path)
    ref = AutoTokenizer.from_pretrained(str(path))
    text = "the quick brown fox jumps over the lazy dog"
    ids = ours.encode(text)
    assert ids == ref.encode(text) and ours.decode(ids) == ref.decode(ids) == text
    detok = IncrementalDetokenizer(ours)
    assert "".join(detok.feed(i) for i in ids) == text
    prompt, gen = ids[:4], ids[4:]
    detok = IncrementalDetokenizer(ours, prompt_ids=prompt)
    assert "".join(detok.feed(i) for i in gen) == ours.decode(ids)[len(ours.decode(prompt)) :]


# ---------------------------------------------------------------- the embedded default model

EMBEDDED = Path(__file__).resolve().parent.parent / "core" / "embedded" / "tiny-qwen3-stdlib"


@pytest.mark.skipif(not (EMBEDDED / "tokenizer.json").is_file(), reason="embedded model not built")
def test_embedded_model_tokenizer():
    ours = Tokenizer.from_dir(EMBEDDED)
    ref = AutoTokenizer.from_pretrained(str(EMBEDDED))
    assert ours.vocab_size == len(ref) == 2048
    eot = ref.convert_tokens_to_ids("<|endoftext|>")
    assert ours.eos_token_ids == (eot,) and ours.pad_token_id == eot
    for text in TEXTS + ["import os\nimport sys\n\ndef main(argv=None):\n    return 0\n"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        for tools in (None, TOOLS):
            assert ours.apply_chat_template(chat, tools=tools) == ref.apply_chat_template(
                chat, tools=tools, add_generation_prompt=True, tokenize=False
            )
