"""Gated delta rule (Gated DeltaNet): chunked prefill and step-by-step recurrence."""
