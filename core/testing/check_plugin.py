"""``layerzoo check-plugin [NAME ...]``: the conformance kit over installed plugins, as a table.

Exit status 0 when every claim holds, 1 when a layer's "supported" answer is false; an unknown
plugin name is a user error (2).
"""

from __future__ import annotations

import argparse

from layerzoo.errors import UserError

EXIT_FALSE_CLAIM = 1


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "check-plugin",
        help="check every capability answer of the plugins' layers on tiny random checkpoints (conformance kit)",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="plugin entry-point names (default: every installed plugin)")
    parser.add_argument("--workdir", default=None, help="where to write the tiny checkpoints (default: a temporary folder)")
    parser.add_argument("--no-graphs", action="store_true",
                        help="skip the captured-decode checks (on CPU they compile decode steps: minutes per architecture)")
    return parser


def cmd_check_plugin(args) -> int:
    from pathlib import Path

    from layerzoo.plugins.manager import get_registry
    from layerzoo.testing.conformance import check_plugins, collect_test_configs, failures, format_table, untested_architectures

    registry = get_registry()
    names = list(args.names) or None
    if names is not None:
        loaded = {info.name for info in registry.plugins}
        unknown = [n for n in names if n not in loaded]
        if unknown:
            raise UserError(f"check-plugin: no loaded plugin named {', '.join(map(repr, unknown))} (loaded: {', '.join(sorted(loaded))})")
    if not collect_test_configs(registry, names):
        raise UserError("check-plugin: the plugins register no test configs (hook register_test_configs)")
    verdicts = check_plugins(names, Path(args.workdir) if args.workdir else None, graphs=not args.no_graphs)
    print(format_table(verdicts))
    for plugin, architecture in untested_architectures(registry, names):
        print(f"note: {plugin} registers {architecture} without a test config: not checked")
    false_claims = failures(verdicts)
    for v in false_claims:
        print(f"FALSE CLAIM: {v.describe()}")
    print(f"{len(verdicts)} claims, {len(false_claims)} false")
    return EXIT_FALSE_CLAIM if false_claims else 0
