"""The plugin manager: entry-point discovery, env filters, broken plugins, conflicts, hints."""

from __future__ import annotations

import importlib.metadata
import inspect
import itertools
import os
import subprocess
import sys
import textwrap

import pluggy
import pytest

import layerzoo
from layerzoo import hookimpl, hookspecs
from layerzoo.errors import ArchitectureNotSupported, PluginConflict, PluginError, UserError
from layerzoo.plugins import capabilities, defaults
from layerzoo.plugins.manager import (
    BUILTIN_PLUGINS,
    KNOWN_ARCHITECTURES,
    PluginRegistry,
    package_for_architecture,
    resolve_object,
)

_ids = itertools.count()

ARCH_PLUGIN = """
from layerzoo import hookimpl

@hookimpl
def register_architectures(register):
    register({arch!r}, {target!r})
"""


@pytest.fixture
def make_plugin(tmp_path, monkeypatch):
    """Write a plugin module into tmp_path and return an entry point that names it.

    Module names are unique per call so that sys.modules never hands back another test's module.
    """
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def make(ep_name: str, source: str) -> importlib.metadata.EntryPoint:
        module = f"lz_test_plugin_{ep_name}_{next(_ids)}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        written.append(module)
        return importlib.metadata.EntryPoint(name=ep_name, value=module, group="layerzoo")

    yield make
    for module in written:
        sys.modules.pop(module, None)


def arch_plugin(make_plugin, ep_name: str, arch: str, target: str | None = None):
    return make_plugin(ep_name, ARCH_PLUGIN.format(arch=arch, target=target or f"{ep_name}_models:{arch}"))


def names(registry: PluginRegistry) -> list[str]:
    return [p.name for p in registry.plugins]


# -- discovery of the real installed plugin ------------------------------------------------------


def test_entry_points_load_the_installed_qwen3_plugin():
    registry = PluginRegistry(env={})
    registry.load()
    assert registry.failed == {}
    info = next(p for p in registry.plugins if p.name == "qwen3")
    assert (info.distribution, info.module) == ("layerzoo-qwen3", "layerzoo_qwen3")
    assert registry.pm.has_plugin("qwen3")

    for arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        reg = registry.architecture(arch)
        assert reg.plugin == "qwen3"
        assert reg.target == f"layerzoo_qwen3.model:{arch}"
    for kind, cls in (("qwen3.decoder", "Qwen3DecoderLayer"), ("qwen3_moe.decoder", "Qwen3MoeDecoderLayer")):
        reg = registry.layer_kinds.entries[kind]
        assert (reg.plugin, reg.target) == ("qwen3", f"layerzoo_qwen3.model:{cls}")
        assert reg.extra["description"]
    reg = registry.weight_mappings.entries["Qwen3MoeForCausalLM"]
    assert (reg.plugin, reg.target) == ("qwen3", "layerzoo_qwen3.weights:moe_name_map")


def test_builtin_kernels_register_torch_ops_that_resolve():
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    for op in ("rms_norm", "rotary_embedding", "silu_and_mul"):
        reg = registry.kernels.entries[(op, "torch")]
        assert reg.plugin == "layerzoo.kernels"
        assert callable(resolve_object(reg.target))
    with pytest.raises(PluginError, match="no kernel registered for op 'nope'"):
        registry.kernel("nope")


def test_loading_plugins_imports_no_model_code_and_no_torch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERZOO_")}
    code = textwrap.dedent(
        """
        import sys
        from layerzoo.plugins.manager import PluginRegistry
        registry = PluginRegistry()
        registry.load()
        assert registry.architecture("Qwen3ForCausalLM").plugin == "qwen3", registry.plugins
        assert "layerzoo_qwen3" in sys.modules
        heavy = [m for m in ("layerzoo_qwen3.model", "layerzoo_qwen3.weights", "torch") if m in sys.modules]
        assert not heavy, heavy
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# -- environment filters -------------------------------------------------------------------------


def test_layerzoo_plugins_loads_only_those_named(make_plugin):
    eps = [arch_plugin(make_plugin, n, f"{n.upper()}ForCausalLM") for n in ("a", "b", "c")]
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": " a , c "})
    registry.load(entry_points=eps)
    assert names(registry) == [*BUILTIN_PLUGINS, "a", "c"]
    assert registry.architecture("AForCausalLM").plugin == "a"
    assert registry.architecture("CForCausalLM").plugin == "c"
    assert "BForCausalLM" not in set(registry.architectures)
    assert eps[1].value not in sys.modules  # a plugin left out is never imported
    assert set(registry.blocked) == {"b"}


def test_empty_layerzoo_plugins_loads_none_but_keeps_builtins(make_plugin):
    eps = [arch_plugin(make_plugin, n, f"{n.upper()}ForCausalLM") for n in ("a", "b")]
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load(entry_points=eps)
    assert names(registry) == list(BUILTIN_PLUGINS)
    assert list(registry.architectures) == []
    assert registry.pm.has_plugin("layerzoo.plugins.defaults") and registry.pm.has_plugin("layerzoo.kernels")
    assert registry.pm.hook.decode_graph_unsupported(layer_kind="x", layer=None, engine_config=None) is False
    assert ("rms_norm", "torch") in set(registry.kernels)


def test_disable_plugins_blocks_the_named_one(make_plugin):
    eps = [arch_plugin(make_plugin, n, f"{n.upper()}ForCausalLM") for n in ("a", "b")]
    registry = PluginRegistry(env={"LAYERZOO_DISABLE_PLUGINS": "b"})
    registry.load(entry_points=eps)
    assert names(registry) == [*BUILTIN_PLUGINS, "a"]
    assert registry.pm.is_blocked("b")
    assert set(registry.architectures) == {"AForCausalLM"}


def test_without_env_every_entry_point_loads(make_plugin):
    eps = [arch_plugin(make_plugin, n, f"{n.upper()}ForCausalLM") for n in ("b", "a")]
    registry = PluginRegistry(env={})
    registry.load(entry_points=eps)
    assert names(registry) == [*BUILTIN_PLUGINS, "a", "b"]  # sorted by entry-point name
    assert registry.blocked == {}


# -- broken plugins ------------------------------------------------------------------------------


def test_plugin_that_fails_to_import_is_reported_and_others_load(make_plugin):
    good = arch_plugin(make_plugin, "good", "GoodForCausalLM")
    broken = make_plugin("broken", "raise RuntimeError('kaboom at import')\n")
    missing = importlib.metadata.EntryPoint(name="missing", value="lz_no_such_module_xyz", group="layerzoo")
    registry = PluginRegistry(env={})
    registry.load(entry_points=[broken, good, missing])
    assert set(registry.failed) == {"broken", "missing"}
    assert registry.failed["broken"] == "RuntimeError: kaboom at import"
    assert registry.failed["missing"].startswith("ModuleNotFoundError")
    assert names(registry) == [*BUILTIN_PLUGINS, "good"]
    assert not registry.pm.has_plugin("broken")
    assert registry.architecture("GoodForCausalLM").plugin == "good"


def test_plugin_failing_during_registration_leaves_nothing_behind(make_plugin):
    half = make_plugin(
        "half",
        """
        from layerzoo import hookimpl

        @hookimpl
        def register_architectures(register):
            register("HalfForCausalLM", "half_models:Half")

        @hookimpl
        def register_layer_kinds(register):
            raise ValueError("cannot describe my layers")

        @hookimpl
        def decode_graph_unsupported(layer_kind):
            return True
        """,
    )
    good = arch_plugin(make_plugin, "good", "GoodForCausalLM")
    registry = PluginRegistry(env={})
    registry.load(entry_points=[half, good])
    assert registry.failed == {"half": "ValueError: cannot describe my layers"}
    assert names(registry) == [*BUILTIN_PLUGINS, "good"]
    assert set(registry.architectures) == {"GoodForCausalLM"}
    assert not registry.pm.has_plugin("half")
    # Its capability answers are gone too: the default answers again.
    assert registry.pm.hook.decode_graph_unsupported(layer_kind="x", layer=None, engine_config=None) is False


def test_misspelt_hookimpl_fails_loudly_and_does_not_poison_the_registry():
    class Misspelt:
        @hookimpl
        def regster_architectures(self, register):
            register("TypoForCausalLM", "typo:Typo")

    class Good:
        @hookimpl
        def register_architectures(self, register):
            register("GoodForCausalLM", "good:Good")

    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    with pytest.raises(pluggy.PluginValidationError, match="regster_architectures"):
        registry.add_plugin(Misspelt(), name="misspelt")
    assert not registry.pm.has_plugin("misspelt")
    assert "misspelt" not in names(registry)
    # The next plugin is not blamed for the misspelt one.
    registry.add_plugin(Good(), name="good")
    assert registry.architecture("GoodForCausalLM").plugin == "good"
    registry.pm.check_pending()


def test_misspelt_hookimpl_in_an_entry_point_is_reported_and_others_load(make_plugin, caplog):
    good = make_plugin(
        "fine",
        """
        from layerzoo import hookimpl

        @hookimpl
        def register_architectures(register):
            register("FineForCausalLM", "fine:Fine")
        """,
    )
    ep = make_plugin(
        "typo",
        """
        from layerzoo import hookimpl

        @hookimpl
        def regster_architectures(register):
            register("TypoForCausalLM", "typo:Typo")
        """,
    )
    registry = PluginRegistry(env={})
    registry.load(entry_points=[ep, good])
    assert "unknown hook 'regster_architectures'" in registry.failed["typo"]
    assert "typo" in caplog.text and "regster_architectures" in caplog.text
    assert not registry.pm.has_plugin("typo")
    assert registry.architecture("FineForCausalLM").plugin == "fine"


def test_hookimpl_with_an_argument_the_spec_lacks_is_rejected():
    class WrongArg:
        @hookimpl
        def decode_graph_unsupported(self, layer_knd):
            return True

    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    with pytest.raises(pluggy.PluginValidationError, match="layer_knd"):
        registry.add_plugin(WrongArg(), name="wrongarg")
    assert not registry.pm.has_plugin("wrongarg")


# -- conflicts -----------------------------------------------------------------------------------


def test_two_plugins_claiming_one_architecture_conflict_naming_both(make_plugin):
    eps = [
        arch_plugin(make_plugin, "alpha", "DupForCausalLM", "alpha_models:Dup"),
        arch_plugin(make_plugin, "beta", "DupForCausalLM", "beta_models:Dup"),
    ]
    registry = PluginRegistry(env={})
    registry.load(entry_points=eps)  # loading does not fail: only using the name does
    with pytest.raises(PluginConflict) as info:
        registry.architecture("DupForCausalLM")
    message = str(info.value)
    assert "'alpha'" in message and "'beta'" in message and "DupForCausalLM" in message
    assert "LAYERZOO_PREFER" in message
    assert isinstance(info.value, UserError)


@pytest.mark.parametrize("chosen", ["alpha", "beta"])
def test_layerzoo_prefer_picks_one_of_the_claims(make_plugin, chosen):
    eps = [
        arch_plugin(make_plugin, "alpha", "DupForCausalLM", "alpha_models:Dup"),
        arch_plugin(make_plugin, "beta", "DupForCausalLM", "beta_models:Dup"),
    ]
    registry = PluginRegistry(env={"LAYERZOO_PREFER": f"Other=x, DupForCausalLM={chosen}"})
    registry.load(entry_points=eps)
    reg = registry.architecture("DupForCausalLM")
    assert (reg.plugin, reg.target) == (chosen, f"{chosen}_models:Dup")


def test_prefer_naming_a_plugin_that_makes_no_claim_still_conflicts(make_plugin):
    eps = [arch_plugin(make_plugin, n, "DupForCausalLM") for n in ("alpha", "beta")]
    registry = PluginRegistry(env={"LAYERZOO_PREFER": "DupForCausalLM=gamma"})
    registry.load(entry_points=eps)
    with pytest.raises(PluginConflict):
        registry.architecture("DupForCausalLM")


def test_same_plugin_registering_the_same_architecture_twice_is_a_noop():
    class Twice:
        @hookimpl
        def register_architectures(self, register):
            register("TwiceForCausalLM", "twice:Model")
            register("TwiceForCausalLM", "twice:Model")

    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    registry.add_plugin(Twice(), name="twice")
    assert registry.architectures.conflicts == {}
    assert registry.architecture("TwiceForCausalLM").target == "twice:Model"


def test_same_plugin_registering_two_targets_for_one_name_is_an_error():
    class Confused:
        @hookimpl
        def register_architectures(self, register):
            register("ConfusedForCausalLM", "confused:A")
            register("ConfusedForCausalLM", "confused:B")

    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    with pytest.raises(PluginError, match="twice with different targets"):
        registry.add_plugin(Confused(), name="confused")


DUP_TWICE = """
from layerzoo import hookimpl

@hookimpl
def register_architectures(register):
    register("DupForCausalLM", "{name}:Dup")
    register("DupForCausalLM", "{name}:Dup")
"""


def test_removing_one_claimant_resolves_the_conflict(make_plugin):
    # Each registers twice: a claim is counted once per plugin.
    eps = [make_plugin(n, DUP_TWICE.format(name=n)) for n in ("alpha", "beta")]
    registry = PluginRegistry(env={})
    registry.load(entry_points=eps)
    with pytest.raises(PluginConflict) as info:
        registry.architecture("DupForCausalLM")
    assert "by both 'alpha' and 'beta';" in str(info.value)
    registry.remove_plugin("alpha")
    assert registry.architecture("DupForCausalLM").plugin == "beta"
    assert "alpha" not in names(registry)


# -- missing architectures -----------------------------------------------------------------------

FAMILIES = [
    ("Qwen3ForCausalLM", "layerzoo-qwen3"),
    ("Qwen3MoeForCausalLM", "layerzoo-qwen3"),
    ("GlmMoeDsaForCausalLM", "layerzoo-glm53"),
    ("Glm5NextForConditionalGeneration", "layerzoo-glm53"),
    ("KimiLinearForCausalLM", "layerzoo-kimi-k3"),
    ("KimiK3ForConditionalGeneration", "layerzoo-kimi-k3"),
    ("Qwen3NextForCausalLM", "layerzoo-ssm"),
    ("Qwen3_5ForCausalLM", "layerzoo-ssm"),
    ("Mamba2ForCausalLM", "layerzoo-ssm"),
    ("Qwen2ForCausalLM", "layerzoo-qwen3"),
    ("LlamaForCausalLM", "layerzoo-llama"),
    ("MistralForCausalLM", "layerzoo-llama"),
]


@pytest.mark.parametrize("arch,package", FAMILIES)
def test_unserved_architecture_names_the_package_to_install(arch, package):
    registry = PluginRegistry(env={})
    registry.load(entry_points=[])
    assert package_for_architecture(arch) == package
    with pytest.raises(ArchitectureNotSupported) as info:
        registry.architecture(arch)
    message = str(info.value)
    assert f"pip install {package}" in message and repr(arch) in message
    others = {p for _, p in KNOWN_ARCHITECTURES} - {package}
    assert not any(other in message for other in others), message
    assert isinstance(info.value, UserError)


def test_longest_prefix_wins_qwen3_next_is_not_qwen3():
    assert package_for_architecture("Qwen3NextForCausalLM") == "layerzoo-ssm"
    assert package_for_architecture("Qwen3_5MoeForCausalLM") == "layerzoo-ssm"
    assert package_for_architecture("Qwen3ForCausalLM") == "layerzoo-qwen3"
    # A prefix listed after a shorter one it extends would never be reached.
    prefixes = [p for p, _ in KNOWN_ARCHITECTURES]
    for i, longer in enumerate(prefixes):
        assert not any(longer.startswith(shorter) for shorter in prefixes[:i]), longer


def test_unknown_architecture_says_no_plugin_serves_it():
    registry = PluginRegistry(env={})
    registry.load(entry_points=[])
    assert package_for_architecture("GPTNeoXForCausalLM") is None
    with pytest.raises(ArchitectureNotSupported, match="no known plugin serves it"):
        registry.architecture("GPTNeoXForCausalLM")


def test_disabled_qwen3_plugin_is_named_and_said_to_be_disabled():
    registry = PluginRegistry(env={"LAYERZOO_DISABLE_PLUGINS": "qwen3"})
    registry.load()
    assert registry.blocked == {"qwen3": "layerzoo-qwen3"}
    assert "qwen3" not in names(registry)
    with pytest.raises(ArchitectureNotSupported) as info:
        registry.architecture("Qwen3ForCausalLM")
    message = str(info.value)
    assert "pip install layerzoo-qwen3" in message and "disabled" in message


def test_installed_plugin_that_does_not_register_the_architecture_says_so():
    registry = PluginRegistry(env={})
    registry.load(entry_points=[])
    registry.add_plugin(type("Glm", (), {})(), name="glm53", distribution="layerzoo-glm53")
    with pytest.raises(ArchitectureNotSupported, match="installed but did not register"):
        registry.architecture("GlmMoeDsaForCausalLM")


# -- lazy references -----------------------------------------------------------------------------


def test_resolve_object_imports_module_attr():
    assert resolve_object("os.path:join") is os.path.join
    assert resolve_object("collections:OrderedDict.fromkeys") == __import__("collections").OrderedDict.fromkeys
    sentinel = object()
    assert resolve_object(sentinel) is sentinel


@pytest.mark.parametrize("bad", ["os.path.join", "os.path:", ":join", ""])
def test_resolve_object_rejects_malformed_references(bad):
    with pytest.raises(PluginError, match="not of the form 'module:attr'"):
        resolve_object(bad)


def test_layer_kind_of_requires_a_declared_kind():
    registry = PluginRegistry(env={})
    assert registry.layer_kind_of(type("L", (), {"layer_kind": "x.decoder"})()) == "x.decoder"
    with pytest.raises(PluginError, match="NoKind declares no `layer_kind`"):
        registry.layer_kind_of(type("NoKind", (), {})())


# -- doc drift: hookspecs, QUERIES and defaults agree --------------------------------------------


def _specs() -> dict[str, object]:
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, "layerzoo_spec")
    }


def _defaults() -> dict[str, object]:
    return {
        name: fn
        for name, fn in inspect.getmembers(defaults, inspect.isfunction)
        if hasattr(fn, "layerzoo_impl")
    }


def test_every_hookspec_has_a_docstring():
    specs = _specs()
    assert len(specs) >= 14
    for name, fn in specs.items():
        assert (fn.__doc__ or "").strip(), f"hookspec {name} has no docstring"


def test_capability_queries_hookspecs_and_defaults_agree():
    specs = _specs()
    firstresult = {name for name, fn in specs.items() if fn.layerzoo_spec["firstresult"]}
    default_impls = _defaults()
    assert set(capabilities.QUERIES) == firstresult
    assert set(capabilities.QUERIES) == set(default_impls)
    for query, default in capabilities.QUERIES.items():
        impl = default_impls[query]
        assert impl.layerzoo_impl["trylast"], f"default for {query} is not trylast"
        # Asked about a kind with no layer built, every default is the table's value.
        answer = impl(**{name: None for name in inspect.signature(impl).parameters})
        assert answer is default or answer == default, query
        # A spec that documents its default must document the same one.
        doc = specs[query].__doc__
        if "Default: ``" in doc:
            assert f"Default: ``{default!r}``" in doc, query


def test_every_hook_name_layerzoo_exports_is_a_spec():
    assert layerzoo.hookimpl.project_name == layerzoo.hookspec.project_name == "layerzoo"
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    hooks = {name for name in vars(registry.pm.hook) if not name.startswith("_")}
    assert hooks == set(_specs())


def test_the_repository_root_does_not_shadow_the_kernels_package():
    """From the repo root, `kernels` must not resolve to our kernels/ folder (vLLM's model
    inspection and transformers' hub-kernels probe import that name)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("kernels")
    root = Path(__file__).resolve().parents[1]
    assert spec is None or not str(spec.origin or "").startswith(str(root / "kernels")), spec
