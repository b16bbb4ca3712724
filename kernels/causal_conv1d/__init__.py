"""Depthwise causal conv1d with a carried state of raw inputs: prefill (varlen) and one-token update."""
