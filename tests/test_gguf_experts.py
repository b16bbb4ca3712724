"""Routed experts of a GGUF Qwen3-MoE kept in their block formats (`layerzoo.layers.gguf_experts`):
on tiny files written here (experts in Q8_0 by the ``gguf`` package; in Q4_K with Q6_K down
projections, as Q4_K_M mixes them, from random blocks with sane scales) the block experts generate
the dequantized model's greedy tokens with its logprobs, take the file's bytes, and a forward runs
only the experts that received tokens."""

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from layerzoo import LLM, SamplingParams  # noqa: E402
from layerzoo.capability_table import experts_decode_graph_unsupported  # noqa: E402
from layerzoo.engine_args import EngineArgs  # noqa: E402
from layerzoo.errors import CheckpointError  # noqa: E402
from layerzoo.kernels.gguf_matmul import cpu as gguf_cpu  # noqa: E402
from layerzoo.layers.gguf_experts import GGUFStackedExperts  # noqa: E402
from layerzoo.layers.moe import StackedExperts  # noqa: E402
from layerzoo.loading.model_loading import load_model  # noqa: E402
from layerzoo.testing.gguf_files import byte_level_bpe, random_kquant_blocks, write_gguf  # noqa: E402

if not gguf_cpu.available():
    pytest.skip("the C++ kernels are not built here: GGUF weights are dequantized at load", allow_module_level=True)

VOCAB, HIDDEN, MOE_I, EXPERTS, LAYERS = 320, 256, 256, 8, 2  # K-quant rows: multiples of 256
Q8_0, Q4_K, Q6_K, IQ4_NL = "Q8_0", "Q4_K", "Q6_K", "IQ4_NL"
PROMPTS = [[5, 17, 42, 99, 3, 250], [7, 8, 9, 10], [300, 12, 64, 64, 1]]
EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-moe-src")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, max_position_embeddings=256, rms_norm_eps=1e-5,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, intermediate_size=96,
        moe_intermediate_size=MOE_I, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    )
    transformers.Qwen3MoeForCausalLM(config).eval().save_pretrained(root)
    return root


def write(path, source, experts: str):
    """A Q8_0 file whose experts are in ``experts`` (Q4_K: down projections in Q6_K, as Q4_K_M)."""
    if experts == Q8_0:
        return write_gguf(path, source, qtype=Q8_0, tokenizer=byte_level_bpe(VOCAB))
    rng = np.random.default_rng(1)
    names = [f"blk.{layer}.{kind}.weight" for layer in range(LAYERS) for kind in EXPERT_KINDS]
    extra = {}
    for name in names:
        down = "down" in name
        qtype = Q6_K if down and experts == Q4_K else experts
        rows, k = (HIDDEN, MOE_I) if down else (MOE_I, HIDDEN)
        extra[name] = (random_kquant_blocks(qtype, (EXPERTS, rows), k, rng), qtype)
    return write_gguf(path, source, qtype=Q8_0, tokenizer=byte_level_bpe(VOCAB), skip=tuple(names), extra=extra)


@pytest.fixture(scope="module")
def files(tmp_path_factory, source):
    root = tmp_path_factory.mktemp("gguf-moe")
    return {qtype: write(root / f"moe-{qtype}.gguf", source, qtype) for qtype in (Q8_0, Q4_K)}


def expert_modules(model):
    return [m for m in model.modules() if isinstance(m, StackedExperts)]


def file_expert_bytes(path) -> int:
    reader = gguf.GGUFReader(path)
    return sum(int(t.n_bytes) for t in reader.tensors if t.name.split(".")[-2] in EXPERT_KINDS)


@pytest.mark.parametrize("experts", [Q8_0, Q4_K])
def test_block_experts_generate_the_dequantized_models_tokens_and_logprobs(files, experts):
    path = files[experts]
    blocks = LLM(str(path), max_model_len=64, max_num_seqs=4)
    dense = LLM(str(path), max_model_len=64, max_num_seqs=4, dtype="float32")  # dtype= asks for dequantization
    kept = expert_modules(blocks.engine.runner.model)
    assert len(kept) == LAYERS and all(type(m) is GGUFStackedExperts for m in kept)
    down = Q6_K if experts == Q4_K else experts
    assert {(gguf.GGMLQuantizationType(m.gate_up_qtype).name, gguf.GGMLQuantizationType(m.down_qtype).name)
            for m in kept} == {(experts, down)}
    assert all(type(m) is StackedExperts for m in expert_modules(dense.engine.runner.model))
    # experts in torch keep vetoing captured decode steps, kept in blocks or not
    assert all(experts_decode_graph_unsupported(layer) for layer in blocks.engine.runner.model.layers)

    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    for ours, theirs in zip(blocks.generate(requests, params), dense.generate(requests, params)):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        # these prompts and steps are a few rows: the C++ GEMV, activations rounded to int16 per 32-block
        # (Q8_0, measured: at most 4.5e-4 apart on logprobs of -1 to -7), or to int8 per 256 as
        # llama.cpp does (Q4_K gate/up and Q6_K down experts; measured on this random-weight model:
        # prompts at most 0.061 apart, decode steps 0.51 on one token, the tokens all equal)
        tol = 1e-3 if experts == Q8_0 else 0.6
        got = [next(iter(e.values())) for e in ours.prompt_logprobs[1:]]
        want = [next(iter(e.values())) for e in theirs.prompt_logprobs[1:]]
        assert got == pytest.approx(want, abs=tol)
        got = [e[t] for e, t in zip(ours.outputs[0].logprobs, ours.outputs[0].token_ids)]
        want = [e[t] for e, t in zip(theirs.outputs[0].logprobs, theirs.outputs[0].token_ids)]
        assert got == pytest.approx(want, abs=tol)


@pytest.mark.parametrize("experts", [Q8_0, Q4_K])
def test_block_experts_compute_the_dequantized_experts(files, experts):
    """Layer by layer on random tokens: many rows (the block GEMM) and few (the GEMV) agree to the
    int16 rounding of the activations; Q4_K / Q6_K experts to their int8 rounding (llama.cpp's;
    measured 1.4% of the largest output)."""
    path = files[experts]
    kept = expert_modules(load_model(path).model)
    dequantized = expert_modules(load_model(path, EngineArgs(dtype="float32")).model)
    torch.manual_seed(0)
    for ours, theirs in zip(kept, dequantized):
        tolerance_of_rounding = 3e-3 if experts == Q8_0 else 3e-2
        for rows in (200, 3):  # 200 rows: every expert gets more than GEMV_ROWS
            x = torch.randn(rows, HIDDEN)
            ids = torch.stack([torch.randperm(EXPERTS)[:2] for _ in range(rows)])
            weights = torch.rand(rows, 2).softmax(-1)
            with torch.no_grad():
                want, got = theirs(x, weights, ids), ours(x, weights, ids)
            torch.testing.assert_close(got, want, rtol=0, atol=tolerance_of_rounding * float(want.abs().max()))


@pytest.mark.parametrize("experts", [Q8_0, Q4_K])
def test_block_experts_take_the_files_bytes(files, experts):
    path = files[experts]
    kept = expert_modules(load_model(path).model)
    dequantized = expert_modules(load_model(path, EngineArgs(dtype="float32")).model)

    def nbytes(modules):
        return sum(p.numel() * p.element_size() for m in modules for p in (m.gate_up_proj, m.down_proj))

    assert nbytes(kept) == file_expert_bytes(path)
    assert nbytes(dequantized) == 4 * EXPERTS * LAYERS * 3 * HIDDEN * MOE_I  # fp32
    assert nbytes(dequantized) > (3.7 if experts == Q8_0 else 6.0) * nbytes(kept)  # 8.5 bits; 4.5 and 6.6
    # quantization= asks for another format: the experts are dequantized, as the dense linears
    assert all(type(m) is StackedExperts for m in expert_modules(load_model(path, EngineArgs(quantization="int8")).model))


def test_a_step_runs_only_the_experts_its_tokens_were_routed_to(files, monkeypatch):
    llm = LLM(str(files[Q4_K]), max_model_len=64)
    steps = []  # per experts call: (rows, experts routed to, experts run)

    for module in expert_modules(llm.engine.runner.model):
        def spy_forward(x, weights, ids, module=module, forward=module.forward):
            ran = []
            monkeypatch.setattr(module, "run_expert", lambda e, rows, run=type(module).run_expert: ran.append(e) or run(module, e, rows))
            out = forward(x, weights, ids)
            steps.append((x.shape[0], sorted(set(ids.reshape(-1).tolist())), ran))
            return out
        monkeypatch.setattr(module, "forward", spy_forward)

    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    decode = [s for s in steps if s[0] == 1]
    assert len(decode) == 3 * LAYERS  # the tokens after the first, one row each, in every layer
    for rows, routed, ran in steps:
        assert ran == routed  # each routed expert once, in order, and no other
    assert all(len(ran) <= 2 < EXPERTS for _, _, ran in decode)


def test_an_expert_type_without_a_kernel_is_refused_by_name(tmp_path, source):
    elements, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    blocks = np.zeros((EXPERTS, MOE_I, HIDDEN // elements * size), dtype=np.uint8)
    path = write_gguf(tmp_path / "iq4.gguf", source, qtype=Q8_0, tokenizer=byte_level_bpe(VOCAB),
                      skip=("blk.0.ffn_gate_exps.weight",), extra={"blk.0.ffn_gate_exps.weight": (blocks, IQ4_NL)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has quantisation type IQ4_NL"):
        load_model(path)


def test_expert_parallel_ranks_hold_their_experts_blocks_and_sum_to_the_whole(files):
    """Under tensor parallelism each rank keeps the blocks of its ``E / 2`` experts and returns their
    share; the ranks' shares add up to the whole layer's output."""
    from layerzoo.testing.distributed import pretend_rank

    path = files[Q4_K]
    whole = expert_modules(load_model(path).model)[0]
    ranks = []
    for rank in range(2):
        with pretend_rank(rank, 2):
            ranks.append(expert_modules(load_model(path).model)[0])
    for rank, module in enumerate(ranks):
        assert type(module) is GGUFStackedExperts and (module.num_local, module.first_expert) == (EXPERTS // 2, rank * EXPERTS // 2)
        held = slice(module.first_expert, module.first_expert + module.num_local)
        assert torch.equal(module.gate_up_proj, whole.gate_up_proj[held]) and torch.equal(module.down_proj, whole.down_proj[held])
    torch.manual_seed(0)
    for rows in (200, 1):
        x = torch.randn(rows, HIDDEN)
        ids = torch.stack([torch.randperm(EXPERTS)[:2] for _ in range(rows)])
        weights = torch.rand(rows, 2).softmax(-1)
        with torch.no_grad():
            torch.testing.assert_close(ranks[0](x, weights, ids) + ranks[1](x, weights, ids), whole(x, weights, ids))


def test_experts_whose_gate_and_up_differ_in_type_are_dequantized_with_a_warning(tmp_path, source, caplog):
    """One stacked parameter holds gate and up rows, so it needs one block type; layer 0's up in Q4_K
    beside its Q8_0 gate leaves that layer's experts dequantized, and layer 1's in blocks."""
    up = random_kquant_blocks(Q4_K, (EXPERTS, MOE_I), HIDDEN, np.random.default_rng(2))
    path = write_gguf(tmp_path / "mixed.gguf", source, qtype=Q8_0, tokenizer=byte_level_bpe(VOCAB),
                      skip=("blk.0.ffn_up_exps.weight",), extra={"blk.0.ffn_up_exps.weight": (up, Q4_K)})
    with caplog.at_level("WARNING", logger="layerzoo.layers.gguf_experts"):
        first, second = expert_modules(load_model(path).model)
    assert type(first) is StackedExperts and type(second) is GGUFStackedExperts
    assert "model.layers.0.mlp.experts: experts in Q4_K, Q8_0 are not kept in blocks" in caplog.text
