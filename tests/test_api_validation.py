"""Every bad setting or input gets one UserError naming the field (exit 2 and one line on the CLI)."""

import asyncio
import json
import math

import pytest

torch = pytest.importorskip("torch")

from layerzoo.engine_args import EngineArgs  # noqa: E402
from layerzoo.entrypoints import cli  # noqa: E402
from layerzoo.entrypoints.async_llm import AsyncLLM  # noqa: E402
from layerzoo.errors import UserError  # noqa: E402
from layerzoo.llm import LLM  # noqa: E402
from layerzoo.runtime.sampler import NonFiniteLogitsError  # noqa: E402
from layerzoo.sampling import SamplingParams  # noqa: E402

SMALL = dict(dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    torch.set_num_threads(1)
    return LLM(tiny_qwen3_dir, **SMALL)


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_num_batched_tokens", 0), ("max_num_batched_tokens", -3),
        ("block_size", 0), ("block_size", -16), ("block_size", 16.0),
        ("max_num_seqs", 0), ("max_num_seqs", 2.0),
        ("max_model_len", 0), ("max_model_len", -1),
        ("enable_prefix_caching", "no"), ("enable_chunked_prefill", 1), ("enforce_eager", "yes"),
        ("kv_cache_memory", True), ("kv_cache_memory", 1.5), ("kv_cache_memory", 0),
        ("dtype", "float7"), ("device", "tpu"), ("device", "not a device"),
    ],
)
def test_engine_args_name_the_bad_field(field, value):
    with pytest.raises(UserError) as exc:
        EngineArgs(**{field: value})
    assert one_line(exc).startswith(f"{field}:")


def test_a_torch_dtype_object_is_accepted_as_its_name():
    assert EngineArgs(dtype=torch.bfloat16).dtype == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(UserError, match="device: 'cuda' asked for, but CUDA is not available"):
        EngineArgs(device="cuda")


def test_max_model_len_beyond_the_model_is_refused_not_clamped(tiny_qwen3_dir):
    with pytest.raises(UserError, match=r"max_model_len: 100000 is beyond the model's limit"):
        LLM(tiny_qwen3_dir, dtype="float32", max_model_len=100000)


def test_a_kv_cache_too_small_for_one_sequence_is_refused_at_start(tiny_qwen3_dir):
    # 256 bytes per token in the tiny model: 64 KiB hold 256 tokens, not 1024.
    with pytest.raises(UserError) as exc:
        LLM(tiny_qwen3_dir, dtype="float32", max_model_len=1024, kv_cache_memory=64 << 10)
    message = one_line(exc)
    assert "needs 64 blocks" in message and "holds 16 blocks" in message
    assert "raise kv_cache_memory" in message and "lower max_model_len" in message


def test_empty_model_name_is_refused():
    with pytest.raises(UserError, match="^model:"):
        LLM("")


@pytest.mark.parametrize(
    "prompts, match",
    [
        (None, "^prompts:"),
        ((p for p in ["t1"]), "^prompts:"),
        ({"prompt_token_ids": None}, "prompt_token_ids"),
        ({"prompt_token_ids": [True, 1]}, "prompt_token_ids"),
        ("t1 \ud800 t2", "lone surrogate '\\\\ud800' at character 3"),
        (5, "^prompts: expected a string"),
        ([5], "^prompt 0: expected a string"),
    ],
)
def test_bad_prompts_are_named(llm, prompts, match):
    with pytest.raises(UserError, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert not llm.engine.requests and not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "third, match",
    [("", r"^prompt 2: the prompt has no tokens$"), ({"prompt_token_ids": [10**6]}, r"^prompt 2: token ids must be ints in \[0, ")],
)
def test_an_engine_refusal_names_the_prompt_by_its_place_in_the_call(llm, third, match):
    llm.generate("t1", SamplingParams(max_tokens=1))  # the engine's request ids no longer start at 0
    with pytest.raises(UserError, match=match):
        llm.generate(["t1", "t2", third], SamplingParams(max_tokens=2))
    assert not llm.engine.requests and not llm.engine.has_unfinished()


def test_sampling_params_as_a_dict_is_refused(llm):
    with pytest.raises(UserError, match=r"^sampling_params: expected a SamplingParams, got dict.*SamplingParams\(\*\*"):
        llm.generate("t1", {"max_tokens": 2})


def test_a_stop_list_emptied_after_construction_is_caught(llm):
    params = SamplingParams(max_tokens=4, stop=["t9"])
    params.stop.append("")
    with pytest.raises(UserError, match="SamplingParams.stop"):
        llm.generate("t1", params)


def test_dict_prompt_with_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate({"prompt": "t1 t2"}, greedy)[0].outputs[0].token_ids == llm.generate("t1 t2", greedy)[0].outputs[0].token_ids


def test_async_add_request_without_params(llm):
    async def main():
        engine = AsyncLLM.from_engine(llm.engine, llm.tokenizer)
        try:
            with pytest.raises(UserError, match="^params: expected a SamplingParams, got NoneType"):
                await engine.add_request("x", "t1", None)
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_head_dim_zero_in_config_names_the_key(tiny_qwen3_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen3_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["head_dim"] = 0
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"config.json: key 'head_dim': expected an int > 0, got 0"):
        LLM(bad, **SMALL)


@pytest.mark.parametrize(
    "value, match",
    [("tritonn", "unknown kernel backend 'tritonn'"), ("triton", "Triton kernels need a CUDA device")],
)
def test_kernel_backend_env_is_checked(tiny_qwen3_dir, monkeypatch, value, match):
    monkeypatch.setenv("LAYERZOO_KERNEL_BACKEND", value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match=f"^LAYERZOO_KERNEL_BACKEND.*{match}"):
        LLM(tiny_qwen3_dir, **SMALL)


def test_nan_weights_fail_the_request_naming_non_finite_logits(tiny_qwen3_dir):
    # A checkpoint holding NaN is refused at load (tests/test_checkpoint_errors.py), so the NaN is
    # planted in the loaded model: an overflow at run time reaches the logits the same way.
    broken = LLM(tiny_qwen3_dir, **SMALL)
    with torch.no_grad():
        broken.loaded.model.get_parameter("model.norm.weight").fill_(math.nan)
    with pytest.raises(NonFiniteLogitsError, match=r"non-finite logits \(NaN or inf\).*request\(s\) 0"):
        broken.generate("t1 t2", SamplingParams(temperature=0, max_tokens=4))
    e = broken.engine
    assert not e.requests and not e.has_unfinished() and e.blocks.num_free_blocks() == e.blocks.num_blocks


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
        (["--block-size", "0"], "block_size"),
        (["--max-model-len", "0"], "max_model_len"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--dtype", "float7"], "dtype"),
    ],
)
def test_cli_bad_engine_flag_is_one_line_exit_2(capsys, flags, field):
    try:
        code = cli.main(["generate", "--prompt", "hi", "--max-tokens", "1", *flags])
    except SystemExit as exc:  # argparse's own checks (a flag's type) exit directly
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], err


def test_cli_serve_bad_port_is_one_line_exit_2(capsys):
    assert cli.main(["serve", "--port", "70000"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["layerzoo: error: --port: expected 0..65535, got 70000"]
