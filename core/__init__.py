"""layerzoo: an LLM inference engine built as a model zoo of plugins.

Importing this package stays cheap (no torch) so that plugins can import `hookimpl` at
discovery time; `LLM` and `SamplingParams` are loaded on first use.
"""

from __future__ import annotations

from layerzoo.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "hookimpl", "hookspec", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from layerzoo.llm import LLM

        return LLM
    if name == "SamplingParams":
        from layerzoo.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'layerzoo' has no attribute {name!r}")
