"""The gated delta rule, one family for Gated DeltaNet (a decay per head) and Kimi Delta Attention
(a decay per key channel): chunked prefill, recurrent pieces and the one-token decode over pool slots."""
