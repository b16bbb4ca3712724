"""Kimi Delta Attention: the gated delta rule with a per-key-channel decay, chunked (prefill) and recurrent (decode)."""
