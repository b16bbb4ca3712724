"""Capability queries: each layer's answers, who gave them, and the model-level rules.

Layers here are plain Python objects (capability code must not need torch); test plugins are
inline classes whose ``@hookimpl`` methods take a subset of ``(layer_kind, layer, engine_config)``.
"""

from __future__ import annotations

import json
import types

import pytest

from layerzoo import hookimpl
from layerzoo.errors import LayerStateNotRewindable
from layerzoo.plugins.capabilities import QUERIES, VETOES, LayerCapabilities, ModelCapabilities, first_answer
from layerzoo.plugins.manager import PluginRegistry

DEFAULTS = "layerzoo.plugins.defaults"
TOY = "toy.decoder"


class ToyPlugin:
    """Owns ``toy.decoder``: answers each query from the layer's ``answers`` dict (None if absent)."""

    def _ask(self, query, layer_kind, layer):
        if layer_kind != TOY or layer is None:
            return None
        return layer.answers.get(query)

    @hookimpl
    def uses_local_mla_prefill(self, layer_kind, layer):
        return self._ask("uses_local_mla_prefill", layer_kind, layer)

    @hookimpl
    def fp8_calibration_frozen(self, layer_kind, layer):
        return self._ask("fp8_calibration_frozen", layer_kind, layer)

    @hookimpl
    def decode_graph_unsupported(self, layer_kind, layer):
        return self._ask("decode_graph_unsupported", layer_kind, layer)

    @hookimpl
    def decode_multi_seq_unsupported(self, layer_kind, layer):
        return self._ask("decode_multi_seq_unsupported", layer_kind, layer)

    @hookimpl
    def decode_rollback_unsupported(self, layer_kind, layer):
        return self._ask("decode_rollback_unsupported", layer_kind, layer)

    @hookimpl
    def decode_verify_multi_unsupported(self, layer_kind, layer):
        return self._ask("decode_verify_multi_unsupported", layer_kind, layer)

    @hookimpl
    def graph_stale_on_new_sequence(self, layer_kind, layer):
        return self._ask("graph_stale_on_new_sequence", layer_kind, layer)

    @hookimpl
    def is_ssm_layer(self, layer_kind, layer):
        return self._ask("is_ssm_layer", layer_kind, layer)

    @hookimpl
    def uses_ssm_pool(self, layer_kind, layer):
        return self._ask("uses_ssm_pool", layer_kind, layer)

    @hookimpl
    def supports_replay_tail_split(self, layer_kind, layer):
        return self._ask("supports_replay_tail_split", layer_kind, layer)


class ToyLayer:
    layer_kind = TOY

    def __init__(self, **answers):
        self.answers = answers


class OddLayer(ToyLayer):
    """The layer that answers differently from its neighbours (its class name shows in causes)."""


@pytest.fixture
def registry():
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    registry.add_plugin(ToyPlugin(), name="toy")
    return registry


@pytest.fixture(scope="module")
def real_registry():
    registry = PluginRegistry(env={})
    registry.load()
    assert registry.pm.has_plugin("qwen3")
    return registry


def gather(registry, index, layer, kind=None, engine_config=None):
    return LayerCapabilities.gather(
        registry.pm,
        layer_index=index,
        layer_kind=kind or layer.layer_kind,
        layer=layer,
        engine_config=engine_config,
    )


def build(registry, layers, env=None):
    return ModelCapabilities.from_layers([gather(registry, i, layer) for i, layer in enumerate(layers)], env=env or {})


def five_with(odd_index=2, **odd_answers):
    """Five toy layers; the one at ``odd_index`` is an OddLayer with ``odd_answers``."""
    return [OddLayer(**odd_answers) if i == odd_index else ToyLayer() for i in range(5)]


def causes(model, feature):
    return [c for c in model.disabled() if c.feature == feature]


# -- the layer record ----------------------------------------------------------------------------


def test_record_holds_every_query_and_who_answered(registry):
    caps = gather(registry, 4, OddLayer(decode_graph_unsupported=True, is_ssm_layer=False))
    assert set(caps.answers) == set(QUERIES) == set(caps.answered_by)
    assert (caps.layer_index, caps.layer_class, caps.layer_kind) == (4, "OddLayer", TOY)
    assert caps.answers["decode_graph_unsupported"] is True
    assert caps.answered_by["decode_graph_unsupported"] == "toy"
    assert caps.answered_by["is_ssm_layer"] == "toy"
    # Attribute access reads the answers; unknown names still fail.
    assert caps.decode_graph_unsupported is True and caps.uses_ssm_pool is True
    with pytest.raises(AttributeError):
        caps.not_a_query  # noqa: B018


def test_plugin_returning_none_falls_through_to_the_default(registry):
    caps = gather(registry, 0, ToyLayer())  # the toy plugin has no opinion on any query
    assert dict(caps.answers) == dict(QUERIES)
    for query in QUERIES:
        # fp8's default *is* None, so no implementation gives a non-None answer.
        expected = None if QUERIES[query] is None else DEFAULTS
        assert caps.answered_by[query] == expected, query


def test_unknown_layer_kind_gets_the_defaults(registry):
    caps = LayerCapabilities.gather(registry.pm, layer_index=0, layer_kind="nobody.decoder", layer=object())
    assert dict(caps.answers) == dict(QUERIES)
    assert caps.layer_class == "object"
    assert caps.answered_by["uses_ssm_pool"] == caps.answered_by["keeps_per_draft_states"] == DEFAULTS


def test_asking_by_kind_with_no_layer(registry, real_registry):
    class KindOnly:
        @hookimpl
        def is_ssm_layer(self, layer_kind, layer):
            assert layer is None
            return layer_kind == "kindonly.decoder"

    registry.add_plugin(KindOnly(), name="kindonly")
    caps = LayerCapabilities.gather(registry.pm, layer_index=0, layer_kind="kindonly.decoder")
    assert caps.layer_class == "kindonly.decoder"
    assert (caps.is_ssm_layer, caps.answered_by["is_ssm_layer"]) == (True, "kindonly")
    caps = LayerCapabilities.gather(real_registry.pm, layer_index=0, layer_kind="ssm.gated_deltanet", layer=None)
    assert (caps.is_ssm_layer, caps.answered_by["is_ssm_layer"]) == (True, "ssm")


def test_engine_config_reaches_the_plugins(registry):
    class ConfigAware:
        @hookimpl
        def uses_local_mla_prefill(self, engine_config):
            return None if engine_config is None else engine_config.mla

    registry.add_plugin(ConfigAware(), name="configaware")
    layer = ToyLayer()
    assert gather(registry, 0, layer).uses_local_mla_prefill is False
    on = gather(registry, 0, layer, engine_config=types.SimpleNamespace(mla=True))
    assert (on.uses_local_mla_prefill, on.answered_by["uses_local_mla_prefill"]) == (True, "configaware")


# -- 1. uses_local_mla_prefill -------------------------------------------------------------------


def test_local_mla_prefill_turns_off_prefix_matching_and_chunking(registry, monkeypatch):
    plain = build(registry, five_with(3))
    assert plain.prefix_matching_allowed and plain.chunked_prefill_allowed
    assert plain.disabled() == ()

    # The env passed in is what counts, not the process environment.
    monkeypatch.setenv("LAYERZOO_MLA_PREFIX_SKIP", "1")
    model = build(registry, five_with(3, uses_local_mla_prefill=True), env={"LAYERZOO_MLA_PREFIX_SKIP": "0"})
    assert model.local_mla_prefill
    assert not model.prefix_matching_allowed
    assert not model.chunked_prefill_allowed
    for feature in ("prefix-cache matching", "chunked prefill"):
        [cause] = causes(model, feature)
        assert (cause.layer_index, cause.layer_class, cause.plugin) == (3, "OddLayer", "toy")
        assert cause.query == "uses_local_mla_prefill"
        assert "layer 3 (OddLayer)" in cause.describe() and "plugin toy" in cause.describe()


def test_mla_prefix_skip_allows_prefix_matching_but_not_chunking(registry, monkeypatch):
    layers = five_with(3, uses_local_mla_prefill=True)
    model = build(registry, layers, env={"LAYERZOO_MLA_PREFIX_SKIP": "1"})
    assert model.prefix_matching_allowed
    assert not model.chunked_prefill_allowed
    assert causes(model, "prefix-cache matching") == []
    assert [c.layer_index for c in causes(model, "chunked prefill")] == [3]

    # env=None reads the process environment.
    caps = [gather(registry, i, layer) for i, layer in enumerate(layers)]
    monkeypatch.setenv("LAYERZOO_MLA_PREFIX_SKIP", "1")
    assert ModelCapabilities.from_layers(caps).prefix_matching_allowed
    monkeypatch.delenv("LAYERZOO_MLA_PREFIX_SKIP")
    assert not ModelCapabilities.from_layers(caps).prefix_matching_allowed


# -- 2. fp8_calibration_frozen (tri-state) -------------------------------------------------------


def fp8_model(registry, states):
    layers = [
        ToyLayer() if state is None else OddLayer(fp8_calibration_frozen=state) for state in states
    ]
    return build(registry, layers)


@pytest.mark.parametrize(
    "states,ready",
    [
        ([None, None, None], True),  # no layer calibrates
        ([True, True], True),
        ([None, True], True),  # a layer that never calibrates must not pin graphs off
        ([True, None], True),
        ([None, True, None], True),
        ([True, False, True], False),  # one still calibrating is enough
        ([None, False], False),
        ([False, None], False),
        ([False, True], False),
    ],
)
def test_fp8_gate_is_tri_state(registry, states, ready):
    model = fp8_model(registry, states)
    assert [lc.fp8_calibration_frozen for lc in model.layers] == states
    assert model.fp8_graphs_ready is ready
    assert ModelCapabilities.graphs_ready_after_fp8_calibration(states) is ready
    fp8_causes = [c for c in model.disabled() if c.query == "fp8_calibration_frozen"]
    if ready:
        assert fp8_causes == []
    else:
        [cause] = fp8_causes
        assert (cause.layer_index, cause.plugin) == (states.index(False), "toy")


def test_fp8_none_layers_answered_by_nobody(registry):
    caps = gather(registry, 0, ToyLayer())
    assert caps.fp8_calibration_frozen is None
    assert caps.answered_by["fp8_calibration_frozen"] is None
    assert ModelCapabilities.graphs_ready_after_fp8_calibration([]) is True


def test_fp8_answer_is_re_polled(registry):
    class CalibratingLayer:
        layer_kind = "fp8attn.decoder"

        def __init__(self):
            self.calibrating = True

    class Fp8Plugin:
        @hookimpl
        def fp8_calibration_frozen(self, layer_kind, layer):
            if layer_kind != "fp8attn.decoder" or layer is None:
                return None
            return not layer.calibrating

    registry.add_plugin(Fp8Plugin(), name="fp8")
    layer = CalibratingLayer()
    plain = ToyLayer()
    built = build(registry, [plain, layer])
    assert built.layers[1].fp8_calibration_frozen is False
    assert not built.fp8_graphs_ready

    layer.calibrating = False
    polled = build(registry, [plain, layer])
    assert polled.layers[1].fp8_calibration_frozen is True
    assert polled.layers[1].answered_by["fp8_calibration_frozen"] == "fp8"
    assert polled.fp8_graphs_ready
    assert first_answer(registry.pm.hook.fp8_calibration_frozen, layer_kind=layer.layer_kind, layer=layer,
                        engine_config=None) == (True, "fp8")
    assert built.layers[1].fp8_calibration_frozen is False  # the build-time record is a snapshot


# -- 3–6. the vetoes -----------------------------------------------------------------------------

VETO_PROPERTIES = {
    "decode_graph_unsupported": "decode_graph_veto",
    "decode_multi_seq_unsupported": "decode_multi_seq_veto",
    "decode_rollback_unsupported": "rollback_veto",
    "decode_verify_multi_unsupported": "verify_multi_veto",
}


def test_veto_table_covers_the_four_vetoes():
    assert set(VETOES) == set(VETO_PROPERTIES)


def test_no_veto_when_no_layer_answers(registry):
    model = build(registry, five_with(2))
    for prop in VETO_PROPERTIES.values():
        assert getattr(model, prop) is False
    assert model.disabled() == ()
    model.check_rollback()  # does not raise


@pytest.mark.parametrize("query", list(VETO_PROPERTIES))
@pytest.mark.parametrize("odd_index", [0, 2, 4])
def test_one_vetoing_layer_of_five_is_enough(registry, query, odd_index):
    # The other layers say False explicitly: the reduction is an OR, not "first answer".
    layers = [ToyLayer(**{query: False}) for _ in range(5)]
    layers[odd_index] = OddLayer(**{query: True})
    model = build(registry, layers)
    assert getattr(model, VETO_PROPERTIES[query]) is True
    for other, prop in VETO_PROPERTIES.items():
        if other != query:
            assert getattr(model, prop) is False, other
    [cause] = model.disabled()
    assert cause.feature == VETOES[query] and cause.query == query
    assert (cause.layer_index, cause.layer_class, cause.plugin) == (odd_index, "OddLayer", "toy")


def test_first_vetoing_layer_is_named(registry):
    layers = [ToyLayer(), OddLayer(decode_graph_unsupported=True), ToyLayer(decode_graph_unsupported=True)]
    [cause] = build(registry, layers).disabled()
    assert (cause.layer_index, cause.layer_class) == (1, "OddLayer")


def test_check_rollback_raises_naming_the_layer(registry):
    model = build(registry, five_with(3, decode_rollback_unsupported=True))
    with pytest.raises(LayerStateNotRewindable) as info:
        model.check_rollback()
    err = info.value
    assert (err.layer_index, err.layer_class, err.plugin) == (3, "OddLayer", "toy")
    assert "layer 3 (OddLayer, answered by toy)" in str(err)
    # Other vetoes do not make rollback refuse.
    build(registry, five_with(3, decode_graph_unsupported=True, decode_multi_seq_unsupported=True)).check_rollback()


def test_multi_seq_and_verify_multi_are_independent(registry):
    decode_only = build(registry, five_with(1, decode_multi_seq_unsupported=True, decode_verify_multi_unsupported=False))
    assert decode_only.decode_multi_seq_veto and not decode_only.verify_multi_veto
    verify_only = build(registry, five_with(1, decode_multi_seq_unsupported=False, decode_verify_multi_unsupported=True))
    assert verify_only.verify_multi_veto and not verify_only.decode_multi_seq_veto


# -- 7. graph_stale_on_new_sequence --------------------------------------------------------------


def test_graph_stale_on_new_sequence_ors(registry):
    assert build(registry, five_with(4)).graph_stale_on_new_sequence is False
    model = build(registry, five_with(4, graph_stale_on_new_sequence=True))
    assert model.graph_stale_on_new_sequence is True
    [cause] = model.disabled()
    assert (cause.feature, cause.layer_index) == ("decode graph reuse across sequences", 4)


# -- 8. is_ssm_layer -----------------------------------------------------------------------------


def test_ssm_split_prefill_lists_exactly_the_ssm_layers(registry):
    layers = [ToyLayer(is_ssm_layer=i in (1, 3)) for i in range(5)]
    assert build(registry, layers).ssm_split_prefill_layers == (1, 3)
    assert build(registry, five_with(2)).ssm_split_prefill_layers == ()


# -- 9. uses_ssm_pool ----------------------------------------------------------------------------


def test_uses_ssm_pool_defaults_true_and_false_means_own_state(registry):
    plain = build(registry, five_with(2))
    assert plain.own_state_layers == ()
    assert all(lc.uses_ssm_pool is True and lc.answered_by["uses_ssm_pool"] == DEFAULTS for lc in plain.layers)
    model = build(registry, five_with(2, uses_ssm_pool=False))
    assert model.own_state_layers == (2,)
    assert model.layers[2].answered_by["uses_ssm_pool"] == "toy"


# -- 10. supports_replay_tail_split --------------------------------------------------------------


def test_replay_tail_split_needs_every_layer(registry):
    hybrid = [ToyLayer(supports_replay_tail_split=True, is_ssm_layer=i % 2 == 1) for i in range(4)]
    model = build(registry, hybrid)
    assert model.replay_tail_split_supported is True
    assert model.disabled() == ()

    hybrid[2] = OddLayer(is_ssm_layer=False)  # no answer: the default False
    model = build(registry, hybrid)
    assert model.layers[2].answered_by["supports_replay_tail_split"] == DEFAULTS
    assert model.replay_tail_split_supported is False
    [cause] = model.disabled()
    assert (cause.feature, cause.layer_index, cause.layer_class) == ("in-pass replay-tail capture", 2, "OddLayer")
    assert cause.plugin == DEFAULTS

    # Pure attention models never snapshot recurrent state: nothing to report.
    assert build(registry, five_with(2)).disabled() == ()
    assert ModelCapabilities.from_layers([], env={}).replay_tail_split_supported is False


# -- plugin ordering -----------------------------------------------------------------------------


class GraphSafe:
    """A third party answering ``decode_graph_unsupported`` for Kimi's MLA layers, which it does not own
    (the kimi_k3 plugin answers that query itself)."""

    def __init__(self, value):
        self.value = value

    @hookimpl
    def decode_graph_unsupported(self, layer_kind):
        return self.value if layer_kind == "kimi_k3.mla" else None


class GraphSafeFirst(GraphSafe):
    @hookimpl(tryfirst=True)
    def decode_graph_unsupported(self, layer_kind):
        return self.value if layer_kind == "kimi_k3.mla" else None


def fresh_kimi_registry(*before):
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": "kimi_k3"})
    for plugin, name in before:
        registry.pm.register(plugin, name=name)
    registry.load()
    return registry


def kind_caps(registry, kind):
    return LayerCapabilities.gather(registry.pm, layer_index=0, layer_kind=kind)


def test_third_party_registered_after_the_owner_overrides(real_registry):
    registry = fresh_kimi_registry()
    assert kind_caps(registry, "kimi_k3.mla").answered_by["decode_graph_unsupported"] == "kimi_k3"
    registry.add_plugin(GraphSafe(True), name="fastkernel")
    caps = kind_caps(registry, "kimi_k3.mla")
    assert caps.decode_graph_unsupported is True
    assert caps.answered_by["decode_graph_unsupported"] == "fastkernel"
    # Only the kind it spoke about, and only the query it answers.
    assert caps.answered_by["supports_replay_tail_split"] == "kimi_k3"
    other = kind_caps(registry, "kimi_k3.kda")
    assert (other.decode_graph_unsupported, other.answered_by["decode_graph_unsupported"]) == (False, "kimi_k3")


def test_registration_order_and_tryfirst_are_honoured():
    # Registered before the owner: the owner, called first, answers.
    registry = fresh_kimi_registry((GraphSafe(True), "early"))
    caps = kind_caps(registry, "kimi_k3.mla")
    assert (caps.decode_graph_unsupported, caps.answered_by["decode_graph_unsupported"]) == (False, "kimi_k3")
    # Registered before the owner but tryfirst: it answers.
    registry = fresh_kimi_registry((GraphSafeFirst(True), "early"))
    caps = kind_caps(registry, "kimi_k3.mla")
    assert (caps.decode_graph_unsupported, caps.answered_by["decode_graph_unsupported"]) == (True, "early")
    # A later plugin without tryfirst does not beat a tryfirst one.
    registry.add_plugin(GraphSafe(False), name="late")
    caps = kind_caps(registry, "kimi_k3.mla")
    assert caps.answered_by["decode_graph_unsupported"] == "early"


def test_first_answer_agrees_with_pluggys_own_call():
    registry = fresh_kimi_registry((GraphSafeFirst(True), "early"))
    registry.add_plugin(GraphSafe(False), name="late")
    for kind in ("kimi_k3.mla", "kimi_k3.kda", "nobody.decoder"):
        for query in QUERIES:
            hook = getattr(registry.pm.hook, query)
            kwargs = dict(layer_kind=kind, layer=None, engine_config=None)
            assert first_answer(hook, **kwargs)[0] == hook(**kwargs), (kind, query)


def test_a_hook_wrapper_does_not_become_the_answer(registry):
    class Logging:
        seen: list = []

        @hookimpl(wrapper=True)
        def decode_graph_unsupported(self, layer_kind):
            result = yield
            self.seen.append((layer_kind, result))
            return result

    registry.add_plugin(Logging(), name="logging")
    caps = gather(registry, 0, OddLayer(decode_graph_unsupported=True))
    assert caps.decode_graph_unsupported is True
    assert caps.answered_by["decode_graph_unsupported"] == "toy"
    assert gather(registry, 0, ToyLayer()).decode_graph_unsupported is False


# -- the real qwen3 plugin -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3.decoder", "qwen3_moe.decoder", "qwen2.decoder"])
def test_qwen3_layers_take_the_cores_defaults(real_registry, kind):
    """Plain attention layers need no capability answers of their own: every query falls to the
    core's defaults, whose values are the true ones for them (the kit checks them)."""
    caps = kind_caps(real_registry, kind)
    for query in QUERIES:
        assert caps.answered_by[query] in (DEFAULTS, None), query
        assert caps.answers[query] == QUERIES[query], query
    model = ModelCapabilities.from_layers([caps], env={})
    assert model.disabled() == ()
    assert model.prefix_matching_allowed and model.chunked_prefill_allowed and model.fp8_graphs_ready


def test_qwen3_plugin_has_no_opinion_on_other_kinds(real_registry):
    caps = kind_caps(real_registry, "toy.decoder")
    assert set(caps.answered_by.values()) <= {DEFAULTS, None}


def test_summary_is_json_ready(registry):
    model = build(registry, five_with(1, decode_rollback_unsupported=True, is_ssm_layer=True, uses_ssm_pool=False))
    summary = json.loads(json.dumps(model.summary()))
    assert summary["rollback_veto"] is True and summary["decode_graph_veto"] is False
    assert summary["ssm_split_prefill_layers"] == [1] and summary["own_state_layers"] == [1]
    assert {c["feature"] for c in summary["disabled"]} == {"rollback_to_boundary", "in-pass replay-tail capture"}


def test_speculation_is_blocked_only_by_own_state_layers_without_per_draft_states():
    attention = LayerCapabilities.of(0, "Attn", "toy.attn", "toy")
    pool = LayerCapabilities.of(1, "Gdn", "toy.gdn", "toy", uses_ssm_pool=True)
    own = LayerCapabilities.of(2, "Own", "toy.own", "toy", uses_ssm_pool=False)
    own_drafts = LayerCapabilities.of(3, "OwnDrafts", "toy.own2", "toy", uses_ssm_pool=False, keeps_per_draft_states=True)
    assert ModelCapabilities.from_layers([attention, pool, own_drafts], env={}).speculation_blocker() is None
    cause = ModelCapabilities.from_layers([attention, pool, own, own_drafts], env={}).speculation_blocker()
    assert (cause.layer_index, cause.layer_class, cause.query, cause.plugin) == (2, "Own", "keeps_per_draft_states", None)  # the default
    # a pool layer's own answer does not matter: the pool keeps its per-draft states
    pool_no = LayerCapabilities.of(1, "Gdn", "toy.gdn", "toy", uses_ssm_pool=True, keeps_per_draft_states=False)
    assert ModelCapabilities.from_layers([pool_no], env={}).speculation_blocker() is None


# -- the capability table helper and the promises it is checked against --------------------------


def test_a_capability_table_answers_like_hand_written_hookimpls(registry):
    from layerzoo.capability_table import capability_hookimpls

    class Layer:
        fp8_calibration_frozen = False

    impls = capability_hookimpls({"t.kind": {"decode_graph_unsupported": True, "fp8_calibration_frozen": lambda layer: layer.fp8_calibration_frozen}})
    assert sorted(impls) == ["decode_graph_unsupported", "fp8_calibration_frozen"]
    assert impls["decode_graph_unsupported"](layer_kind="t.kind", layer=None) is True
    assert impls["decode_graph_unsupported"](layer_kind="other", layer=None) is None
    assert impls["fp8_calibration_frozen"](layer_kind="t.kind", layer=Layer()) is False
    assert impls["fp8_calibration_frozen"](layer_kind="t.kind", layer=None) is None

    import types

    plugin = types.SimpleNamespace(**impls)
    registry.add_plugin(plugin, name="table-plugin")
    caps = LayerCapabilities.gather(registry.pm, layer_index=0, layer_kind="t.kind", layer=Layer())
    assert caps.decode_graph_unsupported is True and caps.answered_by["decode_graph_unsupported"] == "table-plugin"
    assert caps.fp8_calibration_frozen is False


def test_a_capability_table_with_an_unknown_query_is_refused():
    from layerzoo.capability_table import capability_hookimpls
    from layerzoo.errors import PluginError

    with pytest.raises(PluginError, match=r"'t.kind' answers unknown queries \['decode_graphs_unsupported'\]"):
        capability_hookimpls({"t.kind": {"decode_graphs_unsupported": True}})


class _PromisesSplitPrefill:
    @hookimpl(tryfirst=True)
    def is_ssm_layer(self, layer_kind):
        return True if layer_kind == "qwen3.decoder" else None


class _PromisesOwnState:
    @hookimpl(tryfirst=True)
    def uses_ssm_pool(self, layer_kind):
        return False if layer_kind == "qwen3.decoder" else None

    @hookimpl(tryfirst=True)
    def keeps_per_draft_states(self, layer_kind):
        return True if layer_kind == "qwen3.decoder" else None


@pytest.mark.parametrize("plugin, missing", [
    (_PromisesSplitPrefill(), "is_ssm_layer=True .* does not implement prefill_phase1, prefill_phase3"),
    (_PromisesOwnState(), "uses_ssm_pool=False .* does not implement alloc_state"),
])
def test_an_answer_that_promises_methods_is_checked_at_build(tiny_qwen3_dir, plugin, missing):
    from layerzoo.errors import PluginError
    from layerzoo.loading.model_loading import load_model
    from layerzoo.testing import registered_plugin

    with registered_plugin(plugin, "promises"):
        with pytest.raises(PluginError, match=r"layer 0 \(Qwen3DecoderLayer, kind qwen3.decoder\) answers " + missing):
            load_model(tiny_qwen3_dir)
