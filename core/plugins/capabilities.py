"""Capability records: each layer's answers to the capability queries, and the model's aggregate.

The answers are gathered once per decoder layer when a model is built, frozen into a
`LayerCapabilities` record (with the plugin that gave each answer), and reduced by
`ModelCapabilities` with the rule each query calls for:

* vetoes OR over layers (one layer that cannot is enough to turn a feature off);
* opt-ins need every layer to agree (replay-tail capture);
* FP8 calibration is a tri-state gate (``None`` ignores the layer, ``False`` holds graphs back);
* local-MLA prefill turns prefix matching off unless ``LAYERZOO_MLA_PREFIX_SKIP=1``.

For each feature it turns off the aggregate keeps the layer index, layer class and plugin that
caused it; the runtime logs each once and shows them in its stats.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from layerzoo import settings
from layerzoo.errors import LayerStateNotRewindable

log = logging.getLogger(__name__)

# Every query, its default, and the model-level feature a "turn-off" answer affects.
# A new query is one more row here, one more hookspec and one more default in layerzoo.plugins.defaults.
QUERIES: Mapping[str, Any] = {
    "uses_local_mla_prefill": False,
    "fp8_calibration_frozen": None,
    "decode_graph_unsupported": False,
    "decode_multi_seq_unsupported": False,
    "decode_rollback_unsupported": False,
    "decode_verify_multi_unsupported": False,
    "graph_stale_on_new_sequence": False,
    "is_ssm_layer": False,
    "uses_ssm_pool": True,
    "supports_replay_tail_split": False,
    # Added with speculative decoding (the way the seed engine grew its trait): the eleventh.
    "keeps_per_draft_states": False,
}


def first_answer(hook, **kwargs) -> tuple[Any, str | None]:
    """Call a firstresult hook and say which plugin answered: ``(value, plugin_name)``.

    Same order as pluggy's own call loop (last registered first, tryfirst/trylast honoured);
    ``(None, None)`` when every implementation returned ``None``. Hook wrappers are skipped:
    they observe calls, they do not answer (called here, one would return its generator).
    """
    for impl in reversed(hook.get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            continue
        value = impl.function(**{name: kwargs[name] for name in impl.argnames})
        if value is not None:
            return value, impl.plugin_name
    return None, None


@attrs.frozen
class LayerCapabilities:
    """One decoder layer's answers, with the plugin behind each."""

    layer_index: int
    layer_class: str
    layer_kind: str
    answers: Mapping[str, Any]
    answered_by: Mapping[str, str | None]

    def __getattr__(self, name: str) -> Any:
        # Lets callers write `caps.decode_graph_unsupported`; unknown names still fail.
        answers = object.__getattribute__(self, "answers")
        if name in answers:
            return answers[name]
        raise AttributeError(name)

    @classmethod
    def of(cls, layer_index: int, layer_class: str, layer_kind: str, plugin: str, **answers: Any) -> LayerCapabilities:
        """A record with the given answers (attributed to ``plugin``) and defaults for the rest."""
        unknown = set(answers) - set(QUERIES)
        assert not unknown, f"unknown capability queries: {sorted(unknown)}"
        full = {**QUERIES, **answers}
        by = {q: (plugin if q in answers else None) for q in QUERIES}
        return cls(layer_index, layer_class, layer_kind, full, by)

    @classmethod
    def gather(
        cls,
        pm,
        *,
        layer_index: int,
        layer_kind: str,
        layer: Any = None,
        engine_config: Any = None,
    ) -> LayerCapabilities:
        """Ask every capability query about one layer (or one layer kind when ``layer`` is None)."""
        answers: dict[str, Any] = {}
        answered_by: dict[str, str | None] = {}
        for query, default in QUERIES.items():
            value, plugin = first_answer(
                getattr(pm.hook, query), layer_kind=layer_kind, layer=layer, engine_config=engine_config
            )
            answers[query] = default if value is None else value
            answered_by[query] = plugin
        layer_class = type(layer).__name__ if layer is not None else layer_kind
        return cls(layer_index, layer_class, layer_kind, answers, answered_by)


class Feature(enum.StrEnum):
    """An engine feature a capability answer can turn off; the value is how messages name it."""

    DECODE_GRAPHS = "decode graphs"
    BATCHED_DECODE = "batched multi-sequence decode"
    ROLLBACK = "rollback_to_boundary"
    BATCHED_VERIFY = "batched speculative verify"
    GRAPH_REUSE = "decode graph reuse across sequences"
    CHUNKED_PREFILL = "chunked prefill"
    PREFIX_MATCHING = "prefix-cache matching"
    IN_PASS_CAPTURE = "in-pass replay-tail capture"
    GRAPHS_UNTIL_FP8_FROZEN = "decode graphs (until FP8 calibration freezes)"


@attrs.frozen
class Cause:
    """A feature some layer turned off, and the layer that did it."""

    feature: Feature
    query: str
    layer_index: int
    layer_class: str
    plugin: str | None

    def describe(self) -> str:
        return (
            f"{self.feature} is off: layer {self.layer_index} ({self.layer_class}) answers "
            f"{self.query} (plugin {self.plugin or 'default'})"
        )


# Vetoes: query -> the feature it turns off when any layer answers True.
VETOES: Mapping[str, Feature] = {
    "decode_graph_unsupported": Feature.DECODE_GRAPHS,
    "decode_multi_seq_unsupported": Feature.BATCHED_DECODE,
    "decode_rollback_unsupported": Feature.ROLLBACK,
    "decode_verify_multi_unsupported": Feature.BATCHED_VERIFY,
}


@attrs.frozen
class ModelCapabilities:
    """The whole model's capabilities, reduced from its layers' records by the rules above."""

    layers: tuple[LayerCapabilities, ...]
    mla_prefix_skip: bool = False
    stateful_layers: tuple[int, ...] = ()  # layers that keep recurrent state (a `StateSpec`)

    @classmethod
    def from_layers(
        cls, layers: Iterable[LayerCapabilities], env: Mapping[str, str] | None = None, stateful_layers: Iterable[int] = ()
    ) -> ModelCapabilities:
        return cls(tuple(layers), settings.flag("LAYERZOO_MLA_PREFIX_SKIP", env), tuple(stateful_layers))

    def _first(self, query: str, value: Any = True) -> LayerCapabilities | None:
        return next((lc for lc in self.layers if lc.answers[query] == value), None)

    def _cause(self, feature: Feature, query: str, value: Any = True) -> Cause | None:
        lc = self._first(query, value)
        if lc is None:
            return None
        return Cause(feature, query, lc.layer_index, lc.layer_class, lc.answered_by[query])

    # -- vetoes (OR over layers) -------------------------------------------------------------

    @property
    def decode_graph_veto(self) -> bool:
        return self._first("decode_graph_unsupported") is not None

    @property
    def decode_multi_seq_veto(self) -> bool:
        return self._first("decode_multi_seq_unsupported") is not None

    @property
    def rollback_veto(self) -> bool:
        return self._first("decode_rollback_unsupported") is not None

    @property
    def verify_multi_veto(self) -> bool:
        return self._first("decode_verify_multi_unsupported") is not None

    @property
    def graph_stale_on_new_sequence(self) -> bool:
        return self._first("graph_stale_on_new_sequence") is not None

    def speculation_blocker(self) -> Cause | None:
        """The first layer that cannot drop rejected drafts, or None.

        Attention drops them by lowering the KV cursor. A layer with recurrent state in the pool
        (``stateful_layers``, ``uses_ssm_pool`` True) keeps one state per draft position, captured
        inside the verify's pass, so it must answer ``supports_replay_tail_split``; an own-state
        layer (``uses_ssm_pool`` False) must say it keeps per-draft states.
        """
        pool = set(self.stateful_layers)
        for lc in self.layers:
            if not lc.uses_ssm_pool and not lc.keeps_per_draft_states:
                query = "keeps_per_draft_states"
            elif lc.uses_ssm_pool and lc.layer_index in pool and not lc.supports_replay_tail_split:
                query = "supports_replay_tail_split"
            else:
                continue
            return Cause("speculative decoding", query, lc.layer_index, lc.layer_class, lc.answered_by[query])
        return None

    def check_rollback(self) -> None:
        """Raise `LayerStateNotRewindable` naming the first layer that cannot rewind."""
        lc = self._first("decode_rollback_unsupported")
        if lc is not None:
            raise LayerStateNotRewindable(
                lc.layer_index, lc.layer_class, lc.answered_by["decode_rollback_unsupported"]
            )

    # -- opt-ins (every layer must agree) ----------------------------------------------------

    @property
    def replay_tail_split_supported(self) -> bool:
        return bool(self.layers) and all(lc.supports_replay_tail_split for lc in self.layers)

    # -- routing facts -----------------------------------------------------------------------

    @property
    def ssm_split_prefill_layers(self) -> tuple[int, ...]:
        return tuple(lc.layer_index for lc in self.layers if lc.is_ssm_layer)

    @property
    def own_state_layers(self) -> tuple[int, ...]:
        """Layers whose recurrent state is not in the pool: sequence setup calls their alloc_state."""
        return tuple(lc.layer_index for lc in self.layers if not lc.uses_ssm_pool)

    @property
    def local_mla_prefill(self) -> bool:
        return self._first("uses_local_mla_prefill") is not None

    @property
    def prefix_matching_allowed(self) -> bool:
        """Prefix-cache lookups may match; off with local-MLA prefill unless the env accepts it."""
        return not self.local_mla_prefill or self.mla_prefix_skip

    @property
    def chunked_prefill_allowed(self) -> bool:
        """A chunk of a local-MLA prefill would not see the earlier chunks, so prompts stay whole."""
        return not self.local_mla_prefill

    # -- FP8 calibration gate (tri-state, polled at run time) --------------------------------

    @staticmethod
    def graphs_ready_after_fp8_calibration(states: Sequence[bool | None]) -> bool:
        """Graphs may be captured once no layer is still calibrating (``None`` = not calibrating).

        ``all`` rather than "first answer": a layer that never calibrates must not pin the model
        to eager decoding for the life of the process.
        """
        return all(state is None or state for state in states)

    def with_fp8_states(self, states: Sequence[bool | None]) -> ModelCapabilities:
        """This record with each layer's ``fp8_calibration_frozen`` answer replaced by ``states``
        (asked again now: the answer moves as online calibration runs and freezes)."""
        assert len(states) == len(self.layers), (len(states), len(self.layers))
        layers = tuple(
            attrs.evolve(lc, answers={**lc.answers, "fp8_calibration_frozen": state})
            for lc, state in zip(self.layers, states)
        )
        return attrs.evolve(self, layers=layers)

    @property
    def fp8_graphs_ready(self) -> bool:
        """The gate as answered when this record was made (`with_fp8_states` for a live one)."""
        return self.graphs_ready_after_fp8_calibration(
            [lc.fp8_calibration_frozen for lc in self.layers]
        )

    # -- reporting ---------------------------------------------------------------------------

    def disabled(self) -> tuple[Cause, ...]:
        """Every feature this model turns off, each with the first layer that caused it."""
        causes = [self._cause(feature, query) for query, feature in VETOES.items()]
        causes.append(self._cause(Feature.GRAPH_REUSE, "graph_stale_on_new_sequence"))
        if self.local_mla_prefill:
            causes.append(self._cause(Feature.CHUNKED_PREFILL, "uses_local_mla_prefill"))
            if not self.mla_prefix_skip:
                causes.append(self._cause(Feature.PREFIX_MATCHING, "uses_local_mla_prefill"))
        # Only hybrids snapshot recurrent state at a cut; for pure attention models this is moot.
        if self.ssm_split_prefill_layers and not self.replay_tail_split_supported:
            causes.append(self._cause(Feature.IN_PASS_CAPTURE, "supports_replay_tail_split", False))
        if not self.fp8_graphs_ready:
            causes.append(self._cause(Feature.GRAPHS_UNTIL_FP8_FROZEN, "fp8_calibration_frozen", False))
        return tuple(c for c in causes if c is not None)

    def log_disabled(self, logger: logging.Logger = log) -> None:
        for cause in self.disabled():
            logger.info("%s", cause.describe())

    def summary(self) -> dict[str, Any]:
        """A JSON-ready view for `layerzoo plugins --capabilities` and the engine's stats."""
        return {
            "decode_graph_veto": self.decode_graph_veto,
            "decode_multi_seq_veto": self.decode_multi_seq_veto,
            "rollback_veto": self.rollback_veto,
            "verify_multi_veto": self.verify_multi_veto,
            "graph_stale_on_new_sequence": self.graph_stale_on_new_sequence,
            "replay_tail_split_supported": self.replay_tail_split_supported,
            "prefix_matching_allowed": self.prefix_matching_allowed,
            "chunked_prefill_allowed": self.chunked_prefill_allowed,
            "fp8_graphs_ready": self.fp8_graphs_ready,
            "ssm_split_prefill_layers": list(self.ssm_split_prefill_layers),
            "own_state_layers": list(self.own_state_layers),
            "speculation_blocked_by": attrs.asdict(b) if (b := self.speculation_blocker()) else None,
            "disabled": [attrs.asdict(c) for c in self.disabled()],
        }
