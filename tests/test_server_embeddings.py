"""``POST /v1/embeddings`` through `layerzoo serve`, driven by the `openai` client and raw HTTP: a
bare ``Qwen3Model`` checkpoint (Qwen3-Embedding's layout, last-token pooling by its class) and a
``Qwen3ForCausalLM`` one served with ``--pooling mean``; embeddings equal transformers' pooled
``last_hidden_state``; every refusal is a 400 naming its field."""

from __future__ import annotations

import base64
import struct

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from layerzoo.server.process import ServerProcess  # noqa: E402
from layerzoo.testing import write_word_tokenizer  # noqa: E402

VOCAB, HIDDEN = 89, 32


def save(path, cls):
    torch.manual_seed(3)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.25,
    )
    config._attn_implementation = "eager"
    cls(config).eval().save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return path


def reference(model_dir, ids: list[int], method: str) -> torch.Tensor:
    model = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden[-1] if method == "last" else hidden.mean(dim=0), dim=0)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    path = save(tmp_path_factory.mktemp("embed-server") / "bare", transformers.Qwen3Model)
    # 16 tokens a step: the 40-token input runs in chunks
    with ServerProcess("--model", str(path), "--served-model-name", "emb", "--max-num-batched-tokens", "16") as s:
        yield path, s


@pytest.fixture(scope="module")
def client(bare):
    return openai.OpenAI(base_url=f"{bare[1].url}/v1", api_key="none", max_retries=0, timeout=60)


def words(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def test_openai_client_embeddings_equal_transformers(bare, client):
    path, _ = bare
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 40)]
    # the client asks for base64 by default and decodes it
    res = client.embeddings.create(model="emb", input=[words(ids) for ids in inputs])
    assert res.object == "list" and res.model == "emb" and [d.index for d in res.data] == [0, 1, 2]
    assert res.usage.prompt_tokens == res.usage.total_tokens == 48
    for ids, item in zip(inputs, res.data):
        assert item.object == "embedding" and len(item.embedding) == HIDDEN
        torch.testing.assert_close(torch.tensor(item.embedding), reference(path, ids, "last"), rtol=1e-5, atol=1e-5)
    # token ids, one list and a list of lists, as floats
    floats = client.embeddings.create(model="emb", input=inputs[1], encoding_format="float")
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), torch.tensor(res.data[1].embedding))
    many = client.embeddings.create(model="emb", input=inputs, encoding_format="float")
    # the same input, batched with others or alone
    torch.testing.assert_close(torch.tensor(many.data[1].embedding), torch.tensor(floats.data[0].embedding), rtol=1e-5, atol=1e-5)
    for ids, item in zip(inputs, many.data):
        torch.testing.assert_close(torch.tensor(item.embedding), reference(path, ids, "last"), rtol=1e-5, atol=1e-5)


def test_base64_is_float32_little_endian(bare):
    _, server = bare
    body = {"input": "t1 t2 t3", "encoding_format": "base64"}
    b64 = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    floats = httpx.post(f"{server.url}/v1/embeddings", json={**body, "encoding_format": "float"}, timeout=60).json()
    decoded = struct.unpack(f"<{HIDDEN}f", base64.b64decode(b64))
    assert list(decoded) == pytest.approx(floats["data"][0]["embedding"], rel=1e-7)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": []}, "input", "input: expected at least one"),
        ({"input": ""}, "input", "input: expected text or token ids to embed, got an empty string"),
        ({"input": ["t1", ""]}, "input.1", "input.1: expected text or token ids to embed, got an empty string"),
        ({"input": [[1, 2], []]}, "input.1", "input.1: expected text or token ids to embed, got an empty token-id list"),
        ({"input": [5, VOCAB]}, "input", "input: token ids must be ints in [0, 89)"),
        ({"input": "t1", "dimensions": 8}, "dimensions", "dimensions: not supported"),
        ({"input": "t1", "encoding_format": "int8"}, "encoding_format", "encoding_format:"),
        ({"input": "t1", "pooling": "mean"}, "pooling", "pooling: unrecognized request argument"),
        ({}, "input", "input: Field required"),
        ({"input": 3}, "input", "input: expected one of"),
    ],
)
def test_refusals_name_the_field(bare, body, param, message):
    _, server = bare
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_embedding_model_refuses_completions(bare, client):
    with pytest.raises(openai.BadRequestError, match="embedding model .*cannot generate"):
        client.completions.create(model="emb", prompt="t1 t2", max_tokens=3)


def test_mean_pooling_flag(tmp_path_factory):
    path = save(tmp_path_factory.mktemp("embed-server-mean") / "causal", transformers.Qwen3ForCausalLM)
    with ServerProcess("--model", str(path), "--served-model-name", "m", "--pooling", "mean") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        ids = [4, 8, 15, 16, 23, 42]
        res = client.embeddings.create(model="m", input=[ids])
        torch.testing.assert_close(torch.tensor(res.data[0].embedding), reference(path, ids, "mean"), rtol=1e-5, atol=1e-5)
        # the same checkpoint still generates
        assert client.completions.create(model="m", prompt="t1 t2", max_tokens=2).choices[0].finish_reason == "length"
