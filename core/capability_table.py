"""A plugin's capability answers written as one table, turned into hookimpls.

The hookspecs stay the plugin contract (a third party may still hand-write a hookimpl, e.g. to
answer for someone else's layer); this helper only spares a plugin one wrapper per query::

    from layerzoo.capability_table import capability_hookimpls

    globals().update(capability_hookimpls({
        "myplugin.decoder": {"decode_graph_unsupported": False, "fp8_calibration_frozen": attention_fp8_state},
        "myplugin.recurrent": {"is_ssm_layer": True, "supports_replay_tail_split": True},
    }))

A value is the answer, or a callable ``(layer) -> answer`` for an answer that depends on the layer
object or changes while the engine runs (FP8 calibration), or a `PerLayer` (such a callable, and
the answer for the kind when no layer is given). Queries a kind does not list, and kinds
the table does not hold, answer ``None``: the next plugin, then the core's defaults, decide.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from layerzoo.errors import PluginError
from layerzoo.hookspecs import hookimpl
from layerzoo.plugins.capabilities import QUERIES


def capability_hookimpls(table: Mapping[str, Mapping[str, Any]]) -> dict[str, Callable]:
    """One hookimpl per query that some kind in ``table`` answers, keyed by the query's name."""
    for kind, answers in table.items():
        unknown = sorted(set(answers) - set(QUERIES))
        if unknown:
            raise PluginError(f"capability table: layer kind {kind!r} answers unknown queries {unknown} (known: {sorted(QUERIES)})")
    queries = [q for q in QUERIES if any(q in answers for answers in table.values())]
    return {query: _hookimpl_for(query, table) for query in queries}


class PerLayer:
    """An answer computed from the layer object, with the answer for the kind alone (asked with no
    layer, e.g. by ``layerzoo plugins``): ``PerLayer(experts_decode_graph_unsupported, without_layer=False)``.
    A bare callable answers ``None`` (no opinion) when there is no layer."""

    def __init__(self, of_layer: Callable[[Any], Any], without_layer: Any):
        self.of_layer, self.without_layer = of_layer, without_layer


def _hookimpl_for(query: str, table: Mapping[str, Mapping[str, Any]]) -> Callable:
    def answer(layer_kind, layer):
        value = table.get(layer_kind, {}).get(query)
        if isinstance(value, PerLayer):
            return value.without_layer if layer is None else value.of_layer(layer)
        if callable(value):
            return None if layer is None else value(layer)
        return value

    answer.__name__ = answer.__qualname__ = query
    answer.__doc__ = f"``{query}`` from the plugin's capability table."
    answer.conditions = {kind: _condition(answers[query]) for kind, answers in table.items()
                         if query in answers and callable(getattr(answers[query], "of_layer", answers[query]))}
    return hookimpl(answer)


def _condition(value: Any) -> str:
    """A per-layer answer's condition: the function's ``condition`` text, else its docstring's first sentence."""
    fn = getattr(value, "of_layer", value)
    doc = getattr(fn, "condition", None) or " ".join((fn.__doc__ or "").split()).split(". ")[0].rstrip(".")
    return f"per layer: {doc or fn.__name__}"


def conditional(conditions: Mapping[str, str]) -> Callable[[Callable], Callable]:
    """Mark a hand-written capability hookimpl whose answer for some layer kinds depends on the
    layer or the engine's settings, with the condition for each (shown by ``layerzoo plugins``)::

        @conditional({"myplugin.mla": "True when the engine runs with mla_prefill='local'"})
        @hookimpl
        def uses_local_mla_prefill(layer_kind, engine_config): ...
    """

    def mark(fn: Callable) -> Callable:
        fn.conditions = dict(conditions)
        return fn

    return mark


def answer_conditions(pm, layer_kind: str) -> dict[str, str]:
    """The queries whose answer for ``layer_kind`` depends on the layer object or the engine's
    settings, each with its condition as the answering plugin states it (``layerzoo plugins``).
    Walks each query's hookimpls in pluggy's order until one answers the kind alone or states a
    condition for it; a hand-written hookimpl that reads the layer or the engine's settings and
    states nothing is reported as depending on them."""
    conditions: dict[str, str] = {}
    args = {"layer_kind": layer_kind, "layer": None, "engine_config": None}
    for query in QUERIES:
        for impl in reversed(getattr(pm.hook, query).get_hookimpls()):
            if impl.hookwrapper or impl.wrapper:
                continue
            stated = getattr(impl.function, "conditions", None)
            if isinstance(stated, str):  # the same condition for every kind (the core's defaults)
                conditions[query] = stated
                break
            if stated is not None and layer_kind in stated:
                conditions[query] = stated[layer_kind]
                break
            if impl.function(**{name: args[name] for name in impl.argnames}) is not None:
                reads = [name for name in ("layer", "engine_config") if name in impl.argnames]
                if stated is None and reads:
                    conditions[query] = f"computed from {' and '.join(reads)} by plugin {impl.plugin_name}"
                break
    return conditions


def attention_fp8_state(layer) -> bool | None:
    """The live ``fp8_calibration_frozen`` answer of a layer whose attention is ``layer.self_attn``
    (or the layer itself): None without online FP8 calibration, else whether its scales froze."""
    return getattr(getattr(layer, "self_attn", layer), "fp8_calibration_frozen", None)


attention_fp8_state.condition = "None without online FP8 calibration, else whether the layer's scales froze"


def experts_decode_graph_unsupported(layer) -> bool:
    """The ``decode_graph_unsupported`` answer of a layer whose MLP may be routed experts
    (`layerzoo.layers.moe.StackedExperts`): True when its experts run the op's torch backend on
    their device, or loop over experts themselves (``counts_on_host``: GGUF block experts), either
    of which reads every expert's row count on the host (no captured
    decode step can hold a host read), False for a dense MLP or experts on the Triton kernel (which
    keeps the counts on the device)."""
    from layerzoo.layers.moe import StackedExperts
    from layerzoo.plugins.ops import kernel

    for module in layer.modules():
        if isinstance(module, StackedExperts):
            if getattr(module, "counts_on_host", False):  # experts looping in Python (GGUF blocks)
                return True
            backend, _ = kernel("moe_grouped_matmul").choose(module.gate_up_proj.device.type)
            if backend == "torch":
                return True
    return False


experts_decode_graph_unsupported.condition = "True when routed experts run the torch grouped matmul (it reads row counts on the host)"
