import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
