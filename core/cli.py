"""The ``layerzoo`` command: ``plugins``, ``generate``, ``pull``.

A user mistake (a `UserError`) is one line on stderr and exit code 2; ``--debug`` shows the
traceback. ``layerzoo plugins`` imports no torch, so it stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from layerzoo.errors import UserError

EXIT_USER_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerzoo", description="An LLM inference engine built as a zoo of plugins.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", help="list installed plugins, their architectures and layer capabilities")
    plugins.add_argument("--json", action="store_true", help="print JSON")
    plugins.add_argument("--capabilities", metavar="MODEL", help="build MODEL and show each layer's capability answers")
    plugins.add_argument("--kernels", action="store_true", help="list every kernel op, its backends and the one that runs here")

    gen = sub.add_parser("generate", help="generate text (streamed) from a prompt")
    gen.add_argument("--model", default=None, help="checkpoint directory or hub repo id (default: the embedded demo model)")
    gen.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument(
        "--loop-watchdog", action="store_true",
        help="rewind a generation stuck in a loop to its last line end and continue; the text is then printed when done, not streamed",
    )

    gen.add_argument(
        "--speculative-config", metavar="JSON", default=None,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'',
    )

    gen.add_argument(
        "--quantization", choices=["int8"], default=None,
        help="int8: every linear layer's weights in int8 with per-channel scales (computed with an int8 GEMM)",
    )

    pull = sub.add_parser("pull", help="download a model from the hub into the local HF cache")
    pull.add_argument("repo")
    pull.add_argument("--revision", default=None)
    return parser


# -- plugins -------------------------------------------------------------------------------------


def plugins_report() -> dict:
    """Installed plugins with their architectures and each layer kind's capability answers."""
    from layerzoo.capabilities import LayerCapabilities
    from layerzoo.plugins import get_registry

    registry = get_registry()
    report = {"plugins": [], "failed": dict(registry.failed)}
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
            }
        )
    return report


def _print_plugins(report: dict) -> None:
    for plugin in report["plugins"]:
        version = f" {plugin['version']}" if plugin["version"] else ""
        dist = f" ({plugin['distribution']})" if plugin["distribution"] else " (built-in)"
        print(f"{plugin['name']}{version}{dist}")
        for arch in plugin["architectures"]:
            print(f"  architecture  {arch}")
        for kind, info in plugin["layer_kinds"].items():
            answers = ", ".join(f"{q}={v}" for q, v in info["capabilities"].items())
            print(f"  layer kind    {kind}: {answers}")
        if plugin["kernels"]:
            print(f"  kernels       {', '.join(plugin['kernels'])}")
        if plugin["proposers"]:
            print(f"  proposers     {', '.join(plugin['proposers'])}")
    for name, error in report["failed"].items():
        print(f"{name} FAILED TO LOAD: {error}")


def _capabilities_report(model: str) -> dict:
    from layerzoo.hub import resolve_model
    from layerzoo.model_loading import load_model

    loaded = load_model(resolve_model(model))
    caps = loaded.model.capabilities
    return {
        "architecture": loaded.architecture,
        "plugin": loaded.plugin,
        "layers": [
            {"index": lc.layer_index, "class": lc.layer_class, "kind": lc.layer_kind, "answers": dict(lc.answers), "answered_by": dict(lc.answered_by)}
            for lc in caps.layers
        ],
        "model": caps.summary(),
    }


def _kernels_report() -> dict:
    import torch

    from layerzoo.kernel_registry import kernels_report
    from layerzoo.plugins import get_registry

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"device": device, "ops": kernels_report(get_registry(), device)}


def _print_kernels(report: dict) -> None:
    print(f"device here: {report['device']}")
    for row in report["ops"]:
        backends = ", ".join(f"{b} ({plugin})" for b, plugin in row["backends"].items())
        print(f"  {row['op']:26s} runs {row['runs_here']:7s} [{row['why']}]  backends: {backends}")


def cmd_plugins(args) -> int:
    if args.kernels:
        report = _kernels_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            _print_kernels(report)
        return 0
    report = _capabilities_report(args.capabilities) if args.capabilities else plugins_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif args.capabilities:
        print(f"{report['architecture']} (plugin {report['plugin']})")
        for layer in report["layers"]:
            flagged = [q for q, v in layer["answers"].items() if v not in (False, None) and q != "uses_ssm_pool"]
            print(f"  layer {layer['index']:3d} {layer['kind']}: {', '.join(flagged) or 'no vetoes or opt-ins'}")
        for cause in report["model"]["disabled"]:
            print(f"  {cause['feature']} off: layer {cause['layer_index']} ({cause['layer_class']}) via {cause['query']}")
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
    extra = {"speculative_config": args.speculative_config} if args.speculative_config else {}
    if args.quantization:
        extra["quantization"] = args.quantization
    llm = LLM(args.model, dtype=args.dtype, revision=args.revision, **extra)
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


def cmd_pull(args) -> int:
    from layerzoo.hub import pull

    path = pull(args.repo, revision=args.revision)
    print(path)
    return 0


COMMANDS = {"plugins": cmd_plugins, "generate": cmd_generate, "pull": cmd_pull}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"layerzoo: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `layerzoo plugins --json | head`
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
