"""Llama on 2 tensor-parallel ranks (CPU processes, gloo), without the engine: it gets tensor
parallelism from the core's attention and MLP alone. With ``attention_bias`` the o projection is
row-parallel with a bias, which must be added once (on rank 0), not once per rank."""

import torch

from layerzoo.loading.model_loading import load_model
from layerzoo.testing import write_word_tokenizer
from layerzoo.testing.distributed import run_on_ranks, step_logits

CHUNKS, DECODES = [11, 6], 2


def test_llama_with_row_parallel_bias_matches_single_process(tmp_path, llama_tiny):
    config = llama_tiny.llama_config(attention_bias=True, num_hidden_layers=2)
    config._attn_implementation = "eager"
    config.initializer_range = 0.25
    torch.manual_seed(2)
    import transformers

    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts biases at zero: make the o bias count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path, config.vocab_size)
    ids = torch.randint(0, config.vocab_size, (sum(CHUNKS) + DECODES,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt, decode = ids[: sum(CHUNKS)], ids[sum(CHUNKS) :]
    expected = step_logits(load_model(tmp_path).model, prompt, CHUNKS, decode)
    results = run_on_ranks("layerzoo.testing.distributed:prefill_on_rank", str(tmp_path), prompt, CHUNKS, True, decode)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], expected, atol=1e-4, rtol=1e-4, msg=f"rank {rank}")
