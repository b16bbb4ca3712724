"""Decode-graph bookkeeping with fake capture/replay, on "cpu" and on a "cuda" device flag that
never touches CUDA: the same rules hold on both.

The fake capture records ``(bucket, slots)``; the fake replay returns one row per bucket row (the
row's slot), so a padded row leaking out would show up as `PAD_ID` in the output. Graphs are
keyed by slots only when a layer answers ``graph_stale_on_new_sequence`` (`STALE`).
"""

from __future__ import annotations

import pytest
import torch

from layerzoo.plugins.capabilities import LayerCapabilities, ModelCapabilities
from layerzoo.runtime.graphs import (
    PAD_ID,
    DecodeGraphRunner,
    GraphConfig,
    cuda_capture_fn,
    cuda_replay_fn,
    new_graph_pool,
)


def run_decode(runner, slots, eager):
    """What the model runner does with a pure decode pass: the replayed rows, else ``eager()``."""
    out = runner.replay(slots)
    return eager() if out is None else out


def caps(*layers: dict) -> ModelCapabilities:
    return ModelCapabilities.from_layers(
        [LayerCapabilities.of(i, f"Layer{i}", "toy.decoder", "toy", **answers) for i, answers in enumerate(layers)],
        env={},
    )


class Fakes:
    def __init__(self):
        self.captured: list[tuple[int, tuple[int, ...]]] = []
        self.replayed: list[tuple[tuple, int]] = []

    def capture(self, bucket, slots):
        assert len(slots) in (0, bucket)  # keyed by slots (padded to the bucket) or by bucket alone
        self.captured.append((bucket, slots))
        return ("graph", bucket, slots)

    def replay(self, handle, live_rows):
        self.replayed.append((handle, live_rows))
        # every bucket row, padded ones included: its slot, or (unkeyed by slots) its row index
        return list(handle[2]) or [f"row {i}" for i in range(handle[1])]


def runner(capabilities=None, *, device="cuda", fakes=None, **kw) -> DecodeGraphRunner:
    fakes = fakes or Fakes()
    kw.setdefault("config", GraphConfig())
    return DecodeGraphRunner(
        capabilities if capabilities is not None else caps({}, {}),
        device=device, capture_fn=fakes.capture, replay_fn=fakes.replay, **kw,
    )


def eager():
    return "eager"


STALE = {"graph_stale_on_new_sequence": True}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_device_captures_through_the_same_rules(device):
    fakes = Fakes()
    r = runner(caps({}), device=device, fakes=fakes)
    assert r.can_use_graphs() == (True, None)
    assert run_decode(r, [0, 1, 2], eager) == ["row 0", "row 1", "row 2"] and fakes.captured == [(4, ())]
    vetoed = runner(caps({}, {"decode_graph_unsupported": True}), device=device)
    assert not vetoed.can_use_graphs()[0] and run_decode(vetoed, [0], eager) == "eager"
    calibrating = runner(caps({}), device=device, poll_fp8=lambda: [False])
    assert calibrating.can_use_graphs() == (False, "fp8 calibration not frozen (layer 0)")


def test_off_reason_is_reported():
    r = DecodeGraphRunner(caps({}), GraphConfig(enabled=False, off_reason="decode compile off on cpu"), device="cpu")
    assert run_decode(r, [0], eager) == "eager" and r.eager_reasons == {"decode compile off on cpu": 1}


def test_user_switch_off():
    r = runner(config=GraphConfig(enabled=False))
    assert r.can_use_graphs() == (False, "graphs disabled by config")
    assert run_decode(r, [0], eager) == "eager"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_enabled_graphs_need_capture_and_replay_functions(device):
    with pytest.raises(ValueError, match="capture_fn"):
        DecodeGraphRunner(caps({}), GraphConfig(), device=device)
    DecodeGraphRunner(caps({}), GraphConfig(enabled=False), device=device)  # eager by choice: fine


def test_veto_names_the_layer_and_stays_eager():
    fakes = Fakes()
    r = runner(caps({}, {}, {"decode_graph_unsupported": True}), fakes=fakes)
    allowed, reason = r.can_use_graphs()
    assert not allowed and "layer 2 (Layer2)" in reason and "decode_graph_unsupported" in reason
    for _ in range(3):
        assert run_decode(r, [0, 1], eager) == "eager"
    assert fakes.captured == [] and r.eager_reasons == {reason: 3}


def test_fp8_gate_is_polled_every_call():
    states = [None, False]
    fakes = Fakes()
    r = runner(caps({}, {"fp8_calibration_frozen": False}), fakes=fakes, poll_fp8=lambda: states)
    assert run_decode(r, [0], eager) == "eager"
    assert r.eager_reasons == {"fp8 calibration not frozen (layer 1)": 1}
    states[1] = True  # the scale froze at run time
    assert run_decode(r, [0], eager) == ["row 0"]
    assert run_decode(r, [0], eager) == ["row 0"]
    assert r.stats == {"captures": 1, "replays": 2, "eager": 1, "dropped": 0}


def test_fp8_gate_never_blocks_a_model_that_does_not_calibrate():
    assert runner(poll_fp8=lambda: [None, None]).can_use_graphs() == (True, None)
    assert runner(poll_fp8=lambda: []).can_use_graphs() == (True, None)


def test_without_a_poller_the_build_time_answers_stand():
    assert not runner(caps({"fp8_calibration_frozen": False})).can_use_graphs()[0]
    assert runner(caps({"fp8_calibration_frozen": True}, {})).can_use_graphs() == (True, None)


def test_buckets():
    r = runner(config=GraphConfig(batch_buckets=(8, 1, 2, 4)))
    assert r.config.batch_buckets == (1, 2, 4, 8)
    assert [r.bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    with pytest.raises(ValueError):
        GraphConfig(batch_buckets=())


def test_padding_uses_the_pad_slot_and_never_returns_padded_rows():
    fakes = Fakes()
    r = runner(caps(STALE), fakes=fakes)
    assert run_decode(r, [5, 2, 7], eager) == [5, 2, 7]
    assert fakes.captured == [(4, (5, 2, 7, PAD_ID))]
    assert fakes.replayed[-1][1] == 3  # replay is told the live batch


def test_one_graph_per_bucket_when_graphs_hold_nothing_of_their_sequences():
    fakes = Fakes()
    r = runner(caps({}, {}), fakes=fakes)
    for slots in ([0, 1], [1, 0], [2, 3], [0, 1, 2], [3], [4]):
        run_decode(r, slots, eager)
    assert fakes.captured == [(2, ()), (4, ()), (1, ())]
    assert r.stats == {"captures": 3, "replays": 6, "eager": 0, "dropped": 0}
    assert fakes.replayed[3] == (("graph", 4, ()), 3)  # the replay is told the live batch


def test_batch_above_the_largest_bucket_runs_eagerly():
    fakes = Fakes()
    r = runner(fakes=fakes, config=GraphConfig(batch_buckets=(1, 2)))
    assert run_decode(r, [0, 1, 2], eager) == "eager"
    assert fakes.captured == [] and r.eager_reasons == {"batch above the largest graph bucket (2)": 1}


def test_capture_once_per_key_then_replay():
    fakes = Fakes()
    r = runner(caps(STALE, {}), fakes=fakes)
    for _ in range(3):
        run_decode(r, [0, 1], eager)
    run_decode(r, [1, 0], eager)  # row order is part of the key
    run_decode(r, [0, 1, 2], eager)
    assert fakes.captured == [(2, (0, 1)), (2, (1, 0)), (4, (0, 1, 2, PAD_ID))]
    assert r.stats == {"captures": 3, "replays": 5, "eager": 0, "dropped": 0}


def test_free_drops_only_graphs_holding_the_slot():
    r = runner(caps({}, {"graph_stale_on_new_sequence": True}))
    for slots in ([0], [1], [0, 1], [2, 3], [1, 2, 3]):
        run_decode(r, slots, eager)
    r.free_sequence(1)
    assert set(r.graphs) == {(1, (0,)), (2, (2, 3))}
    assert r.stats["dropped"] == 3
    r.free_sequence(5)  # no graph holds it
    assert r.stats["dropped"] == 3 and len(r.graphs) == 2


def test_free_keeps_everything_when_graphs_do_not_go_stale():
    r = runner(caps({}, {}))
    run_decode(r, [0, 1], eager)
    r.free_sequence(0)
    assert len(r.graphs) == 1 and r.stats["dropped"] == 0


def test_a_freed_slot_recaptures_on_next_use():
    fakes = Fakes()
    r = runner(caps({"graph_stale_on_new_sequence": True}), fakes=fakes)
    run_decode(r, [0], eager)
    r.free_sequence(0)
    run_decode(r, [0], eager)
    assert fakes.captured == [(1, (0,)), (1, (0,))] and r.stats["captures"] == 2


def test_warmup_captures_largest_bucket_first():
    fakes = Fakes()
    r = runner(caps(STALE), fakes=fakes)
    assert r.warmup([[0], [0, 1, 2], [0, 1], [0, 1]]) == 3
    assert [b for b, _ in fakes.captured] == [4, 2, 1]
    assert runner(config=GraphConfig(enabled=False)).warmup([[0]]) == 0


def test_a_failed_capture_falls_back_to_eager_for_good(caplog):
    calls = []

    def capture(bucket, slots):
        calls.append(bucket)
        raise RuntimeError("cannot capture this step\nsecond line")

    r = DecodeGraphRunner(caps({}), GraphConfig(), device="cpu", capture_fn=capture, replay_fn=lambda h, n: h)
    with caplog.at_level("WARNING", logger="layerzoo.runtime.graphs"):
        assert run_decode(r, [0], eager) == "eager"
        assert run_decode(r, [0, 1], eager) == "eager"
    reason = "decode graph capture failed (RuntimeError: cannot capture this step)"
    assert calls == [1] and r.can_use_graphs() == (False, reason)
    assert r.eager_reasons == {reason: 2} and r.graphs == {}
    assert [rec.getMessage() for rec in caplog.records] == [f"{reason}; decoding eagerly from now on"]


def test_padding_slot_is_not_a_sequence():
    r = runner(caps({"graph_stale_on_new_sequence": True}))
    with pytest.raises(AssertionError):
        run_decode(r, [PAD_ID], eager)
    with pytest.raises(AssertionError):
        r.free_sequence(PAD_ID)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_capture_and_replay():
    pool = new_graph_pool()
    x = torch.zeros(4, 3, device="cuda")
    w = torch.arange(3.0, device="cuda")

    def capture(bucket, slots):
        return cuda_capture_fn(lambda: x[:bucket] * 2 + w, pool=pool)

    live = {}

    def replay(handle, rows):  # the owner stages the static buffer, as DecodeCapture does
        x[:rows].copy_(live["x"])
        x[rows:].zero_()
        return cuda_replay_fn(handle, rows)

    r = DecodeGraphRunner(caps({}), GraphConfig(batch_buckets=(1, 4)), device="cuda", capture_fn=capture, replay_fn=replay)
    for scale in (1.0, 5.0):
        live["x"] = torch.full((3, 3), scale, device="cuda")
        out = run_decode(r, [0, 1, 2], lambda: None)
        assert out.shape == (3, 3)
        torch.testing.assert_close(out, live["x"] * 2 + w)
    assert r.stats["captures"] == 1 and r.stats["replays"] == 2


def test_a_stale_replay_keeps_its_output_and_stops_graphs(caplog):
    from layerzoo.runtime.graphs import StaleReplay

    def replay(handle, live_rows):
        raise StaleReplay("step recompiled", ["row 0", "pad"])

    fakes = Fakes()
    r = DecodeGraphRunner(caps({}), GraphConfig(), device="cpu", capture_fn=fakes.capture, replay_fn=replay)
    with caplog.at_level("WARNING", logger="layerzoo.runtime.graphs"):
        assert run_decode(r, [0], eager) == ["row 0"]  # the replay's output, live rows only
        assert run_decode(r, [0], eager) == "eager"
    assert r.can_use_graphs() == (False, "step recompiled") and r.graphs == {}
    assert r.stats["replays"] == 1 and r.eager_reasons == {"step recompiled": 1}
    assert [rec.getMessage() for rec in caplog.records] == ["step recompiled; decoding eagerly from now on"]


def test_a_replay_that_fails_to_capture_more_runs_the_step_eagerly():
    """A replay may need one more capture (a wider block table): if that fails, nothing live ran,
    so the step runs eagerly and graphs stop."""
    from layerzoo.runtime.graphs import CaptureFailed

    def replay(handle, live_rows):
        try:
            raise ValueError("width 8 does not compile")
        except ValueError as exc:
            raise CaptureFailed(str(exc)) from exc

    fakes = Fakes()
    r = DecodeGraphRunner(caps({}), GraphConfig(), device="cpu", capture_fn=fakes.capture, replay_fn=replay)
    assert run_decode(r, [0], eager) == "eager"
    reason = "decode graph capture failed (ValueError: width 8 does not compile)"
    assert r.can_use_graphs() == (False, reason) and r.eager_reasons == {reason: 1}
    assert r.stats["replays"] == 0 and r.stats["eager"] == 1


def test_a_capture_failure_is_reported_by_its_original_error():
    from layerzoo.runtime.graphs import CaptureFailed

    def capture(bucket, slots):  # a capture function that wraps its own failure already
        try:
            raise TypeError("data-dependent size")
        except TypeError as exc:
            raise CaptureFailed(str(exc)) from exc

    r = DecodeGraphRunner(caps({}), GraphConfig(), device="cpu", capture_fn=capture, replay_fn=lambda h, n: h)
    assert run_decode(r, [0], eager) == "eager"
    assert r.abandoned == "decode graph capture failed (TypeError: data-dependent size)"
