"""Make the K-quant GGUF test files (tests/data/kquants/) with llama.cpp's own quantizer.

CI cannot build llama.cpp in its time, so the files its tests read are made here once and shipped:
a tiny random Qwen3 (1 layer, hidden 256 so every row fills K-quant blocks of 256, vocab 320,
seeded) written as an F32 GGUF by `layerzoo.testing.gguf_files.write_gguf`, then quantized by
``llama_model_quantize`` (llama-cpp-python) to the usual K-quant mixes. transformers reads the same
files (it dequantizes them with the gguf package), which is what tests/test_gguf_kquants.py compares
against. Run::

    PEER=$(../shared/tools/peer-llama-setup)        # a venv with llama-cpp-python
    .venv/bin/python scripts/make_kquant_fixtures.py --llama-python "$PEER"
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "kquants"
KINDS = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")
VOCAB = 320


def config():
    import transformers

    return transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=256,
                                    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-python", required=True, help="interpreter of a venv with llama-cpp-python")
    args = p.parse_args()
    import torch
    import transformers

    from layerzoo.testing.gguf_files import byte_level_bpe, write_gguf

    sys.path.insert(0, str(OUT.parent.parent.parent / "bench"))
    from llama_quantize import quantize  # llama.cpp's quantizer, shared with the benches

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = transformers.Qwen3ForCausalLM(config())
        with torch.no_grad():  # weights of a trained model's scale, so the logits are not all near ties
            for name, param in model.named_parameters():
                if name.endswith("weight") and param.dim() == 2:
                    param.normal_(0, 0.08)
        model.save_pretrained(Path(tmp) / "src")
        f32 = write_gguf(Path(tmp) / "f32.gguf", Path(tmp) / "src", qtype="F32", tokenizer=byte_level_bpe(VOCAB))
        for name in KINDS:
            dst = OUT / f"qwen3-tiny-{name}.gguf"
            try:
                quantize(args.llama_python, f32, dst, name.lower())
            except RuntimeError as error:
                sys.exit(f"{name}: {error}")
            print(f"{dst.relative_to(OUT.parent.parent.parent)}: {dst.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
