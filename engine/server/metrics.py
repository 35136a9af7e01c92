"""Prometheus metrics of a serving engine (``/metrics``).

Gauges and counters are read from :meth:`Engine.stats` at scrape time (a custom collector, so
nothing is double-booked); latency histograms are observed when a request finishes (a hook the
engine calls from its loop thread). Generation throughput is the rate over the last
``window_s`` seconds of scrapes.
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "flashrt"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


STEP_COUNTERS = {  # where the engine's steps spend their time (Engine.stats keys)
    "steps": "Engine steps run",
    "step_seconds": "Wall time inside engine steps",
    "decode_steps": "Steps that ran a decode batch",
    "decode_rows": "Sequences decoded, summed over steps (divided by decode_steps: the mean batch)",
    "prefill_step_tokens": "Prompt tokens prefilled, summed over steps",
    "prefill_forwards": "Prefill forward calls (one per group of chunks at one position and length)",
    "decode_seconds": "Wall time of the decode forward calls (host side)",
    "prefill_seconds": "Wall time of the prefill forward calls (host side)",
    "prefix_seconds": "Wall time of the prompt snapshots stored in the prefix cache after prefill forwards",
    "sample_seconds": "Wall time of sampling and output checks (waits for the device)",
    "join_seconds": "Wall time of moving prefilled sequences into the decode batch",
    "decode_captures": "Decode steps captured as CUDA graphs (a new shape, or a state buffer that moved)",
    "decode_replays": "Decode steps replayed from captured CUDA graphs",
    "decode_eager": "Decode steps run eagerly from static buffers (no CUDA graphs, cold pages, or a shape that syncs with the host)",
    "decode_fallbacks": "Decode steps run as a plain forward (host-tier pages without the zero-copy gather)",
    "prefill_captures": "Prompt chunks captured as CUDA graphs (a new rows, length and start position in a reusable prefill state)",
    "prefill_replays": "Prompt chunks replayed from captured CUDA graphs",
    "decode_device_seconds": "Device time of the decode forward calls (CUDA events with --device-timing; 0 otherwise)",
    "prefill_device_seconds": "Device time of the prefill forward calls (CUDA events with --device-timing; 0 otherwise)",
}


SPEC_COUNTERS = {  # speculative decoding (Engine.stats spec_* keys, with --speculative)
    "rounds": "Speculative verify steps (rounds with k >= 1)",
    "plain_steps": "Speculative decode batches that ran a plain step (k = 0)",
    "drafted": "Draft tokens verified, summed over the rows that speculated",
    "accepted": "Draft tokens accepted by the target",
    "draft_seconds": "Wall time of the draft layers",
    "verify_seconds": "Wall time of the verify forwards and the acceptance",
}
SPEC_GAUGES = {
    "acceptance_rate": "Accepted / drafted tokens since the start",
    "mean_accepted_length": "Tokens a speculating row gains per verify step (accepted drafts + 1)",
}


class EngineCollector:
    def __init__(self, engine, window_s: float = 10.0):
        self.engine, self.window_s = engine, window_s
        self.samples: deque = deque()  # (time, generation tokens)

    def tokens_per_s(self, generated: int) -> float:
        now = time.monotonic()
        self.samples.append((now, generated))
        while len(self.samples) > 2 and now - self.samples[1][0] > self.window_s:
            self.samples.popleft()
        t0, g0 = self.samples[0]
        return (generated - g0) / (now - t0) if now > t0 else 0.0

    def collect(self):
        s = self.engine.stats()
        g = lambda name, doc, value: GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield g("requests_running", "Sequences in the decode batch", s["running"])
        yield g("requests_prefilling", "Sequences prefilling their prompt", s["prefilling"])
        yield g("requests_waiting", "Sequences waiting to start", s["waiting"])
        yield g("requests_swapped", "Preempted sequences whose KV state is on the host", s["swapped"])
        pages = GaugeMetricFamily(f"{PREFIX}_kv_pages_used", "KV pages in use per tier", labels=["tier"])
        pages.add_metric(["device"], s["kv_pages_device"])
        pages.add_metric(["host"], s["kv_pages_host"])
        pages.add_metric(["index"], s["kv_pages_index"])
        yield pages
        if s["kv_pages_limit"] is not None:
            yield g("kv_pages_limit", "Main-KV pages the scheduler may hold (both tiers)", s["kv_pages_limit"])
        yield g("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up",
                s["prefix_hit_rate"])
        yield g("generation_tokens_per_second", "Generated tokens per second (recent window)",
                self.tokens_per_s(s["generation_tokens"]))
        c = lambda name, doc, value: CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield c("prompt_tokens", "Prompt tokens received", s["prompt_tokens"])
        yield c("generation_tokens", "Tokens generated", s["generation_tokens"])
        yield c("preemptions", "Sequences preempted when KV pages ran out", s["preemptions"])
        yield c("preemption_swaps", "Preemptions that swapped the state to host memory", s["swaps"])
        yield c("preemption_recomputes", "Preemptions that dropped the state for a recompute", s["recomputes"])
        yield c("prefix_cache_queries", "Prefix-cache lookups", s["prefix_queries"])
        yield c("prefix_cache_hits", "Prefix-cache lookups that hit", s["prefix_hits"])
        yield c("kv_cold_spills", "Main-KV pages moved to the host (cold) tier", s["kv_spilled_pages"])
        for kind in ("finished", "aborted", "failed"):
            yield c(f"requests_{kind}", f"Requests {kind}", s[kind])
        for name, doc in STEP_COUNTERS.items():
            yield c(f"engine_{name}", doc, s[name])
        if "groups" in s:  # data-parallel attention over expert-parallel groups (engine/parallel_groups.py)
            yield from group_metrics(s["groups"])
        if "spec_rounds" in s:
            for name, doc in SPEC_COUNTERS.items():
                yield c(f"spec_{name}", doc, s[f"spec_{name}"])
            for name, doc in SPEC_GAUGES.items():
                yield g(f"spec_{name}", doc, s[f"spec_{name}"])


GROUP_METRICS = {  # per expert-parallel group with --dp-attention (Engine.stats "groups")
    "requests": (CounterMetricFamily, "Requests placed on the group"),
    "running": (GaugeMetricFamily, "Sequences in the group's decode batch"),
    "kv_pages_device": (GaugeMetricFamily, "Main-KV device pages the group's pool holds"),
    "kv_pool_bytes": (GaugeMetricFamily, "Device bytes of one rank's page pool of the group (main KV and index K)"),
    "prefix_hits": (CounterMetricFamily, "Prefix-cache lookups that hit in the group's cache"),
}


def group_metrics(groups: list[dict]):
    for name, (family, doc) in GROUP_METRICS.items():
        m = family(f"{PREFIX}_group_{name}", doc, labels=["group"])
        for g, values in enumerate(groups):
            m.add_metric([str(g)], values[name])
        yield m


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        h = lambda name, doc, buckets: Histogram(f"{PREFIX}_{name}", doc, buckets=buckets, registry=self.registry)
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS)
        self.tpot = h("time_per_output_token_seconds", "Mean time between output tokens of a request", TPOT_BUCKETS)
        self.e2e = h("request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS)
        self.queue = h("request_queue_time_seconds", "Arrival to its first prompt chunk planned", LATENCY_BUCKETS)
        self.prefill = h("request_prefill_time_seconds", "First prompt chunk planned to first token", LATENCY_BUCKETS)
        engine.on_finish(self.observe)

    def observe(self, req) -> None:
        """One finished request (:class:`~flashrt.engine.request.Finished`)."""
        if req.first_token_time is None or req.finish_time is None:
            return
        self.ttft.observe(req.first_token_time - req.arrival)
        if req.scheduled_time is not None:  # TTFT = queue time + prefill time
            self.queue.observe(req.scheduled_time - req.arrival)
            self.prefill.observe(req.first_token_time - req.scheduled_time)
        self.e2e.observe(req.finish_time - req.arrival)
        per_seq = req.output_tokens / max(req.n_seqs, 1)
        if per_seq > 1:
            self.tpot.observe((req.finish_time - req.first_token_time) / (per_seq - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
