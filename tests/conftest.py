import importlib
import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `python -m pytest` from the repository root puts the root on sys.path, where the `kernels/` folder
# (layerzoo.kernels) then answers to the top-level name `kernels`: the Hugging Face package that
# transformers (and vLLM) probe with find_spec + import. The code under test is installed, so the
# root is not needed on the path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 checkpoint (safetensors + word tokenizer) saved by transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from layerzoo.testing import write_word_tokenizer

    path = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, initializer_range=0.25, eos_token_id=None, bos_token_id=None,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return path


# The server tests' shared pieces: a module's `server` fixture (this default one: the embedded
# model with default flags; a module that needs other flags defines its own), the official OpenAI
# client against it, and the same model offline as the reference.


@pytest.fixture(scope="module")
def server():
    from layerzoo.server.process import ServerProcess

    with ServerProcess() as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The embedded model in this process, one thread (the server has the other core)."""
    import torch

    from layerzoo.llm import LLM

    torch.set_num_threads(1)
    return LLM()


def _resolve_dotted(dotted: str):
    """``layerzoo.a.b.C.attr`` -> the object: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.fixture
def resolve_dotted():
    """The docs' checks: a dotted name a document cites, resolved (AttributeError/ImportError if gone)."""
    return _resolve_dotted
