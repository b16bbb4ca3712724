"""The plugin manager: discovery through entry points and the registries plugins fill.

Plugins are Python modules found through the ``layerzoo`` entry-point group. Loading one imports
its module (which must stay light: no torch kernels, no device) and calls its registration hooks;
the things it registers are lazy ``"module:attr"`` strings resolved only when used.

Environment:

* ``LAYERZOO_PLUGINS=a,b`` loads only those entry points (empty: none); built-ins always load.
* ``LAYERZOO_DISABLE_PLUGINS=x,y`` blocks those entry points.
* ``LAYERZOO_PREFER=Arch=plugin,...`` picks one plugin where several claim an architecture.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import pluggy

from layerzoo import hookspecs, settings
from layerzoo.errors import ArchitectureNotSupported, PluginConflict, PluginError, UserError
from layerzoo.plugins.lazy import resolve_object  # noqa: F401 (public here too)

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "layerzoo"

# Registered before any entry point; the defaults are trylast, so registration order is moot.
BUILTIN_PLUGINS = ("layerzoo.plugins.defaults", "layerzoo.kernels", "layerzoo.speculative")

# Which distribution serves which architecture family, for the "pip install ..." hint.
# Longest prefix first: "Qwen3Next" must not be taken for "Qwen3".
KNOWN_ARCHITECTURES: tuple[tuple[str, str], ...] = (
    ("Qwen3Next", "layerzoo-ssm"),
    ("Qwen3_5", "layerzoo-ssm"),
    ("Qwen3Moe", "layerzoo-qwen3"),
    ("Qwen3", "layerzoo-qwen3"),
    ("GlmMoeDsa", "layerzoo-glm53"),
    ("Glm5Next", "layerzoo-glm53"),
    ("KimiLinear", "layerzoo-kimi-k3"),
    ("KimiK3", "layerzoo-kimi-k3"),
    ("Mamba2", "layerzoo-ssm"),
    ("Qwen2", "layerzoo-qwen3"),
    ("Llama", "layerzoo-llama"),
    ("Mistral", "layerzoo-llama"),
)


def package_for_architecture(name: str) -> str | None:
    """The distribution that serves architecture ``name``, from the known-architectures table."""
    for prefix, package in KNOWN_ARCHITECTURES:
        if name.startswith(prefix):
            return package
    return None


@attrs.frozen
class Registration:
    """One thing a plugin registered: its name, the (lazy) target and the plugin's name."""

    name: str
    target: Any
    plugin: str
    extra: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class PluginInfo:
    name: str
    version: str | None
    distribution: str | None
    module: str


class _Table:
    """A name -> Registration table that records conflicts instead of overwriting.

    The same plugin registering the same target again is a no-op (plugins load in every process
    and may register twice); a different plugin claiming a taken name is a conflict, reported when
    the name is used.
    """

    def __init__(self, what: str):
        self.what = what
        self.entries: dict[Any, Registration] = {}
        self.conflicts: dict[Any, list[Registration]] = {}

    def add(self, key: Any, reg: Registration) -> None:
        old = self.entries.get(key)
        if old is None:
            self.entries[key] = reg
        elif old.plugin == reg.plugin:
            if old.target != reg.target:
                raise PluginError(
                    f"plugin {reg.plugin!r} registered {self.what} {key!r} twice with different "
                    f"targets ({old.target!r}, {reg.target!r})"
                )
        else:
            claims = self.conflicts.setdefault(key, [old])
            if all(c.plugin != reg.plugin for c in claims):
                claims.append(reg)

    def get(self, key: Any, prefer: str | None = None) -> Registration | None:
        claims = self.conflicts.get(key)
        if not claims:
            return self.entries.get(key)
        for claim in claims:
            if claim.plugin == prefer:
                return claim
        names = " and ".join(repr(c.plugin) for c in claims)
        raise PluginConflict(
            f"{self.what} {key!r} is registered by both {names}; choose one with "
            f"LAYERZOO_PREFER={key}=<plugin> or disable one with LAYERZOO_DISABLE_PLUGINS"
        )

    def __iter__(self):
        return iter(self.entries)


class PluginRegistry:
    """The plugin manager and the registries its plugins filled."""

    def __init__(self, env: Mapping[str, str] | None = None):
        # The environment's choices, read once here (``env`` stands in for os.environ in tests).
        self.only = settings.names("LAYERZOO_PLUGINS", env)
        self.disabled = set(settings.names("LAYERZOO_DISABLE_PLUGINS", env) or [])
        self.prefer = settings.pairs("LAYERZOO_PREFER", env)
        self.kernel_backend = settings.text("LAYERZOO_KERNEL_BACKEND", env)
        self.pm = pluggy.PluginManager("layerzoo")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.failed: dict[str, str] = {}
        self.blocked: dict[str, str | None] = {}  # entry-point name -> its distribution
        self.architectures = _Table("architecture")
        self.layer_kinds = _Table("layer kind")
        self.kernels = _Table("kernel")
        self.weight_mappings = _Table("weight mapping")
        self.proposers = _Table("speculative method")
        self.chat_formats = _Table("chat format")
        self._ops: dict[str, Any] = {}

    # -- loading ---------------------------------------------------------------------------

    def load(self, entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> None:
        """Register the built-ins, then every allowed entry point; a broken plugin is skipped."""
        for module_name in BUILTIN_PLUGINS:
            self.add_plugin(importlib.import_module(module_name), name=module_name)
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in sorted(entry_points, key=lambda e: e.name):
            if (self.only is not None and ep.name not in self.only) or ep.name in self.disabled:
                self.pm.set_blocked(ep.name)
                dist = getattr(ep, "dist", None)
                self.blocked[ep.name] = dist.metadata["Name"] if dist else None
                continue
            self._load_entry_point(ep)
        self.pm.check_pending()

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        if self.pm.has_plugin(ep.name) or self.pm.is_blocked(ep.name):
            return
        dist = getattr(ep, "dist", None)
        try:
            plugin = ep.load()
            self.add_plugin(
                plugin,
                name=ep.name,
                version=dist.version if dist else None,
                distribution=dist.metadata["Name"] if dist else None,
            )
        except Exception as exc:
            # A broken plugin (an import error, or a misspelt hook that check_pending rejects)
            # is reported by name, loudly, and must not take the others down.
            self.failed[ep.name] = f"{type(exc).__name__}: {exc}"
            log.warning("layerzoo plugin %r failed to load: %s", ep.name, self.failed[ep.name])

    def add_plugin(
        self,
        plugin: Any,
        name: str | None = None,
        *,
        version: str | None = None,
        distribution: str | None = None,
    ) -> str:
        """Register ``plugin`` and collect what its registration hooks register.

        If validation or a registration hook fails, the plugin is removed with everything it had
        registered so far, and the error propagates.
        """
        registered = self.pm.register(plugin, name=name)
        if registered is None:
            raise PluginError(f"plugin {name!r} is blocked (LAYERZOO_PLUGINS/LAYERZOO_DISABLE_PLUGINS)")
        try:
            self.pm.check_pending()
            module = getattr(plugin, "__name__", type(plugin).__name__)
            self.plugins.append(PluginInfo(registered, version, distribution, module))
            self._collect(registered)
        except BaseException:
            self.remove_plugin(registered)
            raise
        return registered

    def remove_plugin(self, name: str) -> None:
        """Unregister a plugin and drop everything it registered (used by tests)."""
        self.pm.unregister(name=name)
        self.plugins = [p for p in self.plugins if p.name != name]
        for table in (self.architectures, self.layer_kinds, self.kernels, self.weight_mappings, self.proposers,
                      self.chat_formats):
            table.entries = {k: r for k, r in table.entries.items() if r.plugin != name}
            for key in list(table.conflicts):
                claims = [r for r in table.conflicts[key] if r.plugin != name]
                if len(claims) > 1:
                    table.conflicts[key] = claims
                else:
                    del table.conflicts[key]
                    if claims:
                        table.entries[key] = claims[0]

    def _collect(self, plugin_name: str) -> None:
        def call(hook_name: str, register: Callable[..., None]) -> None:
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name == plugin_name:
                    kwargs = {"register": register}
                    impl.function(**{k: kwargs[k] for k in impl.argnames})

        def arch(name: str, builder: Any) -> None:
            self.architectures.add(name, Registration(name, builder, plugin_name))

        def kind(name: str, layer_class: Any, description: str = "") -> None:
            reg = Registration(name, layer_class, plugin_name, {"description": description})
            self.layer_kinds.add(name, reg)

        def kernel(op: str, backend: str, fn: Any) -> None:
            self.kernels.add((op, backend), Registration(op, fn, plugin_name, {"backend": backend}))

        def mapping(architecture: str, fn: Any) -> None:
            self.weight_mappings.add(architecture, Registration(architecture, fn, plugin_name))

        def proposer(method: str, factory: Any) -> None:
            self.proposers.add(method, Registration(method, factory, plugin_name))

        call("register_architectures", arch)
        call("register_layer_kinds", kind)
        call("register_kernels", kernel)
        call("register_weight_mappings", mapping)
        def chat_format(architecture: str, fmt: Any) -> None:
            self.chat_formats.add(architecture, Registration(architecture, fmt, plugin_name))

        call("register_proposers", proposer)
        call("register_chat_formats", chat_format)

    # -- lookups ---------------------------------------------------------------------------

    def architecture(self, name: str) -> Registration:
        """The registration serving architecture ``name``, or a clear error saying what to install."""
        reg = self.architectures.get(name, prefer=self.prefer.get(name))
        if reg is not None:
            return reg
        package = package_for_architecture(name)
        if package is None:
            raise ArchitectureNotSupported(
                f"architecture {name!r} is not served by any installed layerzoo plugin "
                "and no known plugin serves it"
            )
        why = ""
        if any(info.distribution == package for info in self.plugins):
            why = " (it is installed but did not register this architecture)"
        elif package in self.blocked.values():
            why = " (it is installed but disabled by LAYERZOO_PLUGINS/LAYERZOO_DISABLE_PLUGINS)"
        raise ArchitectureNotSupported(
            f"architecture {name!r} needs the plugin {package}: pip install {package}{why}"
        )

    def model_class(self, architecture: str) -> type:
        return resolve_object(self.architecture(architecture).target)

    def weight_mapping(self, architecture: str) -> Callable | None:
        reg = self.weight_mappings.get(architecture, prefer=self.prefer.get(architecture))
        return None if reg is None else resolve_object(reg.target)

    def chat_format(self, architecture: str):
        """The `layerzoo.tokenization.chat_formats.ChatFormat` registered for ``architecture``, or None."""
        from layerzoo.tokenization.chat_formats import as_chat_format

        reg = self.chat_formats.get(architecture, prefer=self.prefer.get(architecture))
        if reg is None:
            return None
        return as_chat_format(reg.target, f"plugin {reg.plugin!r}: chat format of {architecture}")

    def kernel(self, op: str) -> Callable:
        """The op's dispatcher: the backend chosen per call's device (see layerzoo.plugins.kernel_registry)."""
        from layerzoo.plugins.kernel_registry import BACKEND_ENV, KernelOp

        cached = self._ops.get(op)
        if cached is None:
            backends = {backend: reg.target for (name, backend), reg in self.kernels.entries.items() if name == op}
            if not backends:
                raise PluginError(f"no kernel registered for op {op!r}")
            cached = self._ops[op] = KernelOp(op, backends, {BACKEND_ENV: self.kernel_backend or ""})
        return cached

    def proposer(self, method: str) -> Callable:
        """The factory ``factory(config) -> Proposer`` registered for speculative ``method``.

        An unknown method is a ``UserError`` listing the registered ones; two plugins claiming it
        is a ``PluginConflict`` unless ``LAYERZOO_PREFER=<method>=<plugin>`` picks one.
        """
        reg = self.proposers.get(method, prefer=self.prefer.get(method))
        if reg is None:
            known = ", ".join(repr(m) for m in sorted(self.proposers)) or "none"
            raise UserError(f"speculative_config.method: unknown method {method!r} (registered: {known})")
        return resolve_object(reg.target)

    def layer_kind_of(self, layer: Any) -> str:
        """The registered kind name of a layer instance (its class's ``layer_kind``)."""
        kind = getattr(layer, "layer_kind", None)
        if kind is None:
            raise PluginError(f"layer class {type(layer).__name__} declares no `layer_kind`")
        return kind


_REGISTRY: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use (cheap: no torch, no device)."""
    global _REGISTRY
    if _REGISTRY is None:
        registry = PluginRegistry()
        registry.load()
        _REGISTRY = registry
    return _REGISTRY

