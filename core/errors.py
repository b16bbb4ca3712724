"""The exceptions layerzoo raises on purpose.

`UserError` and its subclasses are mistakes in what a user asked for or handed us (a path, a
checkpoint, a flag). The CLI prints them as one line and exits with code 2; everything else is a
bug and keeps its traceback.
"""

from __future__ import annotations


class LayerzooError(Exception):
    """Base class of every error layerzoo raises on purpose."""


class UserError(LayerzooError):
    """A mistake in the user's input: reported in one line, exit code 2, no traceback."""


class ConfigError(UserError):
    """config.json (or another config file) is missing a field or holds a wrong value."""


class CheckpointError(UserError):
    """A checkpoint cannot be read or does not match the model (names the file and the key)."""


class ModelNotFoundError(UserError):
    """The model is neither a local directory nor reachable on the hub."""


class ArchitectureNotSupported(UserError):
    """No installed plugin serves the checkpoint's architecture (names the package to install)."""


class PluginError(LayerzooError):
    """A plugin broke the plugin contract."""


class PluginConflict(PluginError, UserError):
    """Two plugins registered the same name (an architecture, a layer kind, a kernel backend)."""


class LayerStateNotRewindable(LayerzooError):
    """A rollback was asked for, but a layer keeps state that lowering the KV cursor cannot rewind."""

    def __init__(self, layer_index: int, layer_class: str, plugin: str | None):
        self.layer_index = layer_index
        self.layer_class = layer_class
        self.plugin = plugin
        super().__init__(
            f"layer {layer_index} ({layer_class}, answered by {plugin or 'unknown plugin'}) "
            "keeps per-sequence state that cannot be rewound"
        )


class WorkerDied(LayerzooError):
    """A tensor-parallel rank died or failed; the engine cannot go on (the message names the rank)."""


class SchedulerStalled(LayerzooError):
    """The engine made no progress for many steps with requests unfinished (the message names the
    stuck sequence and who holds the KV blocks it waits for): a bug, raised instead of a livelock."""


class KernelUnsupported(LayerzooError):
    """A kernel backend cannot serve this call (a shape, a dtype); the op falls back to torch."""
