"""Chapter 7: what a serving engineer watches, as Prometheus metrics under vLLM's names.

The same names as vLLM (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ...), so a
dashboard or an alert written for vLLM reads tinyvllm unchanged:
  - queues: how many requests run, how many wait — waiting that grows means the server is saturated;
  - the KV cache: the share of blocks in use — near 100% is where preemption starts;
  - latency as a user feels it: time to the first token (queueing + prefill), then the time between
    tokens (decode steps), and the whole request;
  - work done: prompt and generated token counters (their rate is throughput);
  - the prefix cache: prompt tokens looked up and found (their ratio is the hit rate);
  - speculative decoding (chapter 10): verifications, tokens proposed and accepted (acceptance rate), and
    accepted by position in the proposal.

With several API-server processes (`serve --api-server-count N`), each counts its own requests into files
of a shared folder (prometheus-client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR) and /metrics, whichever
process answers it, adds them up; the engine's own numbers (queues, cache) are counted by process 0 only.
"""
from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

# Buckets as vLLM's (seconds): a time to first token spans milliseconds (a cache hit) to minutes (a queue).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Metrics:
    """One registry per server (tests run several servers in one process). engine_counters: this process
    counts the engine's cumulative numbers (with several API servers, one of them does)."""
    def __init__(self, model_name: str, engine_counters: bool = True):
        self.registry = registry = CollectorRegistry()
        self.shared = "PROMETHEUS_MULTIPROC_DIR" in os.environ   # set by api_servers.py before this process began
        self.engine_counters = engine_counters
        label = {"labelnames": ["model_name"], "registry": registry}

        def gauge(name: str, doc: str) -> Gauge:   # every process sees the same engine: the latest value is it
            return Gauge(f"vllm:{name}", doc, multiprocess_mode="mostrecent", **label).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"vllm:{name}", doc, **label).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, buckets=buckets, **label).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot or for KV blocks.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received (each of n samples counts its prompt).")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens admitted, looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.spec_counters = (   # speculative decoding: acceptance rate = accepted / draft tokens
            counter("spec_decode_num_drafts", "Proposals verified (one per sequence and step)."),
            counter("spec_decode_num_draft_tokens", "Tokens proposed."),
            counter("spec_decode_num_accepted_tokens", "Proposed tokens accepted."))
        self.spec_per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                         "Proposed tokens accepted, by position in the proposal (0 first).",
                                         ["model_name", "position"], registry=registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        self._success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=registry)
        self.model_name = model_name
        self._seen = (0, 0)        # the engine's cumulative prefix-cache counts at the last report
        self._spec_seen = (0, 0, 0)  # and its speculative-decoding counts
        self._spec_position_seen: tuple[int, ...] = ()

    def engine_stats(self, stats) -> None:
        """The engine's counts after a step (a core_messages.Stats): gauges set, counters moved on."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_cache_usage.set(1 - stats.free_blocks / stats.num_blocks if stats.num_blocks else 0.0)
        if not self.engine_counters:
            return
        self.cache_queries.inc(stats.prefix_cache_queries - self._seen[0])
        self.cache_hits.inc(stats.prefix_cache_hits - self._seen[1])
        self._seen = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        spec = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
        for counter, now, before in zip(self.spec_counters, spec, self._spec_seen):
            counter.inc(now - before)
        self._spec_seen = spec
        for position, now in enumerate(stats.spec_decode_accepted_per_position):
            before = self._spec_position_seen[position] if position < len(self._spec_position_seen) else 0
            if now > before:
                self.spec_per_position.labels(self.model_name, str(position)).inc(now - before)
        self._spec_position_seen = stats.spec_decode_accepted_per_position

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        if not self.shared:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process)
        return generate_latest(every_process)
