"""The core's default answers to the capability queries, registered as a built-in plugin.

Registered ``trylast`` so that any plugin with an opinion answers first. The constant defaults
come from the one table of them, `layerzoo.plugins.capabilities.QUERIES` (no veto, no opt-in, state in
the shared pool, no FP8 calibration), so a new query's default is one row there. Two defaults
look into the layer, because they are about the core's own modules, whatever plugin built the
layer around them, so that no plugin has to restate them:

* ``fp8_calibration_frozen``: the live FP8 KV-scale state of the core attention (GQA or MLA)
  inside the layer (None when it has none or runs no online calibration);
* ``decode_graph_unsupported``: True when the layer's routed experts (the core's
  `StackedExperts`) run the grouped matmul's torch backend, which reads row counts on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layerzoo.capability_table import experts_decode_graph_unsupported
from layerzoo.hookspecs import hookimpl
from layerzoo.plugins.capabilities import QUERIES

# Answered below from the layer; every other query answers its constant.
_FROM_THE_LAYER = ("fp8_calibration_frozen", "decode_graph_unsupported")


def _constant(query: str, value: Any) -> Callable:
    def answer():
        return value

    answer.__name__ = answer.__qualname__ = query
    answer.__doc__ = f"``{query}``: {value!r} unless a plugin answers."
    return hookimpl(trylast=True)(answer)


globals().update({query: _constant(query, value) for query, value in QUERIES.items() if query not in _FROM_THE_LAYER})


def _is_module(layer) -> bool:
    """Whether there is a layer to look into (the kind alone is asked without one)."""
    return callable(getattr(layer, "modules", None))


def core_attention_fp8_state(layer) -> bool | None:
    """The FP8 calibration state of the first core attention module inside ``layer`` (its class
    has the ``fp8_calibration_frozen`` property): None without online FP8 calibration, else
    whether its scales froze."""
    for module in layer.modules():
        if isinstance(getattr(type(module), "fp8_calibration_frozen", None), property):
            return module.fp8_calibration_frozen
    return None


@hookimpl(trylast=True)
def fp8_calibration_frozen(layer):
    # None is the answer itself ("runs no online calibration"), so firstresult cannot stop on
    # it; the capability gatherer treats "no non-None answer" as this default.
    return core_attention_fp8_state(layer) if _is_module(layer) else None


fp8_calibration_frozen.conditions = "per layer: its core attention's FP8 KV scales (None without online calibration, else frozen or not)"


@hookimpl(trylast=True)
def decode_graph_unsupported(layer):
    return experts_decode_graph_unsupported(layer) if _is_module(layer) else False


decode_graph_unsupported.conditions = f"per layer: {experts_decode_graph_unsupported.condition}"
