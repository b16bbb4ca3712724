"""Speculative decoding's building blocks: the config, the proposers and the acceptance rules.

``SpeculativeConfig`` (the user's ``speculative_config``), ``Proposer`` / ``NgramProposer`` and
``build_proposer`` (a proposer by method name, from the plugins' ``register_proposers``) import
without torch; ``greedy_accept``, ``rejection_sample`` and ``rejection_sample_batch``
(``layerzoo.speculative.acceptance``) load torch on first use.

This module is a built-in plugin (like ``layerzoo.kernels``): it registers the core's proposers
as lazy ``"module:attr"`` strings.
"""

from __future__ import annotations

from layerzoo.hookspecs import hookimpl
from layerzoo.speculative.config import SpeculativeConfig
from layerzoo.speculative.proposers import NgramProposer, Proposer, build_proposer

__all__ = [
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "build_proposer",
    "greedy_accept",
    "rejection_sample",
    "rejection_sample_batch",
]

_ACCEPTANCE = ("greedy_accept", "rejection_sample", "rejection_sample_batch")


def __getattr__(name: str):
    if name in _ACCEPTANCE:
        from layerzoo.speculative import acceptance

        return getattr(acceptance, name)
    raise AttributeError(f"module 'layerzoo.speculative' has no attribute {name!r}")


@hookimpl
def register_proposers(register):
    register("ngram", "layerzoo.speculative.proposers:NgramProposer.from_config")
    register("mtp", "layerzoo.speculative.mtp:MtpProposer.from_config")
