"""The core's default answers to the capability queries, registered as a built-in plugin.

Registered ``trylast`` so that any plugin with an opinion answers first; these answers keep every
existing route unchanged (no veto, no opt-in, state in the shared pool, no FP8 calibration).
A new capability query gets its default here, so plugins written before it keep working.
"""

from __future__ import annotations

from layerzoo.hookspecs import hookimpl


@hookimpl(trylast=True)
def uses_local_mla_prefill():
    return False


@hookimpl(trylast=True)
def fp8_calibration_frozen():
    # None is the answer itself ("runs no online calibration"), so firstresult cannot stop on
    # it; the capability gatherer treats "no non-None answer" as this default.
    return None


@hookimpl(trylast=True)
def decode_graph_unsupported():
    return False


@hookimpl(trylast=True)
def decode_multi_seq_unsupported():
    return False


@hookimpl(trylast=True)
def decode_rollback_unsupported():
    return False


@hookimpl(trylast=True)
def decode_verify_multi_unsupported():
    return False


@hookimpl(trylast=True)
def graph_stale_on_new_sequence():
    return False


@hookimpl(trylast=True)
def is_ssm_layer():
    return False


@hookimpl(trylast=True)
def uses_ssm_pool():
    return True


@hookimpl(trylast=True)
def supports_replay_tail_split():
    return False


@hookimpl(trylast=True)
def keeps_per_draft_states():
    return False
