"""Prometheus metrics of the server, in a registry of its own (two servers in one process do not mix counts).

Names follow vLLM's where one exists (`vllm:` -> `moeserve:`), so dashboards carry over.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str, slots: int):
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.running = Gauge("moeserve:num_requests_running", "Requests holding a KV slot (prefill or decode).",
                             label, registry=r).labels(model_name)
        self.waiting = Gauge("moeserve:num_requests_waiting", "Requests queued for a KV slot.", label,
                             registry=r).labels(model_name)
        self.slots_used = Gauge("moeserve:kv_slots_used", "KV cache slots in use.", label,
                                registry=r).labels(model_name)
        self.slots_total = Gauge("moeserve:kv_slots_total", "KV cache slots (--parallel).", label,
                                 registry=r).labels(model_name)
        self.slots_total.set(slots)
        self.prompt_tokens = Counter("moeserve:prompt_tokens", "Prompt tokens read (prefill), computed or reused.",
                                     label, registry=r).labels(model_name)
        self.prompt_tokens_cached = Counter("moeserve:prompt_tokens_cached", "Prompt tokens whose KV was reused "
                                            "(copied from another KV row or kept in its own), not computed: the "
                                            "prefix-reuse hit rate is this over moeserve:prompt_tokens.", label,
                                            registry=r).labels(model_name)
        self.generation_tokens = Counter("moeserve:generation_tokens", "Tokens generated (EOS included).", label,
                                         registry=r).labels(model_name)
        self._finished = Counter("moeserve:request_success", "Requests finished, by finish reason "
                                 "(stop, length, abort: the client went away).", label + ["finished_reason"],
                                 registry=r)
        self._errors = Counter("moeserve:request_errors", "Requests refused, by HTTP status.", label + ["status"],
                               registry=r)
        self.ttft = Histogram("moeserve:time_to_first_token_seconds", "Arrival to first token.", label,
                              buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("moeserve:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                             label, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("moeserve:e2e_request_latency_seconds", "Arrival to last token.", label,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.model_name = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def set_load(self, running: int, waiting: int, slots_used: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.slots_used.set(slots_used)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
