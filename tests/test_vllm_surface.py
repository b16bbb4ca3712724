"""What vLLM users expect of `LLM`: ``tokenizer=``, ``skip_tokenizer_init``, dict prompts,
``use_tqdm``, and a weight-loading bar once loading takes a moment."""

import shutil

import pytest

torch = pytest.importorskip("torch")

from layerzoo.entrypoints import progress  # noqa: E402
from layerzoo.errors import UserError  # noqa: E402
from layerzoo.llm import LLM  # noqa: E402
from layerzoo.sampling import SamplingParams  # noqa: E402

SMALL = dict(dtype="float32", max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    torch.set_num_threads(1)
    return LLM(tiny_qwen3_dir, **SMALL)


@pytest.fixture(scope="module")
def weights_only(tiny_qwen3_dir, tmp_path_factory):
    """The tiny checkpoint without its tokenizer files."""
    path = tmp_path_factory.mktemp("weights-only")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (tiny_qwen3_dir / name).exists():
            shutil.copy(tiny_qwen3_dir / name, path / name)
    return path


def test_skip_tokenizer_init_runs_on_token_ids(llm, weights_only):
    ids_only = LLM(weights_only, skip_tokenizer_init=True, **SMALL)
    (out,) = ids_only.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY)
    (ref,) = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].text == ""
    with pytest.raises(UserError, match="token ids only"):
        ids_only.generate("t1 t2", GREEDY)
    with pytest.raises(UserError, match="SamplingParams.stop: stop strings need a tokenizer"):
        ids_only.generate({"prompt_token_ids": [1]}, SamplingParams(stop=["x"]))


def test_without_tokenizer_files_the_error_names_the_way_out(weights_only):
    with pytest.raises(UserError, match="tokenizer"):
        LLM(weights_only, **SMALL)


def test_tokenizer_from_another_folder(llm, weights_only, tiny_qwen3_dir):
    other = LLM(weights_only, tokenizer=str(tiny_qwen3_dir), **SMALL)
    assert other.generate("t1 t2", GREEDY)[0].outputs[0].text == llm.generate("t1 t2", GREEDY)[0].outputs[0].text


def test_dict_prompt_with_text_equals_the_string(llm):
    (a,) = llm.generate({"prompt": "t4 t5"}, GREEDY)
    (b,) = llm.generate("t4 t5", GREEDY)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt == "t4 t5"


def test_use_tqdm_shows_prompts_and_token_speeds(llm, capsys):
    llm.generate(["t1", "t2 t3", "t4"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err
    assert "est. speed input:" in err and "output:" in err and "toks/s" in err
    llm.generate(["t1"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    with pytest.raises(UserError, match="use_tqdm"):
        llm.generate(["t1"], GREEDY, use_tqdm="yes")


def test_weight_loading_bar_once_loading_takes_a_moment(tiny_qwen3_dir, capsys, monkeypatch):
    monkeypatch.setenv(progress.ENV, "1")
    monkeypatch.setattr(progress, "LOAD_BAR_DELAY_S", 0.0)  # every load "takes a moment"
    LLM(tiny_qwen3_dir, **SMALL)
    assert "Loading weights" in capsys.readouterr().err
    monkeypatch.setattr(progress, "LOAD_BAR_DELAY_S", 60.0)  # a fast load shows nothing
    LLM(tiny_qwen3_dir, **SMALL)
    assert "Loading weights" not in capsys.readouterr().err
