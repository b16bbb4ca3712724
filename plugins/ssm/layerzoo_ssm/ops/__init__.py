"""The ssm plugin's kernel ops, one folder each: ``reference.py`` (plain torch, the CPU path) and
``triton.py`` (the GPU kernel, same signature, tested against the reference under
``TRITON_INTERPRET=1``). Registered through the plugin's ``register_kernels`` as lazy strings.
"""

from __future__ import annotations

from pathlib import Path

from layerzoo.kernels import folder_backends, register_op_folders

# op name -> (folder, function name in reference.py and triton.py)
OPS: dict[str, tuple[str, str]] = {
    # (Gated DeltaNet's delta rule is the core's delta_rule_* family, shared with KDA)
    # Mamba2 SSD: prefill scan and the one-token update
    "mamba2_chunk_scan": ("mamba2_ssd", "ssd_chunk_scan"),
    "mamba2_state_update": ("mamba2_ssd", "selective_state_update"),
}

_HERE = Path(__file__).parent


def backends_of(op: str) -> dict[str, str]:
    """``backend -> "module:function"`` for the files present in the op's folder."""
    return folder_backends(__name__, _HERE, *OPS[op])


def register_all(register) -> None:
    register_op_folders(register, __name__, _HERE, OPS)
