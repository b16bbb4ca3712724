"""FP8 (e4m3) KV-cache scales: one fp32 scale for K and one for V per attention layer.

The scales come from the checkpoint when it carries them (``<attn>.k_scale`` / ``<attn>.v_scale``,
as vLLM and compressed-tensors checkpoints do), and otherwise from *online calibration* on the
first real requests:

* during a window of ``window_tokens`` tokens the layer writes K/V at a provisional scale (the
  first write's absmax with a 2x margin) and keeps ("stages") the full-precision K/V it wrote,
  while a running absmax of K and of V is tracked on the device;
* the write that reaches the window's end freezes ``scale = amax * headroom / 448`` and the
  staged entries are rewritten at the frozen scale (in write order, so a slot reused inside the
  window keeps its last token); after that the scale never changes.

Every scale is a 0-d fp32 tensor on the device that is only ever updated in place, and nothing
here reads a device value on the host: a graph captured after the freeze reads the same tensors.
The layer's ``fp8_calibration_frozen`` answer (None / False / True) is `Fp8KvScales.calibration_frozen`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
HEADROOM = 1.2  # frozen scale = amax * HEADROOM / 448: tokens after the window may exceed the window's amax
PROVISIONAL_MARGIN = 2.0  # the provisional scale leaves twice the first write's absmax before clamping
MIN_SCALE = 1e-12  # an all-zero window must not give a zero scale (0 / 0)
KV_SCALE_NAMES = ("k_scale", "v_scale")


def scale_for(amax: torch.Tensor, headroom: float) -> torch.Tensor:
    """``amax * headroom / 448``, floored at `MIN_SCALE` (a device tensor; no host read)."""
    return (amax * (headroom / FP8_MAX)).clamp_min(MIN_SCALE)


class Fp8KvCalibrator:
    """Online calibration of one attention layer's K and V scales over its first tokens.

    ``observe`` is called with every write during the window; it returns True for the write that
    ends it, after which the caller rewrites `drain`'s staged entries at the frozen scales.
    """

    def __init__(
        self,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
        window_tokens: int,
        *,
        headroom: float = HEADROOM,
        provisional_margin: float = PROVISIONAL_MARGIN,
    ):
        assert window_tokens > 0
        self.scales = (k_scale, v_scale)
        self.amax = tuple(torch.zeros((), dtype=torch.float32, device=k_scale.device) for _ in range(2))
        self.window_tokens = window_tokens
        self.headroom, self.provisional_margin = headroom, provisional_margin
        self.seen = 0  # tokens observed (a host count: the window end needs no device read)
        self.frozen = False
        self._staged: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def observe(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Track the absmax of a write of ``k, v [T, Hkv, D]`` to ``slots [T]`` and stage it.

        The first write sets the provisional scales. Returns True when this write ends the window:
        the scales are then frozen and `drain` holds every staged write to redo at them.
        """
        assert not self.frozen, "observe after the scales froze"
        if not k.shape[0]:
            return False
        for amax, x in zip(self.amax, (k, v)):
            torch.maximum(amax, x.detach().abs().amax().float(), out=amax)
        if not self.seen:
            for scale, amax in zip(self.scales, self.amax):
                scale.copy_(scale_for(amax, self.provisional_margin))
        self._staged.append((slots.clone(), k.detach().clone(), v.detach().clone()))
        self.seen += k.shape[0]
        if self.seen < self.window_tokens:
            return False
        for scale, amax in zip(self.scales, self.amax):
            scale.copy_(scale_for(amax, self.headroom))  # in place: the tensor stays the same object
        self.frozen = True
        return True

    def drain(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The staged ``(slots, k, v)`` writes in write order; the stage is emptied."""
        staged, self._staged = self._staged, []
        return staged


class Fp8KvScales:
    """One attention layer's FP8 KV scales: fixed (checkpoint, or 1.0) or online-calibrated.

    ``source`` is ``"calibration"``, ``"checkpoint"`` or ``"fixed"``.
    """

    def __init__(self, device, calibration_tokens: int, *, headroom: float = HEADROOM):
        self.k_scale = torch.ones((), dtype=torch.float32, device=device)
        self.v_scale = torch.ones((), dtype=torch.float32, device=device)
        self.calibrator: Fp8KvCalibrator | None = None
        self.source = "fixed"
        if calibration_tokens > 0:
            self.calibrator = Fp8KvCalibrator(self.k_scale, self.v_scale, calibration_tokens, headroom=headroom)
            self.source = "calibration"

    @property
    def calibration_frozen(self) -> bool | None:
        """The layer's ``fp8_calibration_frozen``: None without online calibration, else frozen or not."""
        return None if self.calibrator is None else self.calibrator.frozen

    @property
    def calibrating(self) -> bool:
        return self.calibrator is not None and not self.calibrator.frozen

    def use_checkpoint_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Take the checkpoint's scales (copied in place) instead of calibrating."""
        assert self.calibrator is None or not self.calibrator.seen, "scales replaced after KV was written"
        self.k_scale.copy_(k_scale.detach().float().reshape(()))
        self.v_scale.copy_(v_scale.detach().float().reshape(()))
        self.calibrator = None
        self.source = "checkpoint"


def kv_scale_name_map(
    model: torch.nn.Module,
    checkpoint,
    fp8_kv_cache: bool,
    name_map: Callable | None = None,
) -> Callable:
    """Prepare ``model`` for the FP8 KV scales ``checkpoint`` carries; the name map to load with.

    With an FP8 KV cache, every attention module (one with ``register_kv_scales``) whose
    ``<module>.k_scale`` and ``<module>.v_scale`` are both in the checkpoint gets buffers for them,
    which the strict loader then fills and the KV pool takes instead of calibrating. Scale keys the
    model has no buffer for (the cache is not FP8, or a layer lacks one of the two) are skipped, so
    a checkpoint with scales loads into a model that does not use them. Called between building
    the model and `layerzoo.loading.loader.load_weights`.
    """
    if fp8_kv_cache:
        for prefix, module in model.named_modules():
            if hasattr(module, "register_kv_scales") and all(f"{prefix}.{n}" in checkpoint for n in KV_SCALE_NAMES):
                module.register_kv_scales()
    names = set(model.state_dict(keep_vars=True))
    base = name_map or (lambda key: key)
    skipped: list[str] = []

    def mapped(key: str):
        target = base(key)
        name = getattr(target, "name", target)
        if isinstance(name, str) and name.rpartition(".")[2] in KV_SCALE_NAMES and name not in names:
            skipped.append(key)
            if len(skipped) == 1:
                log.info("checkpoint KV scale %s (and any like it) not loaded: the KV cache is not FP8 or its pair is missing", key)
            return None
        return target

    return mapped
