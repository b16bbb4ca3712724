"""Progress bars (tqdm) for work a user waits on: ``LLM.generate`` and weight loading.

Shown on a terminal by default and hidden otherwise (logs, CI), as vLLM does; ``LAYERZOO_PROGRESS``
set to ``1`` or ``0`` forces them on or off. Weight loading shows its bar only once loading has
taken more than `LOAD_BAR_DELAY_S`, so small models load silently.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

from tqdm import tqdm

from layerzoo import settings
from layerzoo.errors import UserError

ENV = "LAYERZOO_PROGRESS"
LOAD_BAR_DELAY_S = 1.0


def bars_enabled(requested: bool | None = None) -> bool:
    """Whether to draw: the caller's choice, else ``$LAYERZOO_PROGRESS``, else whether stderr is a terminal."""
    if requested is not None:
        if not isinstance(requested, bool):
            raise UserError(f"use_tqdm: expected True, False or None, got {requested!r}")
        return requested
    forced = settings.flag(ENV)
    return sys.stderr.isatty() if forced is None else forced


def weight_loading_bar(items: list, nbytes: list[int]) -> Iterator:
    """Yield ``items`` (tensors to copy), advancing a bytes bar that appears after a moment."""
    bar = tqdm(total=sum(nbytes), desc="Loading weights", unit="B", unit_scale=True, delay=LOAD_BAR_DELAY_S,
               disable=not bars_enabled(), leave=False, file=sys.stderr)
    with bar:
        for item, size in zip(items, nbytes):
            yield item
            bar.update(size)


class GenerateBar:
    """``Processed prompts`` with input and output tokens/s, as vLLM's ``use_tqdm`` bar shows them."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True,
                        disable=not enabled, file=sys.stderr)
        self.began = time.perf_counter()
        self.input_tokens = self.output_tokens = 0

    def finished(self, prompt_tokens: int, output_tokens: int) -> None:
        """One request finished with this many prompt and generated tokens."""
        self.input_tokens += prompt_tokens
        self.output_tokens += output_tokens
        elapsed = max(time.perf_counter() - self.began, 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, output: {self.output_tokens / elapsed:.2f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
