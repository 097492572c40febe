"""/metrics: Prometheus metrics under vLLM's names (vllm:*), so that a dashboard made
for vLLM reads this server, and zmqworker:* for what vLLM has no name for.

Two sources. Per-request metrics (latency histograms, token and request counters) are
observed by each API server process as its requests' outputs come in (Frontend's
observers), in prometheus_client's multiprocess mode when `zmqworker serve` gives its
API servers a metrics folder (PROMETHEUS_MULTIPROC_DIR, made and removed by the main
process): every scrape, whichever API server answers it, adds up all of their files.
The engine cores' state (requests running and waiting, KV cache, preemptions) is read
from them at each scrape (one stats call over every replica), so it is never summed
twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from zmqworker.frontend.outputs import EngineStats, RequestOutput

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABELS = ["model_name"]
FINISH_REASONS = ("stop", "length")  # request_success's (an aborted request is not one)
# vLLM's buckets, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """The metrics of one API server process, and the registry /metrics renders."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        shared = os.environ.get(MULTIPROC_ENV)
        if shared:
            MultiProcessCollector(self.registry, path=shared)
        # In multiprocess mode the values live in the folder's files, which the
        # collector above reads: the metrics are registered nowhere themselves.
        own = None if shared else self.registry
        self.engines = _EngineCollector(model_name)
        self.registry.register(self.engines)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=own)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, from arrival", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between a request's outputs", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Engine core: taken in to first scheduled",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of requests that started", LABELS, registry=own
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated", LABELS, registry=own
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens of requests that started (with or without a prefix cache)",
            LABELS,
            registry=own,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Of those, the tokens their engine core did not compute (prefix-cache hits)",
            LABELS,
            registry=own,
        )
        self.success = Counter(
            "vllm:request_success",
            "Requests that finished, by reason",
            [*LABELS, "finished_reason"],
            registry=own,
        )
        # Every series from the first scrape, at 0 (as vLLM's): a dashboard's rate() and
        # absent() read a series that exists, not one that appears with the first request.
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens,
                       self.generation_tokens, self.prefix_queries, self.prefix_hits):  # fmt: skip
            metric.labels(model_name)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)

    def observe(self, out: RequestOutput) -> None:
        """One output of a request: its first token, each later one, its end."""
        name = self.model_name
        if out.new_token_ids:
            self.generation_tokens.labels(name).inc(len(out.new_token_ids))
            if len(out.token_ids) == len(out.new_token_ids):  # its first tokens
                self.ttft.labels(name).observe(out.timings.ttft)
                self.queue.labels(name).observe(out.timings.queue)
                if out.index == 0:  # a prompt's n samples count it once
                    self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                    self.prefix_queries.labels(name).inc(len(out.prompt_token_ids))
                    self.prefix_hits.labels(name).inc(out.num_cached_tokens)
            else:
                self.itl.labels(name).observe(out.timings.since_last)
        if out.finished and out.finish_reason != "abort":
            self.e2e.labels(name).observe(out.timings.total)
            self.success.labels(name, out.finish_reason).inc()


class _EngineCollector:
    """The engine cores' state, as the last scrape read it (stats, set before rendering)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        used = stats.num_blocks - stats.num_free_blocks
        usage = used / stats.num_blocks
        for name, doc, value in (
            ("num_requests_running", "requests running", stats.num_running),
            ("num_requests_waiting", "requests waiting", stats.num_waiting),
            ("kv_cache_blocks", "KV cache blocks", stats.num_blocks),
            ("kv_cache_blocks_used", "KV cache blocks in use", used),
            ("kv_cache_usage_perc", "KV cache usage (0 to 1)", usage),
            ("kv_host_blocks", "host KV tier slots", stats.num_host_blocks),
            (
                "kv_host_blocks_used",
                "host KV tier slots holding a block",
                stats.num_host_blocks_used,
            ),
        ):
            yield GaugeMetricFamily(f"zmqworker:{name}", doc, value=value)
        for name, doc, value in (
            ("num_preemptions", "requests preempted", stats.num_preemptions),
            ("num_requests_aborted", "requests aborted (clients gone)", stats.num_aborted),
            ("prefill_tokens", "tokens whose KV prefills computed", stats.num_prefill_tokens),
            (
                "kv_host_stored_blocks",
                "blocks stored into the host KV tier",
                stats.num_host_stored_blocks,
            ),
            (
                "kv_host_loaded_blocks",
                "blocks loaded back from the host KV tier",
                stats.num_host_loaded_blocks,
            ),
            (
                "kv_host_dropped_blocks",
                "evicted blocks the full host KV tier dropped",
                stats.num_host_dropped_blocks,
            ),
            (
                "kv_remote_hit_blocks",
                "prompt blocks of remote-KV requests found in the decode side's cache",
                stats.num_remote_hit_blocks,
            ),
            (
                "kv_remote_pulled_blocks",
                "prompt blocks of remote-KV requests pulled from the prefill side",
                stats.num_remote_pulled_blocks,
            ),
        ):
            yield CounterMetricFamily(f"zmqworker:{name}", doc, value=value)
        for name, doc, value in (
            ("num_requests_running", "Requests in the engine cores' steps", stats.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting),
            ("kv_cache_usage_perc", "KV cache usage (0 to 1)", usage),
        ):
            gauge = GaugeMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            gauge.add_metric([self.model_name], value)
            yield gauge
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Preemptions", labels=LABELS)
        preemptions.add_metric([self.model_name], stats.num_preemptions)
        yield preemptions
