"""Helpers for tests of layerzoo and its plugins: tiny checkpoints that need no download.

Nothing here imports transformers; plugin test suites build their reference models with it and
use these helpers for the rest of a checkpoint directory.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from layerzoo.hookspecs import hookimpl


def write_word_tokenizer(model_dir: str | Path, vocab_size: int, eos_token_id: int | None = None) -> None:
    """A word-level ``tokenizer.json`` whose ids 0..vocab_size-1 are the words ``t0 t1 ...``.

    Every id a tiny random model can produce decodes, so generated ids round-trip as text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    model_dir = Path(model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if eos_token_id is not None:
        config["eos_token"] = f"t{eos_token_id}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def prefill_logits(model, token_ids, chunks, block_size: int = 16):
    """Logits ``[len(token_ids), vocab]`` for every position, prefilled in chunks of the given sizes.

    Runs the model over a paged KV pool the way the engine does (one sequence, blocks 0..n), so a
    plugin can compare all positions' logits with a reference model.
    """
    import torch

    from layerzoo.layers.context import ForwardContext
    from layerzoo.runtime.kv_pool import PagedKVCache
    from layerzoo.runtime.state_pool import SsmStep, StatePool

    assert sum(chunks) == len(token_ids)
    num_blocks = (len(token_ids) + block_size - 1) // block_size
    kv = PagedKVCache(model.kv_cache_specs(), num_blocks, block_size)
    specs = model.state_specs()
    pool = StatePool(specs, 1) if specs else None
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    hidden, done = [], 0
    with torch.inference_mode():
        for n in chunks:
            ctx = ForwardContext.for_paged(
                seq_ids=[0], query_lens=[n], context_lens=[done + n], block_tables=[list(range(num_blocks))],
                block_size=block_size, num_decodes=0, kv_cache=kv,
            )
            if pool is not None:  # recurrent layers keep the sequence's state in slot 0
                ctx.ssm = SsmStep(pool=pool, slots=(0,))
            hidden.append(model(ids[done : done + n], ctx))
            done += n
        return model.compute_logits(torch.cat(hidden))


@contextlib.contextmanager
def registered_plugin(plugin, name: str):
    """Register a plugin object (e.g. one answering a capability query) for the duration of a block.

    Capabilities are gathered when a model is loaded, so build the `LLM` inside the block.
    """
    from layerzoo.plugins.manager import get_registry

    registry = get_registry()
    registry.add_plugin(plugin, name=name)
    try:
        yield plugin
    finally:
        registry.remove_plugin(name)


def assert_close(name: str, ref, out, ratio: float = 1e-5) -> None:
    """Relative RMS error of ``out`` against ``ref`` below ``ratio``, and no NaN where ref has none
    (kernel tests: a NaN where the reference has a number is memory the kernel never wrote)."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    ref, out = ref.double().cpu(), out.double().cpu()
    assert not (out.isnan() & ~ref.isnan()).any(), f"{name}: NaN in the output (memory never written?)"
    err = (out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e}"


def nan_filled_empty(monkeypatch) -> None:
    """Make ``torch.empty`` / ``empty_like`` return NaN-filled tensors (through pytest's
    ``monkeypatch``), so that output a kernel never writes shows up."""
    import torch

    real_empty, real_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)


def generate_counting_ops(llm, prompts, params, *ops: str):
    """Run ``llm.generate(prompts, params)`` under the torch profiler: each request's token ids, then
    how many times each of ``ops`` (profiler event names, e.g. ``"layerzoo_cpu::kv_cache_write"``) ran."""
    from torch.profiler import profile

    with profile() as prof:
        tokens = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    names = [e.name for e in prof.events()]
    return (tokens, *(names.count(op) for op in ops))


def kernel_test_device():
    """Where a kernel test puts its tensors: ``$LAYERZOO_TEST_DEVICE`` (e.g. ``cuda``), else CPU."""
    import torch

    from layerzoo import settings

    return torch.device(settings.text("LAYERZOO_TEST_DEVICE"))


# -- speculative decoding ------------------------------------------------------------------------


class ScriptedProposer:
    """Drafts from known continuations: for a sequence that starts with one of ``expected``'s
    prompts it proposes the next tokens of that prompt's output. Every ``wrong_every``-th proposal
    has its last draft changed, so verifies accept all, some or none of their drafts; ``fixed``
    (when set) is proposed for every other sequence."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]] | None = None, wrong_every: int = 3,
                 fixed: list[int] | None = None, vocab_size: int = 100):
        self.expected = dict(expected or {})
        self.wrong_every = wrong_every
        self.fixed = list(fixed or [])
        self.vocab_size = vocab_size
        self.calls = 0

    def propose(self, token_ids, k):
        for prompt, out in self.expected.items():
            if len(token_ids) >= len(prompt) and tuple(token_ids[: len(prompt)]) == prompt:
                draft = list(out[len(token_ids) - len(prompt) :][:k])
                self.calls += 1
                if draft and self.wrong_every and self.calls % self.wrong_every == 0:
                    draft[-1] = (draft[-1] + 1) % self.vocab_size
                return draft
        return self.fixed[:k]

    def propose_batch(self, token_ids, k):
        return [self.propose(t, k) for t in token_ids]


class ProposerPlugin:
    """A plugin registering one proposer object under a method name (with `registered_plugin`)."""

    def __init__(self, method: str, proposer):
        self.method, self.proposer = method, proposer

    from layerzoo.hookspecs import hookimpl as _hookimpl

    @_hookimpl
    def register_proposers(self, register):
        register(self.method, lambda config: self.proposer)


# -- a layer that keeps its own per-sequence state -------------------------------------------------


class RunningSumState:
    """One sequence's state in a `running_sum_layer`: the sum of the hidden rows it has seen, and
    (during a pass) the sum after each row of the last chunk, for `keep_verified_rows`."""

    def __init__(self, seq_id: int, hidden_size: int):
        import torch

        self.seq_id = seq_id
        self.total = torch.zeros(hidden_size)
        self.count = 0
        self.rows: list[tuple] = []  # (total, count) after each row of the last chunk
        self.released = False


def running_sum_layer(base):
    """A subclass of the pre-norm decoder layer class ``base`` that keeps its own state (``uses_ssm_pool``
    False): after the base layer it adds ``tanh(mean of the inputs seen so far)`` to the output, so
    its output depends on every token of the sequence through a state no KV cursor rewinds. It
    keeps one state per draft row (``keeps_per_draft_states``), so rejected drafts can be dropped.
    """
    import torch

    class RunningSumLayer(base):
        gain = 0.5

        def alloc_state(self, seq_id):
            return RunningSumState(seq_id, self.input_layernorm.weight.numel())

        def release_state(self, state):
            state.released = True

        def keep_verified_rows(self, state, kept, run):
            assert len(state.rows) == run, (len(state.rows), run)
            state.total, state.count = state.rows[kept - 1]

        def forward(self, hidden, residual, ctx):
            hidden, residual = super().forward(hidden, residual, ctx)
            states = ctx.layer_states[self.layer_index]
            starts = ctx.query_start_tensor().tolist()
            extra = torch.empty_like(hidden)
            for b, state in enumerate(states):
                assert not state.released
                state.rows = []
                for r in range(starts[b], starts[b + 1]):
                    state.total = state.total + hidden[r].float().detach().cpu()
                    state.count += 1
                    state.rows.append((state.total, state.count))
                    extra[r] = torch.tanh(state.total / state.count).to(hidden)
            return hidden + self.gain * extra, residual

    RunningSumLayer.__name__ = RunningSumLayer.__qualname__ = f"RunningSum{base.__name__}"
    return RunningSumLayer


# -- test layers for the decode-graph capabilities ------------------------------------------------
#
# Each is a subclass of an architecture's decoder layer (``base``, whose ``__init__`` takes the model
# config first), served as an architecture of its own by `TestArchitecture`. They import torch only
# when built.


class TestArchitecture:
    """A plugin serving ``arch``: ``base_model`` with ``layer_class`` as every decoder layer.

    ``layer_class.layer_kind`` is registered as a new layer kind and ``answers`` (query -> value)
    are this plugin's answers for it, asked first. Register it with `registered_plugin` around
    building the `LLM`; a checkpoint of ``base_model`` loads as ``arch`` once its ``config.json``
    names it (`rename_architecture`).
    """

    __test__ = False  # not a pytest class

    def __init__(self, arch: str, base_model: type, layer_class: type, answers: dict[str, object]):
        self.arch, self.layer_class, self.answers = arch, layer_class, dict(answers)
        self.kind = layer_class.layer_kind
        self.model = type(arch, (base_model,), {"decoder_layer": layer_class})

    def _answer(self, query: str, layer_kind: str):
        return self.answers.get(query) if layer_kind == self.kind else None

    @hookimpl
    def register_architectures(self, register):
        register(self.arch, self.model)

    @hookimpl
    def register_layer_kinds(self, register):
        register(self.kind, self.layer_class, (self.layer_class.__doc__ or "").strip().splitlines()[0])

    @hookimpl(tryfirst=True)
    def decode_graph_unsupported(self, layer_kind):
        return self._answer("decode_graph_unsupported", layer_kind)

    @hookimpl(tryfirst=True)
    def graph_stale_on_new_sequence(self, layer_kind):
        return self._answer("graph_stale_on_new_sequence", layer_kind)

    @hookimpl(tryfirst=True)
    def uses_ssm_pool(self, layer_kind):
        return self._answer("uses_ssm_pool", layer_kind)


def rename_architecture(src: str | Path, dst: str | Path, arch: str) -> Path:
    """Copy the checkpoint directory ``src`` to ``dst`` with ``config.json`` naming ``arch``."""
    import shutil

    dst = Path(dst)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def host_read_layer(base: type, kind: str = "test.host_read") -> type:
    """``base`` whose decode reads a value on the host: what no captured decode step can hold.

    After decoding as ``base`` does, it checks on the host that its rows are finite (as the seed
    engine's host-side top-k read scores on the host). Honest answer: ``decode_graph_unsupported``
    True (the runner then decodes eagerly); answering False makes every capture fail, and the
    runner must fall back to eager decoding. Outputs are ``base``'s either way.
    """

    class HostReadLayer(base):
        """Decoder layer with a host-side check in its decode (test)."""

        layer_kind = kind

        def decode(self, hidden, residual, ctx):
            hidden, residual = super().decode(hidden, residual, ctx)
            if not bool(hidden.isfinite().all()):  # a device -> host read
                raise FloatingPointError(f"layer {self.layer_index}: non-finite decode output")
            return hidden, residual

    return HostReadLayer


class SequenceBuffer:
    """The per-sequence buffer of a `sequence_buffer_layer`: ``memory [hidden]`` fp32."""

    def __init__(self, seq_id: int, memory):
        self.seq_id, self.memory, self.released = seq_id, memory, False


def sequence_buffer_layer(base: type, kind: str = "test.sequence_buffer", decay: float = 0.5) -> type:
    """``base`` with a per-sequence buffer outside the state pool that its output depends on.

    An own-state layer (answer ``uses_ssm_pool`` False): ``alloc_state`` gives every new sequence
    a fresh buffer ``memory [hidden]``, an exponential average (``decay``) of the hidden states the
    layer has seen for that sequence, which is added to each row before ``base`` runs. A captured
    decode step bakes in the buffers of the sequences it was captured with, so its graph goes stale
    when a new sequence takes one of their slots: the honest answer is
    ``graph_stale_on_new_sequence`` True. Answering False leaves the new sequence decoding through
    the old sequence's buffer (released, zeroed): its outputs go wrong.
    """
    import torch

    class SequenceBufferLayer(base):
        """Decoder layer adding a per-sequence running average kept outside the state pool (test)."""

        layer_kind = kind

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.buffer_size = config.hidden_size

        def alloc_state(self, seq_id):
            device = next(self.parameters()).device
            return SequenceBuffer(seq_id, torch.zeros(self.buffer_size, dtype=torch.float32, device=device))

        def release_state(self, state):
            with torch.inference_mode():  # made during a step (inference mode), released after it
                state.memory.zero_()
            state.released = True

        def _mix(self, hidden, ctx):
            """Each row plus its sequence's buffer; the buffer then takes the row in."""
            states = ctx.layer_states[self.layer_index]
            if ctx.num_decodes == ctx.num_seqs:  # one row per sequence: no host read (graph-safe)
                rows = range(ctx.num_seqs)
                owners = states
            else:
                starts = ctx.query_start_tensor().tolist()
                rows = range(starts[-1])
                owners = [states[b] for b in range(ctx.num_seqs) for _ in range(starts[b], starts[b + 1])]
            out = []
            for row, state in zip(rows, owners):
                out.append(hidden[row] + state.memory.to(hidden.dtype))
                state.memory.mul_(decay).add_(hidden[row].float(), alpha=1 - decay)
            return torch.stack(out)

        def prefill(self, hidden, residual, ctx):
            return super().prefill(self._mix(hidden, ctx), residual, ctx)

        def decode(self, hidden, residual, ctx):
            return super().decode(self._mix(hidden, ctx), residual, ctx)

    return SequenceBufferLayer


# -- layers that answer a capability query falsely, for the conformance kit's tests ----------------


def decode_mixing_layer(base):
    """A subclass of the pre-norm decoder layer class ``base`` whose one-token decode rows depend on
    each other: after the base layer, each decode row gets ``tanh(mean of the pass's decode rows)``
    added. Decoded one sequence at a time it is a fine per-sequence layer; batched, sequences leak
    into each other, so its honest ``decode_multi_seq_unsupported`` answer is True."""
    import torch

    class DecodeMixingLayer(base):
        gain = 0.5

        def forward(self, hidden, residual, ctx):
            hidden, residual = super().forward(hidden, residual, ctx)
            n = ctx.num_decodes
            if n == 0:
                return hidden, residual
            mixed = torch.tanh(hidden[:n].float().mean(dim=0)).to(hidden)
            out = hidden.clone()
            out[:n] = hidden[:n] + self.gain * mixed
            return out, residual

    DecodeMixingLayer.__name__ = DecodeMixingLayer.__qualname__ = f"DecodeMixing{base.__name__}"
    return DecodeMixingLayer


def forgetful_running_sum_layer(base):
    """A `running_sum_layer` whose ``keep_verified_rows`` does nothing: rejected drafts stay in its
    state, so its honest ``keeps_per_draft_states`` answer is False."""

    class ForgetfulRunningSumLayer(running_sum_layer(base)):
        gain = 4.0  # the state weighs enough that a few stray rows change the greedy tokens

        def keep_verified_rows(self, state, kept, run):
            pass

    ForgetfulRunningSumLayer.__name__ = ForgetfulRunningSumLayer.__qualname__ = f"ForgetfulRunningSum{base.__name__}"
    return ForgetfulRunningSumLayer


def token_counter_layer(base):
    """A subclass of the pre-norm decoder layer class ``base`` with a per-sequence counter of the
    rows it has seen, kept in the layer (keyed by sequence id) where no engine mechanism reaches:
    after the base layer each row gets ``sin(0.7 * count)`` added. Without rewinds the count is the
    row's position; a rollback lowers the KV cursor but not the counter, so its honest
    ``decode_rollback_unsupported`` answer is True."""
    import torch

    class TokenCounterLayer(base):
        gain = 0.5

        def forward(self, hidden, residual, ctx):
            hidden, residual = super().forward(hidden, residual, ctx)
            counts = self.__dict__.setdefault("_counts", {})
            starts = ctx.query_start_tensor().tolist()
            positions = []
            for b, seq_id in enumerate(ctx.seq_ids):
                n = starts[b + 1] - starts[b]
                first = counts.get(seq_id, 0)
                positions.extend(range(first, first + n))
                counts[seq_id] = first + n
            bump = torch.sin(0.7 * torch.tensor(positions, dtype=torch.float32, device=hidden.device))
            return hidden + self.gain * bump[:, None].to(hidden), residual

    TokenCounterLayer.__name__ = TokenCounterLayer.__qualname__ = f"TokenCounter{base.__name__}"
    return TokenCounterLayer


def verify_mixing_layer(base, max_verify_rows: int = 4):
    """A subclass of the pre-norm decoder layer class ``base`` whose speculative-verify rows depend
    on the other sequences verifying in the same pass, as a batched verify kernel with a wrong
    offset would: each verify row gets ``tanh(mean of the pass's verify rows)`` added. A verify
    chunk is recognised as several rows (at most ``max_verify_rows``) continuing a sequence. One
    sequence at a time it is a fine layer, so its honest ``decode_verify_multi_unsupported`` is True."""
    import torch

    class VerifyMixingLayer(base):
        gain = 0.5

        def forward(self, hidden, residual, ctx):
            hidden, residual = super().forward(hidden, residual, ctx)
            starts = ctx.query_start_tensor().tolist()
            verifying = [
                b for b, (q, c) in enumerate(zip(ctx.query_lens, ctx.context_lens)) if 1 < q <= max_verify_rows and c > q
            ]
            if len(verifying) < 2:  # one verifying sequence at most: nothing to mix
                return hidden, residual
            rows = [r for b in verifying for r in range(starts[b], starts[b + 1])]
            index = torch.tensor(rows, device=hidden.device)
            mixed = torch.tanh(hidden[index].float().mean(dim=0)).to(hidden)
            out = hidden.clone()
            out[index] = hidden[index] + self.gain * mixed
            return out, residual

    VerifyMixingLayer.__name__ = VerifyMixingLayer.__qualname__ = f"VerifyMixing{base.__name__}"
    return VerifyMixingLayer


def tail_capture_only_layer(base):
    """A subclass of the pool-state layer class ``base`` that honours a state capture only at the
    end of a chunk, dropping those inside it (a kernel that writes the state back once per chunk).
    The engine's two-pass split puts every capture at a chunk's end, so its honest
    ``supports_replay_tail_split`` answer is False."""
    import attrs

    class TailCaptureOnlyLayer(base):
        def forward(self, hidden, residual, ctx):
            ssm = ctx.ssm
            if ssm is None or not ssm.captures:
                return super().forward(hidden, residual, ctx)
            ends = tuple(
                tuple((row, slot) for row, slot in caps if row == q) for caps, q in zip(ssm.captures, ctx.query_lens)
            )
            ctx.ssm = attrs.evolve(ssm, captures=ends)
            try:
                return super().forward(hidden, residual, ctx)
            finally:
                ctx.ssm = ssm

    TailCaptureOnlyLayer.__name__ = TailCaptureOnlyLayer.__qualname__ = f"TailCaptureOnly{base.__name__}"
    return TailCaptureOnlyLayer
