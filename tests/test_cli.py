"""The layerzoo command: listing, generating, and one-line errors with exit code 2."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerzoo.entrypoints.cli import main


def run_cli(*args, env=None):
    """Run the CLI in a fresh process (plugins load from the environment given)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "layerzoo.entrypoints.cli", *args], capture_output=True, text=True, env=full_env, timeout=300
    )


def test_plugins_json_lists_qwen3_with_capabilities():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)["plugins"]}
    qwen3 = plugins["qwen3"]
    assert qwen3["distribution"] == "layerzoo-qwen3"
    assert set(qwen3["architectures"]) == {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM", "Qwen3Model"}
    for kind in ("qwen3.decoder", "qwen3_moe.decoder", "qwen2.decoder"):
        caps = qwen3["layer_kinds"][kind]
        assert caps["capabilities"]["decode_multi_seq_unsupported"] is False
        assert caps["answered_by"]["decode_multi_seq_unsupported"] == "layerzoo.plugins.defaults"  # plain attention: the defaults hold
    gdn = plugins["ssm"]["layer_kinds"]["ssm.gated_deltanet"]
    assert (gdn["capabilities"]["is_ssm_layer"], gdn["answered_by"]["is_ssm_layer"]) == (True, "ssm")
    assert gdn["answered_by"]["uses_ssm_pool"] == "layerzoo.plugins.defaults"


def test_plugins_lists_without_importing_torch():
    code = "import sys; from layerzoo.entrypoints.cli import plugins_report; plugins_report(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_capabilities_of_a_model(tiny_qwen3_dir, capsys):
    assert main(["plugins", "--capabilities", str(tiny_qwen3_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "Qwen3ForCausalLM" and report["plugin"] == "qwen3"
    assert [layer["kind"] for layer in report["layers"]] == ["qwen3.decoder", "qwen3.decoder"]
    assert report["model"]["prefix_matching_allowed"] is True


def test_generate_streams_text(tiny_qwen3_dir, capsys):
    assert main(["generate", "--model", str(tiny_qwen3_dir), "--prompt", "t1 t2 t3", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("t1 t2 t3") and len(out.split()) == 3 + 5


def one_line_error(result, *needles):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_disabled_plugin_names_the_package(tiny_qwen3_dir):
    result = run_cli("generate", "--model", str(tiny_qwen3_dir), "--prompt", "t1", env={"LAYERZOO_DISABLE_PLUGINS": "qwen3"})
    one_line_error(result, "layerzoo-qwen3", "Qwen3ForCausalLM")


@pytest.fixture
def broken_copy(tiny_qwen3_dir, tmp_path):
    shutil.copytree(tiny_qwen3_dir, tmp_path / "m")
    return tmp_path / "m"


def test_truncated_safetensors(broken_copy):
    weights = broken_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    one_line_error(run_cli("generate", "--model", str(broken_copy), "--prompt", "t1"), "model.safetensors")


def test_missing_tensor(broken_copy):
    weights = broken_copy / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, weights)
    one_line_error(run_cli("generate", "--model", str(broken_copy), "--prompt", "t1"), "model.layers.1.self_attn.k_norm.weight")


def test_wrong_shape(broken_copy):
    weights = broken_copy / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, weights)
    one_line_error(run_cli("generate", "--model", str(broken_copy), "--prompt", "t1"), "model.norm.weight", "31")


def test_missing_model_dir(tmp_path):
    one_line_error(run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "x"), "nope")


def test_debug_shows_the_traceback(broken_copy):
    (broken_copy / "config.json").write_text("{not json")
    result = run_cli("--debug", "generate", "--model", str(broken_copy), "--prompt", "t1")
    assert result.returncode != 0 and "Traceback" in result.stderr
    one_line_error(run_cli("generate", "--model", str(broken_copy), "--prompt", "t1"), "config.json")


def test_bad_sampling_value_is_a_user_error(tiny_qwen3_dir, capsys):
    assert main(["generate", "--model", str(tiny_qwen3_dir), "--prompt", "t1", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_plugins_kernels_lists_ops_and_the_backend_here(capsys):
    assert main(["plugins", "--kernels", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["op"]: row for row in report["ops"]}
    assert report["device"] in ("cpu", "cuda")
    assert rows["rms_norm"]["backends"]["torch"] == "layerzoo.kernels"
    if report["device"] == "cpu":  # the C++ kernel where an op has one, else torch
        assert all(row["runs_here"] == ("cpp" if "cpp" in row["backends"] else "torch") for row in rows.values())
        assert rows["rms_norm"]["runs_here"] == "cpp" and rows["moe_softmax_topk"]["runs_here"] == "torch"
    assert report["cpp_kernels"]["how"] in ("cached", "built") and report["cpp_kernels"]["library"].endswith(".so")


def test_plugins_kernels_says_the_cpp_library_is_off_and_that_torch_runs(monkeypatch, capsys):
    from layerzoo.kernels import cpp_build

    monkeypatch.setattr(cpp_build, "_state", {"ok": False, "why": "no C++ compiler ('c++' is not on PATH): install g++",
                                              "how": "failed"})
    assert main(["plugins", "--kernels"]) == 0
    out = capsys.readouterr().out
    assert "C++ CPU kernels: failed: no C++ compiler" in out and "install g++" in out
    rms = next(line for line in out.splitlines() if line.split()[:1] == ["rms_norm"])
    assert "runs torch" in rms and "C++ kernels not built" in rms


def test_generate_with_the_loop_watchdog_prints_the_resteered_text(capsys):
    args = ["generate", "--prompt", "import os\n", "--max-tokens", "80", "--dtype", "float32"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--loop-watchdog"]) == 0
    watched = capsys.readouterr().out
    assert plain.startswith("import os\n") and watched.startswith("import os\n")
    assert "self._w, self._w, self._w, self._w" in plain and "self._w, self._w, self._w, self._w" not in watched


def test_generate_with_speculative_decoding_prints_the_same_text(capsys):
    args = ["generate", "--prompt", "import os\nimport sys\nimport os\nimport", "--max-tokens", "24", "--dtype", "float32"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    assert capsys.readouterr().out == plain


def test_generate_with_a_bad_speculative_config_names_the_key(capsys):
    args = ["generate", "--prompt", "x", "--speculative-config", '{"method": "ngram", "k": 3}']
    assert main(args) == 2
    assert "speculative_config: unknown key 'k'" in capsys.readouterr().err


def test_plugins_lists_the_built_in_proposer(capsys):
    assert main(["plugins"]) == 0
    assert "proposers     mtp, ngram" in capsys.readouterr().out  # both built in


def test_plugins_lists_each_plugins_chat_formats(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    qwen3 = out[out.index("\nqwen3 "):]  # the qwen3 plugin's lines, then the next plugins'
    line = next(line for line in qwen3.splitlines() if line.startswith("  chat formats  "))
    assert line == "  chat formats  hermes (Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)"
    assert main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert plugins["qwen3"]["chat_formats"] == {"Qwen2ForCausalLM": "hermes", "Qwen3ForCausalLM": "hermes",
                                                "Qwen3MoeForCausalLM": "hermes"}
    if "ssm" in plugins:
        assert plugins["ssm"]["chat_formats"]["Qwen3NextForCausalLM"] == "hermes"
        assert plugins["ssm"]["chat_formats"]["Qwen3_5MoeForConditionalGeneration"] == "qwen3_coder"


def test_generate_with_int8_quantization_runs_the_int8_linears(capsys, monkeypatch):
    from layerzoo.layers import gguf_linear

    calls = []
    original = gguf_linear.quantize_linears_q8_0
    monkeypatch.setattr(gguf_linear, "quantize_linears_q8_0", lambda model: calls.append(original(model)) or calls[-1])
    args = ["generate", "--prompt", "import os\n", "--max-tokens", "8", "--dtype", "float32", "--quantization", "int8"]
    assert main(args) == 0
    assert capsys.readouterr().out.startswith("import os\n") and calls and calls[0] > 0


def test_generate_refuses_an_unknown_quantization(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


# -- one-line errors for what users and machines get wrong (issue 34) ------------------------------


def only_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_serve_on_a_busy_port_fails_at_once_before_loading_the_model(tmp_path, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model does not exist: had it been loaded first, that would be the error
        code = main(["serve", "--model", str(tmp_path / "no-such-model"), "--port", str(port)])
    line = only_line(capsys.readouterr().err)
    assert code == 2
    assert line == f"layerzoo: error: --port: 127.0.0.1:{port} is already in use (another server?); pick another --port"


def test_new_plugin_below_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    assert main(["new-plugin", "my_model", "--dir", str(tmp_path / "notes.txt" / "sub")]) == 2
    line = only_line(capsys.readouterr().err)
    assert "notes.txt' is a file, not a folder" in line


def test_check_plugin_without_transformers_names_the_package(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails as if not installed
    assert main(["check-plugin", "qwen3"]) == 2
    line = only_line(capsys.readouterr().err)
    assert "needs transformers" in line and "pip install 'transformers>=5.24,<5.25'" in line


def test_pull_of_a_local_directory_says_it_needs_no_pull(tmp_path, capsys):
    assert main(["pull", str(tmp_path)]) == 2
    line = only_line(capsys.readouterr().err)
    assert f"pull: '{tmp_path}' is a local directory" in line and "--model" in line and "neither" not in line


def test_tensor_parallel_beyond_the_cpus_is_refused_before_spawning(tiny_qwen3_dir, capsys):
    import multiprocessing

    from layerzoo.runtime.threads import usable_cpus

    cpus = usable_cpus()
    args = ["generate", "--model", str(tiny_qwen3_dir), "--prompt", "t1", "--tensor-parallel-size", str(cpus + 1)]
    assert main(args) == 2
    line = only_line(capsys.readouterr().err)
    assert line == (f"layerzoo: error: tensor_parallel_size: {cpus + 1} ranks on CPU need a core each, but this "
                    f"process may use {cpus} CPU(s); use tensor_parallel_size <= {cpus}")
    assert multiprocessing.active_children() == []


def test_interrupt_stops_a_run_started_with_sigint_ignored(tiny_qwen3_dir):
    """A shell without job control starts background jobs with SIGINT ignored: ``kill -INT`` (what
    Ctrl-C sends) was lost and the run went on to exit 0. It stops the run: exit 130, no traceback."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "layerzoo.entrypoints.cli", "generate", "--model", str(tiny_qwen3_dir), "--prompt", "t1 t2 t3",
         "--max-tokens", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert proc.stdout.read(len("t1 t2 t3")) == "t1 t2 t3"  # echoed once loaded: generating now
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err


def test_plugins_prints_a_table_marking_non_default_and_conditional_answers(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    ssm = out[out.index("layerzoo-ssm"):]
    row = next(line.split() for line in ssm.splitlines() if line.split()[:1] == ["is_ssm_layer"])
    header = next(line.split() for line in ssm.splitlines() if line.split()[:2] == ["query", "default"])
    assert row[header.index("ssm.gated_deltanet")] == "True*" and row[header.index("ssm.gated_attention")] == "False"
    if "layerzoo-kimi-k3" in out:  # its MLA's answer depends on the engine's mla_prefill
        kimi = out[out.index("layerzoo-kimi-k3"):]
        assert "True when the engine runs with mla_prefill='local'" in kimi.split("\n\n")[0]
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    qwen3 = next(p for p in report["plugins"] if p["name"] == "qwen3")
    assert "decode_graph_unsupported" in qwen3["layer_kinds"]["qwen3_moe.decoder"]["conditions"]
    assert report["defaults"]["uses_ssm_pool"] is True


def test_plugins_capabilities_takes_engine_flags_and_says_what_the_engine_does(tiny_qwen3_dir, capsys):
    assert main(["plugins", "--capabilities", str(tiny_qwen3_dir), "--no-prefix-caching", "--json"]) == 0
    engine = json.loads(capsys.readouterr().out)["engine"]
    assert engine["prefix_caching"] == {"on": False, "why": "enable_prefix_caching=False"}
    assert engine["chunked_prefill"]["on"] and engine["kv_cache"]["blocks"] > 0
    assert main(["plugins", "--capabilities", str(tiny_qwen3_dir), "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 0
    out = capsys.readouterr().out
    assert "what this engine does:" in out
    assert next(line for line in out.splitlines() if "speculative_decoding" in line).split()[1] == "on"
    assert next(line for line in out.splitlines() if "prefix_caching" in line).split()[1] == "on"


def test_plugins_capabilities_answer_follows_the_engine_flag(tmp_path, capsys):
    """Kimi's MLA answers uses_local_mla_prefill from the engine's mla_prefill: the report shows
    the answer the flag gives and the features it turns off."""
    pytest.importorskip("layerzoo_kimi_k3")
    from layerzoo.testing.conformance import collect_test_configs

    (tc,) = [tc for tc in collect_test_configs(plugins=["kimi_k3"]) if tc.architecture == "KimiLinearForCausalLM"]
    path = tc.write(tmp_path / "kimi")
    for mode, local in (("paged", False), ("local", True)):
        assert main(["plugins", "--capabilities", str(path), "--mla-prefill", mode, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        mla = [layer for layer in report["layers"] if layer["kind"] == "kimi_k3.mla"]
        assert mla and all(layer["answers"]["uses_local_mla_prefill"] is local for layer in mla)
        assert report["engine"]["chunked_prefill"]["on"] is not local
        if local:
            assert "uses_local_mla_prefill" in report["engine"]["chunked_prefill"]["why"]
