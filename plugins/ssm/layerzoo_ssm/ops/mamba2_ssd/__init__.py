"""Mamba2 selective state space (SSD): chunked prefill scan and the one-token state update."""
