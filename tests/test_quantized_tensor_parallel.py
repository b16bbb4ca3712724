"""Tensor-parallel splits of each linear method (GGUF blocks, the hub's 4-bit formats, FP8).

Unit level, no processes: the whole layer and each rank's piece load through the loader from one
checkpoint of the whole layer's tensors (each rank reads its slices); the ranks' dequantized
weights put side by side are exactly the whole one, and their outputs gathered (a column split:
each section's pieces side by side; a row split: summed over the ranks) are the whole layer's.
A piece that falls inside a block, word or scale group is refused by name (a GGUF layer is
dequantized instead, with a warning). End to end, one tiny model per family gives the same greedy
tokens on two ranks as on one process, with the ranks holding their pieces in the format.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from layerzoo.distributed.sharding import Shard, parameter_shards
from layerzoo.layers.fp8_linear import FP8Linear
from layerzoo.layers.gguf_linear import GGUFLinear, keep_blocks
from layerzoo.layers.int4_linear import Int4Linear
from layerzoo.layers.linear_method import SplitError
from layerzoo.layers.parallel_linear import row_parallel_linear, split_rows
from layerzoo.loading.loader import Checkpoint, load_weights
from layerzoo.testing.distributed import pretend_rank

WORLD = 2


def sibling(name: str):
    """A per-format test module, for its packers (the formats written from their definitions)."""
    spec = importlib.util.spec_from_file_location(f"_packers_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the split layers against the whole ---------------------------------------------------------


def load_ranks(build, tensors: dict[str, torch.Tensor], shard_of_rank, folder: Path) -> list[nn.Module]:
    """``[whole, rank 0, rank 1]``: ``build()`` (on the meta device) split by ``shard_of_rank(r)``,
    each filled by the loader from one file of the whole layer's ``tensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    checkpoint = Checkpoint.open(folder)
    out = []
    for shard in [None, *(shard_of_rank(r) for r in range(WORLD))]:
        with torch.device("meta"):
            module = build()
            if shard is not None:
                module.split(shard)
        module = module.to_empty(device="cpu")
        load_weights(module, checkpoint)
        module.process_weights_after_loading()
        out.append(module)
    return out


def rank_index(dim_size_sections: tuple[int, ...], rank: int) -> torch.Tensor:
    """The whole tensor's rows (along the split dim) that rank ``rank`` holds, in its order."""
    return torch.cat([torch.arange(a, b) for a, b in Shard(0, dim_size_sections, rank, WORLD).ranges()])


def assemble(pieces: list[torch.Tensor], dim: int, sections: tuple[int, ...]) -> torch.Tensor:
    """The ranks' pieces along ``dim`` put back in the whole tensor's order."""
    shape = list(pieces[0].shape)
    shape[dim] = sum(sections)
    whole = pieces[0].new_zeros(shape)
    for rank, piece in enumerate(pieces):
        whole.index_copy_(dim, rank_index(sections, rank), piece)
    return whole


def assert_split_is_whole(modules: list[nn.Module], dim: int, sections: tuple[int, ...], in_features: int):
    """The ranks' weights are the whole one's, exactly; their outputs gathered are its output for
    a few rows (the GEMV kernels) and more rows (dequantize + GEMM)."""
    whole, *ranks = modules
    weights = [m.dequantized_weight() for m in ranks]
    assert torch.equal(assemble(weights, dim, sections), whole.dequantized_weight())
    torch.manual_seed(0)
    for rows in (1, 3, 11):
        x = torch.randn(rows, in_features)
        want = whole(x)
        if dim == 0:
            got = assemble([m(x) for m in ranks], 1, sections)
        else:
            got = sum(m(x.index_select(1, rank_index(sections, r))) for r, m in enumerate(ranks))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def split(dim: int, sections: tuple[int, ...]):
    return lambda rank: Shard(dim, sections, rank, WORLD)


# GGUF: whole rows of blocks; columns on the blocks' boundaries (256 inputs for the K-quants)

Q4_0, Q8_0, Q4_K = 2, 8, 12


def gguf_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``[n, row_bytes]`` blocks: the gguf package's quantization of a normal weight where it
    quantizes the type, else random bytes with sane fp16 scales (d, dmin of a Q4_K block)."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    if qtype != Q4_K:
        data = gguf_quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(data))
    elements, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    data = rng.integers(0, 256, (n, k // elements, size), dtype=np.uint8)
    for offset in (0, 2):
        data[..., offset:offset + 2] = rng.uniform(0.001, 0.05, (n, k // elements)).astype(np.float16).view(np.uint8).reshape(
            n, k // elements, 2)
    return torch.from_numpy(np.ascontiguousarray(data.reshape(n, -1)))


@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_K], ids=["Q8_0", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("dim,sections", [(0, (64, 32, 32)), (1, (512,))], ids=["columns-qkv", "rows"])
def test_gguf_split_is_the_whole_layer(tmp_path, qtype, dim, sections):
    n, k = (sum(sections), 512) if dim == 0 else (48, sections[0])
    tensors = {"weight": gguf_blocks(qtype, n, k), "bias": torch.randn(n)}
    modules = load_ranks(lambda: GGUFLinear(k, n, qtype, bias=True, name="proj"), tensors, split(dim, sections), tmp_path)
    assert modules[1].weight.shape[dim] == modules[0].weight.shape[dim] // 2  # each rank holds half the blocks
    assert_split_is_whole(modules, dim, sections, k)


def test_gguf_columns_inside_a_block_are_refused_and_that_layer_is_dequantized(caplog):
    with torch.device("meta"), pytest.raises(SplitError, match=r"layers\.0\.down: Q4_K blocks hold 256 inputs each; its 256 "
                                                             r"input columns do not split into 2 pieces of whole blocks"):
        GGUFLinear(256, 64, Q4_K, name="layers.0.down").split(Shard(1, (256,), 0, 2))
    model = nn.Module()
    with pretend_rank(1, 2), torch.device("meta"):
        model.down = row_parallel_linear(256, 64, shard=split_rows(256))  # 128 columns a rank: half a Q4_K block
        model.up = row_parallel_linear(512, 64, shard=split_rows(512))  # 256: one whole block a rank
        with caplog.at_level(logging.WARNING, logger="layerzoo.layers.gguf_linear"):
            kept = keep_blocks(model, {"down.weight": Q4_K, "up.weight": Q4_K}, None, {}, torch.float32, frozenset({Q4_K}))
    assert kept == {"up.weight"} and type(model.down) is nn.Linear and isinstance(model.up, GGUFLinear)
    assert "down: Q4_K blocks hold 256 inputs" in caplog.text and "dequantized to torch.float32 instead" in caplog.text


# 4-bit: rows of packed values and their scales/zeros; columns on group boundaries, or anywhere with g_idx

INT4 = [("ct_sym", 32, False), ("ct_asym", 32, False), ("ct_sym", 32, True), ("ct_asym", -1, False), ("awq", 32, False),
        ("gptq", 32, False), ("gptq", 32, True), ("gptq", -1, False)]


def int4_layer(fmt: str, n: int, k: int, group: int, act_order: bool, seed: int = 0):
    """``(build, tensors)`` of one 4-bit linear of ``fmt`` (with a bias) packed by test_int4_linear's packer."""
    torch.manual_seed(seed)
    tensors, _ = sibling("test_int4_linear").pack(fmt, torch.randn(n, k), group, act_order)
    tensors["bias"] = torch.randn(n)
    shapes = {leaf: (tuple(t.shape), t.dtype) for leaf, t in tensors.items() if leaf != "bias"}
    kind = {"ct": "compressed"}.get(fmt.split("_")[0], fmt.split("_")[0])
    return (lambda: Int4Linear(k, n, kind, shapes, group, True, name="proj", zero_offset=1 if kind == "gptq" else 0)), tensors


@pytest.mark.parametrize("fmt,group,act_order", INT4, ids=[f"{f}-g{g}{'-actorder' if a else ''}" for f, g, a in INT4])
@pytest.mark.parametrize("dim,sections", [(0, (32, 16, 16)), (1, (128,))], ids=["columns-qkv", "rows"])
def test_int4_split_is_the_whole_layer(tmp_path, fmt, group, act_order, dim, sections):
    n, k = (sum(sections), 128) if dim == 0 else (48, sections[0])
    build, tensors = int4_layer(fmt, n, k, group, act_order)
    modules = load_ranks(build, tensors, split(dim, sections), tmp_path)
    assert all(m.in_features == k // (1 + dim) and m.out_features == n // (2 - dim) for m in modules[1:])
    if dim == 1 and act_order:  # groups of scattered columns: each rank pads its part of every group
        assert all(m.padded for m in modules[1:])
    elif dim == 1:  # groups in order: each rank holds whole groups of its own columns, nothing gathered
        assert not any(m.padded or m.perm is not None for m in modules[1:])
    assert_split_is_whole(modules, dim, sections, k)


def test_int4_pieces_inside_a_group_or_a_packed_word_are_refused():
    build, _ = int4_layer("awq", 48, 192, 64, False)  # 96 columns a rank: one and a half groups
    with torch.device("meta"), pytest.raises(SplitError, match=r"proj: awq qzeros holds one entry per 64 input columns; "
                                                             r"its 192 input columns do not split into 2 pieces"):
        build().split(Shard(1, (192,), 0, 2))
    build, _ = int4_layer("ct_asym", 24, 64, 32, False)  # 12 rows a rank: zero points are packed 8 rows a word
    with torch.device("meta"), pytest.raises(SplitError, match=r"weight_zero_point holds one entry per 8 output rows"):
        build().split(Shard(0, (24,), 1, 2))


# FP8: rows or columns as a plain weight; a block scale with its blocks

FP8_CASES = [("channel", None, (64, 32, 32)), ("tensor", None, (64, 32, 32)), ("block", (32, 64), (64, 64))]


@pytest.mark.parametrize("kind,block,column_sections", FP8_CASES, ids=[c[0] for c in FP8_CASES])
@pytest.mark.parametrize("dim", [0, 1], ids=["columns", "rows"])
def test_fp8_split_is_the_whole_layer(tmp_path, kind, block, column_sections, dim):
    sections = column_sections if dim == 0 else (256,)
    n, k = (sum(sections), 128) if dim == 0 else (48, 256)
    torch.manual_seed(0)
    tensors, _ = sibling("test_fp8_linear").quantize(torch.randn(n, k), kind, block)
    tensors["bias"] = torch.randn(n)
    shapes = {leaf: (tuple(t.shape), t.dtype) for leaf, t in tensors.items() if leaf != "bias"}
    modules = load_ranks(lambda: FP8Linear(k, n, shapes, True, block=block, name="proj"), tensors, split(dim, sections), tmp_path)
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight.shape[dim] == (n, k)[dim] // 2 for m in modules[1:])
    assert_split_is_whole(modules, dim, sections, k)


def test_fp8_pieces_inside_a_block_are_refused():
    shapes = {"weight": ((128, 256), torch.float8_e4m3fn), "weight_scale_inv": ((1, 2), torch.float32)}
    with torch.device("meta"), pytest.raises(SplitError, match=r"proj: weight_scale_inv scales blocks of \[128, 128\]; its 128 "
                                                             r"output rows do not split into 2 pieces of whole blocks of 128"):
        FP8Linear(256, 128, shapes, block=(128, 128), name="proj").split(Shard(0, (128,), 0, 2))


def test_a_rank_reads_only_its_slices_of_the_packed_tensors(tmp_path, monkeypatch):
    """Rank 1 of 2 reads its slices of an FP8 checkpoint's weights and scales, also through the
    view that hides the static input scales (never a packed tensor whole)."""
    from layerzoo.loading.model_loading import load_model

    base = tiny_qwen3(tmp_path / "base", 64, tie=False)
    sibling("test_fp8_linear").write_pair(base, tmp_path, "channel", static_input_scale=True)
    monkeypatch.setenv("LAYERZOO_CPU_PACKED_LINEAR", "0")  # keep q_proj unfused to look at it
    whole = []
    get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: whole.append(name) or get(self, name))
    with pretend_rank(1, 2):
        model = load_model(tmp_path / "quant").model
    read_whole = set(whole)
    split = {name for name in parameter_shards(model) if not name.endswith("bias")}
    assert "model.layers.0.self_attn.q_proj.weight_scale" in split and "model.layers.0.mlp.down_proj.weight" in split
    assert not split & read_whole, sorted(split & read_whole)
    assert "model.layers.0.mlp.down_proj.weight_scale" in read_whole  # per-channel scales of a row split: whole
    q = model.layers[0].self_attn.q_proj
    checkpoint = Checkpoint.open(tmp_path / "quant")
    assert isinstance(q, FP8Linear) and q.out_features == 32
    assert torch.equal(q.weight.view(torch.uint8), checkpoint.get("model.layers.0.self_attn.q_proj.weight")[32:].view(torch.uint8))
    assert torch.equal(q.scale, checkpoint.get("model.layers.0.self_attn.q_proj.weight_scale")[32:].float())


# --- one model per family on two ranks ------------------------------------------------------------

PROMPTS = [[3, 17, 42, 8], [5, 9, 60, 1, 2, 33, 12, 40, 7, 7, 21, 50, 3, 3, 11, 19, 23, 2]]  # the long one: chunked prefill
ENGINE = dict(max_model_len=64, max_num_batched_tokens=16)


def assert_two_ranks_decode_like_one(path: Path, method: type, vocab: int):
    """Greedy tokens on two ranks = on one process (up to near ties); rank 0 holds its pieces in
    the method's format (not dequantized)."""
    from layerzoo import LLM
    from layerzoo.testing.parity import assert_same_greedy, greedy_tokens

    single = LLM(str(path), **ENGINE)
    whole = {name: m for name, m in single.engine.model.named_modules() if isinstance(m, method)}
    expected = greedy_tokens(single, PROMPTS, 8)
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as tp:
        got = greedy_tokens(tp, PROMPTS, 8)
        pieces = {name: m for name, m in tp.engine.model.named_modules() if isinstance(m, method)}
    assert whole and sorted(pieces) == sorted(whole)
    assert sum(m.weight_bytes() for m in pieces.values()) < 0.6 * sum(m.weight_bytes() for m in whole.values())
    assert_same_greedy(single.engine.model, PROMPTS, expected, got)


def tiny_qwen3(folder: Path, vocab: int, tie: bool) -> Path:
    """A tiny random Qwen3 whose every projection splits in two on 32-input boundaries."""
    transformers = pytest.importorskip("transformers")
    from layerzoo.testing import write_word_tokenizer

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.25, eos_token_id=None, bos_token_id=None,
        tie_word_embeddings=tie, max_position_embeddings=256, rms_norm_eps=1e-5,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    write_word_tokenizer(folder, vocab)
    return folder


def test_a_gguf_q8_0_file_on_two_ranks_decodes_like_one(tmp_path):
    pytest.importorskip("gguf")
    from layerzoo.kernels.gguf_matmul import cpu as gguf_cpu
    from layerzoo.layers.gguf_linear import GGUFVocabParallelEmbedding
    from layerzoo.testing.gguf_files import byte_level_bpe, write_gguf

    if not gguf_cpu.available():
        pytest.skip("the C++ kernels are not built here: GGUF weights are dequantized at load")
    source = tiny_qwen3(tmp_path / "src", 320, tie=True)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(tmp_path / "gguf" / "model.gguf", source, qtype="Q8_0", tokenizer=byte_level_bpe(320))
    assert_two_ranks_decode_like_one(path, GGUFLinear, 320)
    with pretend_rank(1, 2):  # the tied head shares the rank's vocabulary rows of the embedding's blocks
        from layerzoo.loading.model_loading import load_model

        model = load_model(path).model
    assert isinstance(model.model.embed_tokens, GGUFVocabParallelEmbedding) and model.model.embed_tokens.start == 160
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.weight is model.model.embed_tokens.weight


def test_a_compressed_tensors_int4_checkpoint_on_two_ranks_decodes_like_one(tmp_path):
    base = tiny_qwen3(tmp_path / "base", 64, tie=False)
    sibling("test_int4_linear").write_pair(base, tmp_path, "ct_asym", 32)
    assert_two_ranks_decode_like_one(tmp_path / "quant", Int4Linear, 64)


def test_a_block_fp8_checkpoint_on_two_ranks_decodes_like_one(tmp_path):
    base = tiny_qwen3(tmp_path / "base", 64, tie=False)
    sibling("test_fp8_linear").write_pair(base, tmp_path, "block", (16, 32))
    assert_two_ranks_decode_like_one(tmp_path / "quant", FP8Linear, 64)
