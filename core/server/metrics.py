"""``/metrics``: the engine's state and the server's latencies in the Prometheus text format.

Engine figures (requests running and waiting, tokens, KV-cache usage, prefix-cache hits,
preemptions, speculative acceptance, blocks and slots in use) are read on the engine's worker
thread (`engine_snapshot`, run through `AsyncLLM.call`) at each scrape; latencies (time to first
token, inter-token, end to end) are histograms the server observes as tokens reach clients.
Names follow vLLM's with a ``layerzoo:`` prefix.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from layerzoo.runtime.engine import LLMEngine

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


def engine_snapshot(engine: LLMEngine) -> dict[str, Any]:
    """The engine's gauges and counters now (run on the worker thread, between steps)."""
    blocks, stats = engine.blocks, engine.stats
    in_use = blocks.num_blocks - blocks.num_free_blocks()
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "requests_held": len(engine.requests),
        "kv_blocks_total": blocks.num_blocks,
        "kv_blocks_in_use": in_use,
        "kv_cache_usage": in_use / blocks.num_blocks,
        "decode_slots_in_use": len(engine.runner.slots.slot_of),
        "state_slots_in_use": len(engine.states.live) if engine.states.active else 0,
        "prompt_tokens": stats.prompt_tokens,
        "generation_tokens": stats.generated_tokens,
        "preemptions": stats.preemptions,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "spec_draft_tokens": stats.spec_draft_tokens,
        "spec_accepted_tokens": stats.spec_accepted_tokens,
    }


GAUGES = {
    "num_requests_running": ("running", "Sequences running in the engine"),
    "num_requests_waiting": ("waiting", "Sequences waiting to be scheduled"),
    "num_requests_held": ("requests_held", "Requests the engine holds (running, waiting or not yet released)"),
    "kv_cache_usage_perc": ("kv_cache_usage", "Fraction of KV-cache blocks in use (1 = full)"),
    "kv_cache_blocks_in_use": ("kv_blocks_in_use", "KV-cache blocks held by sequences"),
    "kv_cache_blocks_total": ("kv_blocks_total", "KV-cache blocks in the pool"),
    "decode_slots_in_use": ("decode_slots_in_use", "Decode slots held by sequences"),
    "state_slots_in_use": ("state_slots_in_use", "Recurrent-state slots held by sequences"),
}
COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens received"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "num_preemptions": ("preemptions", "Sequences preempted (their KV recomputed later)"),
    "prefix_cache_queries": ("prefix_cache_queries", "Blocks looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Blocks found in the prefix cache"),
    "spec_decode_num_draft_tokens": ("spec_draft_tokens", "Speculative draft tokens verified"),
    "spec_decode_num_accepted_tokens": ("spec_accepted_tokens", "Speculative draft tokens accepted"),
}


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        snap = self.metrics.snapshot
        if not snap:
            return
        for name, (key, doc) in GAUGES.items():
            yield GaugeMetricFamily(f"layerzoo:{name}", doc, value=snap[key])
        for name, (key, doc) in COUNTERS.items():
            yield CounterMetricFamily(f"layerzoo:{name}", doc, value=snap[key])
        queries, drafts = snap["prefix_cache_queries"], snap["spec_draft_tokens"]
        yield GaugeMetricFamily("layerzoo:prefix_cache_hit_rate", "Prefix-cache hits / queries (0 before any query)",
                                value=snap["prefix_cache_hits"] / queries if queries else 0.0)
        yield GaugeMetricFamily("layerzoo:spec_decode_acceptance_rate", "Accepted / verified drafts (0 before any)",
                                value=snap["spec_accepted_tokens"] / drafts if drafts else 0.0)


class Metrics:
    """One server's metrics, in a registry of its own (several servers in one process stay apart)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.snapshot: dict[str, Any] = {}
        self.ttft = Histogram("layerzoo:time_to_first_token_seconds", "Time from request to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("layerzoo:inter_token_latency_seconds", "Time between tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("layerzoo:e2e_request_latency_seconds", "Time from request to its last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("layerzoo:request_success", "Completions finished, by finish reason",
                                ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
