"""Every hook layerzoo calls, in one place, grouped by purpose.

Plugins implement these with ``@layerzoo.hookimpl``. Hooks are always called with keyword
arguments, and an implementation may accept any subset of a spec's arguments, so a spec can gain
arguments without breaking plugins; arguments are never renamed or removed.

Two groups:

* Registration hooks hand the plugin a ``register(...)`` callback. The core owns the registries,
  de-duplication and conflict policy (see ``layerzoo.plugins.manager``).
* Capability queries ask one question about one decoder layer. They are ``firstresult``: the first
  plugin returning something other than ``None`` answers; the core's defaults
  (``layerzoo.plugins.defaults``, registered ``trylast``) answer when no plugin has an opinion. They are
  gathered once per layer when a model is built (``layerzoo.plugins.capabilities``).

Every capability query receives:

:param layer_kind: the registered kind of the layer (``"qwen3.decoder"``); always given.
:param layer: the layer instance, or ``None`` when the question is about a layer kind in its
    default configuration (``layerzoo plugins`` lists kinds without building a model).
:param engine_config: the engine's settings (``layerzoo.engine_args.EngineArgs``), or ``None``.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("layerzoo")
hookimpl = pluggy.HookimplMarker("layerzoo")


# ---------------------------------------------------------------------------------------------
# Registration: what a plugin adds to the engine.
# ---------------------------------------------------------------------------------------------


@hookspec
def register_architectures(register):
    """Add model architectures, keyed by the HF ``config.json`` ``architectures`` name.

    Called once when the plugin manager loads plugins.

    :param register: ``register(name, builder)`` where ``builder`` is a lazy ``"module:Class"``
        string naming a ``layerzoo.layers.model.CausalLM`` subclass; nothing is imported until a
        checkpoint of that architecture is loaded. Registering the same pair twice is a no-op;
        two plugins registering one name is a conflict the core reports naming both.
    """


@hookspec
def register_layer_kinds(register):
    """Add layer kinds: the decoder-layer types whose capabilities the engine asks about.

    Called once when the plugin manager loads plugins; ``layerzoo plugins`` lists each kind with
    its capability answers.

    :param register: ``register(name, layer_class, description="")``; ``name`` is dotted by
        owner (``"qwen3.decoder"``), ``layer_class`` a lazy ``"module:Class"`` string.
    """


@hookspec
def register_kernels(register):
    """Add implementations of kernel ops for a backend.

    Called once when the plugin manager loads plugins.

    :param register: ``register(op, backend, fn)``; ``op`` names the operation
        (``"rms_norm"``), ``backend`` is ``"torch"`` or ``"triton"`` (or another backend name),
        ``fn`` a callable or a lazy ``"module:function"`` string.
    """


@hookspec
def register_weight_mappings(register):
    """Add checkpoint-name mappings, keyed by architecture.

    Called once when the plugin manager loads plugins. The mapping is used by the strict loader to
    place each checkpoint tensor (renames, stacked experts, keys deliberately skipped).

    :param register: ``register(architecture, mapping)``; ``mapping`` is a lazy
        ``"module:function"`` string naming ``function(config) -> name_map`` where
        ``name_map(key) -> str | layerzoo.loading.loader.Target | None``.
    """


@hookspec
def register_proposers(register):
    """Add speculative-decoding proposers, keyed by the ``speculative_config`` ``method`` name.

    Called once when the plugin manager loads plugins; the core registers ``"ngram"``
    (``layerzoo.speculative``).

    :param register: ``register(method, factory)`` where ``factory`` is a callable or a lazy
        ``"module:attr"`` string naming ``factory(config) -> proposer``: ``config`` a
        ``layerzoo.speculative.SpeculativeConfig``, the proposer a ``layerzoo.speculative.Proposer``.
        Nothing is imported until a proposer of that method is built. Registering the same pair
        twice is a no-op; two plugins registering one method is a conflict the core reports naming
        both.
    """


@hookspec
def register_chat_formats(register):
    """Say how the models of an architecture write tool calls and reasoning into their text.

    Called once when the plugin manager loads plugins. The server and ``LLM.chat`` parse a chat
    completion with the format of the model's architecture (``tool_calls``, ``reasoning_content``)
    and constrain ``tool_choice`` ``"required"`` / named with its grammar; an architecture without
    one serves chat without tools.

    :param register: ``register(architecture, chat_format)``: ``chat_format`` a
        ``layerzoo.tokenization.chat_formats.ChatFormat`` (instance or subclass), the name of a built-in one
        (``"hermes"``, ``"glm"``, ``"kimi"``, ``"llama3_json"``), or a lazy ``"module:attr"``
        string naming either. Two plugins registering one architecture is a conflict the core
        reports naming both.
    """


@hookspec
def register_test_configs(register):
    """Add tiny test checkpoints, keyed by architecture, for the conformance kit.

    Called by ``layerzoo.testing.conformance`` (``layerzoo check-plugin``, ``pytest
    --layerzoo-conformance``), never by the engine. Each architecture a plugin registers should have
    one, so that the kit can check every capability answer its layers give on real outputs.

    :param register: ``register(architecture, config, writer)``: ``config`` a small HF
        ``config.json`` dict (``architectures`` may be left out); ``writer`` a callable or a lazy
        ``"module:function"`` string naming ``writer(path, config) -> None``, which writes a random
        checkpoint for ``config`` into the folder ``path`` (``config.json``, safetensors weights and
        a tokenizer, e.g. `layerzoo.testing.write_word_tokenizer`). It may import test-only
        dependencies (transformers): nothing is imported until the kit runs.
    """


# ---------------------------------------------------------------------------------------------
# Capability queries: one question about one decoder layer. Stops at the first non-None result.
# Defaults live in layerzoo.plugins.defaults and keep every existing route unchanged.
# ---------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def uses_local_mla_prefill(layer_kind, layer, engine_config):
    """Does this layer's prefill attend only over the tokens it is handed?

    True for an MLA prefill that expands only the current chunk's latents. The model then turns
    off prefix-cache matching (a skipped prefix would vanish from attention) and chunked prefill,
    unless ``LAYERZOO_MLA_PREFIX_SKIP=1`` accepts the approximation for prefix matching.

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def fp8_calibration_frozen(layer_kind, layer, engine_config):
    """Has this layer's online FP8 KV-cache calibration frozen its scale?

    Tri-state: ``None`` means the layer runs no online calibration (the default, and also what a
    plugin returns for layers it does not know); ``False`` means still calibrating; ``True`` means
    frozen. Decode graphs stay suppressed while any layer answers ``False``. Polled again at run
    time, since it changes as requests arrive.
    """


@hookspec(firstresult=True)
def decode_graph_unsupported(layer_kind, layer, engine_config):
    """Must this layer's decode run outside a captured (CUDA) graph?

    True for, e.g., a host-side top-k. ORed over layers into the model's decode-graph veto.

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def decode_multi_seq_unsupported(layer_kind, layer, engine_config):
    """Can this layer not decode several sequences in one batched step?

    When any layer says True, batched decode runs each sequence on its own, and a fused
    decode+prefill step runs decode and prefill as separate passes.

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def decode_rollback_unsupported(layer_kind, layer, engine_config):
    """Does this layer keep per-sequence state that lowering the KV cursor does not rewind?

    Recurrent state without boundary snapshots, a monotonic counter, an n-gram history. When any
    layer says True, the scheduler's ``rollback_to_boundary`` declines with
    ``LayerStateNotRewindable`` naming the layer. (Dropping rejected speculative drafts is a
    different mechanism and is not gated by this.)

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def decode_verify_multi_unsupported(layer_kind, layer, engine_config):
    """Can this layer not verify speculative tokens for several sequences in one step?

    When any layer says True, batched verify is refused and verify runs per sequence. Independent
    of ``decode_multi_seq_unsupported``: the two answers can differ.

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def graph_stale_on_new_sequence(layer_kind, layer, engine_config):
    """Does a captured decode graph for a slot go stale when a new sequence takes the slot?

    True for a layer that owns per-sequence buffers outside the slot-addressed state pool. Freeing
    a sequence then drops the captured graphs of its slot (slots past the pool's ``max_slots``
    excepted).

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def is_ssm_layer(layer_kind, layer, engine_config):
    """Does this layer prefill in the three phases of a gated-delta-rule layer?

    True selects split prefill: the layer's ``prefill_phase1`` (projections + short conv; returns
    a `layerzoo.layers.recurrent_pool.Recurrence` and what phase 3 needs), the core's recurrence
    of every prompt sequence of the step in one varlen call, the layer's ``prefill_phase3``
    (gated norm + output projection) instead of ``prefill`` (which runs the sequences' recurrences
    one at a time; see `layerzoo.layers.split_prefill`). It does not mean "has recurrent state": a
    Mamba2 mixer that prefills in one call answers False.

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def uses_ssm_pool(layer_kind, layer, engine_config):
    """Does this layer's recurrent state live in the shared slot-addressed state pool?

    When False, sequence setup calls the layer's ``alloc_state`` for a state object of its own
    type and never hands it pool addresses. Only read for layers that keep recurrent state.

    Default: ``True``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def supports_replay_tail_split(layer_kind, layer, engine_config):
    """Does this layer's prefill honour a replay-tail capture?

    True when rows from ``cap_local`` on come out exactly as a prefill starting at ``cap_local``
    would make them, and the layer's state at ``cap_local`` is copied into the capture slot. The
    model plans an in-pass capture only when every layer says True; otherwise it keeps the
    two-pass split.

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """


@hookspec(firstresult=True)
def keeps_per_draft_states(layer_kind, layer, engine_config):
    """Can this own-state layer keep one state per draft position during a speculative verify?

    Asked only about layers answering ``uses_ssm_pool`` False (attention drops rejected drafts by
    lowering the KV cursor; pool layers keep per-draft states in the pool). True promises
    ``keep_verified_rows(state, kept, run)``: after a verify of ``run`` rows, the state is as if
    only the first ``kept`` had been fed. When an own-state layer says False, an engine started
    with speculative decoding refuses to start, naming the layer (or, with
    ``speculative_fallback=True``, runs without speculation and logs why).

    Default: ``False``. :returns: bool, or ``None`` for no opinion.
    """
