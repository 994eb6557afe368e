"""Prometheus metrics under TGI's names, with TGI's histogram buckets.

One registry per server (no process-global state). Request metrics move when a request
ends, step metrics when the engine runs a step, and the gauges are read from the engine
when Prometheus scrapes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.registry import Collector

from tokenmill.observability.telemetry import RequestRecord

if TYPE_CHECKING:
    from tokenmill.engine.timing import StepTiming


def duration_buckets() -> list[float]:
    """TGI's buckets for every ``*_duration`` histogram: 35 steps of ×1.5 from 0.15 ms (~2.4 h)."""
    buckets, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        buckets.append(value)
    return buckets


def length_buckets(limit: int) -> list[float]:
    """TGI's token-count buckets: 100 even steps up to ``limit``."""
    return [limit / 100 * (i + 1) for i in range(100)]


FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
                       3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Time to first token: a few milliseconds (a short prompt, an idle server) to minutes (a long queue)."""

TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                     0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Between two tokens of a sequence: a decode step (ms) up to a stall behind long prefills or a slow reader."""

REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
                   90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
"""A whole request: a short answer (tens of ms) up to an hour-long generation."""


FAILURE_LABELS = {"cancelled": "dropped"}
"""``tgi_request_failure{err}`` takes the request's ``error_type``, under TGI's label where TGI's differs
(a client that went away is ``dropped``)."""


class Metrics:
    """The server's metrics; ``exposition()`` is the body of ``GET /metrics``."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        seconds = duration_buckets()
        r = self.registry
        self.counters = PlainCounters({
            "tgi_request_count": ("generation requests received (counted on arrival)", ()),
            "tgi_request_success": ("generation requests that succeeded", ()),
            "tgi_request_failure": ("generation requests that failed, by error type", ("err",)),
            "tgi_batch_inference_count": ("engine steps, by method", ("method",)),
            "tgi_batch_inference_success": ("engine steps that succeeded", ("method",)),
            "tgi_batch_inference_failure": ("engine steps that failed", ("method",)),
        })
        self.request_duration = Histogram("tgi_request_duration", "seconds from arrival to the last byte",
                                          buckets=seconds, registry=r)
        self.validation_duration = Histogram("tgi_request_validation_duration", "seconds spent validating",
                                             buckets=seconds, registry=r)
        self.queue_duration = Histogram("tgi_request_queue_duration", "seconds waiting to join the batch",
                                        buckets=seconds, registry=r)
        self.inference_duration = Histogram("tgi_request_inference_duration", "seconds in the batch",
                                            buckets=seconds, registry=r)
        self.time_per_token = Histogram("tgi_request_mean_time_per_token_duration",
                                        "inference seconds per generated token", buckets=seconds, registry=r)
        self.step_duration = Histogram("tgi_batch_inference_duration", "seconds per engine step (forward, "
                                       "sampling and detokenizing)", ["method"], buckets=seconds, registry=r)
        self.forward_duration = Histogram("tgi_batch_forward_duration", "seconds per engine step's forward pass",
                                          ["method"], buckets=seconds, registry=r)
        self.decode_duration = Histogram("tgi_batch_decode_duration", "seconds per engine step spent after the "
                                         "forward: sampling, stop checks, detokenizing", ["method"],
                                         buckets=seconds, registry=r)
        self.time_to_first_token = Histogram(
            "tokenmill_time_to_first_token_seconds", "seconds from a request's arrival to its first generated token "
            "(validation, queue and prefill)", buckets=FIRST_TOKEN_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "tokenmill_inter_token_latency_seconds", "seconds between two consecutive tokens of one sequence",
            buckets=TOKEN_GAP_BUCKETS, registry=r)
        GCCollector(registry=r)  # python_gc_collections_total{generation}, as every Python exporter has it
        self.e2e_latency = Histogram("tokenmill_e2e_request_latency_seconds", "seconds from a successful request's "
                                     "arrival to its last byte", buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "prompt tokens of the requests that got their "
                                     "first token (their prompts were processed)", registry=r)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "tokens generated, every choice of every "
                                         "request counted, as they are produced", registry=r)
        self.draft_tokens = Counter("tokenmill_speculation_draft_tokens", "draft tokens the model checked "
                                    "(--speculate)", registry=r)
        self.accepted_tokens = Counter("tokenmill_speculation_accepted_tokens", "draft tokens kept, each a token "
                                       "produced without a step of its own", registry=r)
        self.skipped_tokens = Histogram("tgi_request_skipped_tokens", "per sequence and step it drafted in, the "
                                        "tokens it got beyond one", buckets=[float(n) for n in range(9)] + [16.0, 32.0],
                                        registry=r)
        self.next_batch_size = Histogram("tgi_batch_next_size", "sequences joining the batch in a prefill step",
                                         buckets=[float(i + 1) for i in range(1024)], registry=r)
        self.input_length: Histogram | None = None
        self.generated_tokens: Histogram | None = None
        self.max_new_tokens: Histogram | None = None
        if snapshot is not None:
            r.register(LiveGauges(snapshot))

    def set_token_limits(self, max_input_tokens: int, max_total_tokens: int) -> None:
        """Add the token-count histograms, whose buckets follow the limits known once the model loads."""
        if self.input_length is not None:
            return
        r = self.registry
        self.input_length = Histogram("tgi_request_input_length", "prompt tokens per request",
                                      buckets=length_buckets(max_input_tokens), registry=r)
        self.generated_tokens = Histogram("tgi_request_generated_tokens", "tokens generated per request",
                                          buckets=length_buckets(max_total_tokens), registry=r)
        self.max_new_tokens = Histogram("tgi_request_max_new_tokens", "max_new_tokens asked per request",
                                        buckets=length_buckets(max_total_tokens), registry=r)

    def request_arrived(self) -> None:
        self.counters.inc("tgi_request_count")

    def first_token(self, record: RequestRecord) -> None:
        """The request's first token came: its time to first token, and its prompt counted as processed."""
        assert record.first_token_seconds is not None
        self.time_to_first_token.observe(record.first_token_seconds)
        self.prompt_tokens.inc(record.input_tokens)

    def token_generated(self, gap_seconds: float | None) -> None:
        """One more token; ``gap_seconds`` since its sequence's previous one (None for a sequence's first)."""
        self.generation_tokens.inc()
        if gap_seconds is not None:
            self.inter_token_latency.observe(gap_seconds)

    def request_finished(self, record: RequestRecord) -> None:
        if not record.succeeded:
            err = record.error_type or "unknown"
            self.counters.inc("tgi_request_failure", FAILURE_LABELS.get(err, err))
            return
        self.counters.inc("tgi_request_success")
        self.request_duration.observe(record.total_seconds)
        self.e2e_latency.observe(record.total_seconds)
        self.validation_duration.observe(record.validation_seconds)
        self.queue_duration.observe(record.queue_seconds)
        self.inference_duration.observe(record.inference_seconds)
        self.time_per_token.observe(record.time_per_token_seconds)
        if self.input_length is not None and self.generated_tokens is not None and self.max_new_tokens is not None:
            self.input_length.observe(record.input_tokens)
            self.generated_tokens.observe(record.generated_tokens)
            self.max_new_tokens.observe(record.max_new_tokens)

    def step_finished(self, step: StepTiming) -> None:
        """Called from the engine thread after each step that ran the model."""
        method = step.method
        self.counters.inc("tgi_batch_inference_count", method)
        if not step.ok:
            self.counters.inc("tgi_batch_inference_failure", method)
            return
        self.counters.inc("tgi_batch_inference_success", method)
        if step.prefilling:
            self.next_batch_size.observe(step.prefilling)
        self.forward_duration.labels(method=method).observe(step.forward_seconds)
        self.step_duration.labels(method=method).observe(step.step_seconds)
        self.decode_duration.labels(method=method).observe(step.step_seconds - step.forward_seconds)
        if step.speculated is not None:
            self.draft_tokens.inc(step.speculated.drafted)
            self.accepted_tokens.inc(step.speculated.accepted)
            for skipped in step.speculated.skipped:
                self.skipped_tokens.observe(skipped)

    def exposition(self) -> bytes:
        return self.counters.exposition().encode() + generate_latest(self.registry)


class PlainCounters:
    """Counters written under their bare names, as TGI's exporter writes them (``tgi_request_count 3``;
    prometheus_client would write ``tgi_request_count_total``), so dashboards built for TGI read them
    as they are. ``families`` maps a name to its help text and label names."""

    def __init__(self, families: dict[str, tuple[str, tuple[str, ...]]]) -> None:
        self.families = families
        self.values: dict[tuple[str, tuple[str, ...]], float] = {}
        self.lock = threading.Lock()

    def inc(self, name: str, *label_values: str) -> None:
        assert len(label_values) == len(self.families[name][1]), name
        with self.lock:
            key = (name, label_values)
            self.values[key] = self.values.get(key, 0.0) + 1

    def exposition(self) -> str:
        with self.lock:
            values = dict(self.values)
        lines = []
        for name, (help_text, label_names) in self.families.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            samples = [(labels, value) for (counted, labels), value in values.items() if counted == name]
            if not label_names and not samples:
                samples = [((), 0.0)]
            for labels, value in samples:
                pairs = ",".join(f'{key}="{escape_label(v)}"' for key, v in zip(label_names, labels))
                lines.append(f"{name}{{{pairs}}} {value}" if pairs else f"{name} {value}")
        return "\n".join(lines) + "\n"


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class LiveGauges(Collector):
    """Gauges (and the engine's own counters) read when Prometheus scrapes, from ``snapshot()``:
    ``queue_size``, ``batch_size``, ``batch_max_tokens``, ``in_flight``, ``queue_by_class``
    ({class: waiting}), ``kv`` (the runner's ``kv_usage()``), ``lora`` (the adapter cache's
    ``usage()``, or None), ``preemptions``, ``suspensions``, ``prefix_cache`` (looked-up and found
    tokens, or None without a prefix cache), ``max_batch_total_tokens``, and ``adapters_running`` and
    ``adapters_waiting`` (the LoRA adapters of the sequences in the batch and of those queued)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        now = self.snapshot()
        if not now:  # still loading
            return
        yield GaugeMetricFamily("tgi_queue_size", "requests waiting to join the batch", value=now["queue_size"])
        yield GaugeMetricFamily("tgi_batch_current_size", "sequences in the running batch", value=now["batch_size"])
        yield GaugeMetricFamily("tgi_batch_current_max_tokens", "prompt + max_new_tokens of the running batch",
                                value=now["batch_max_tokens"])
        yield GaugeMetricFamily("tokenmill_requests_in_flight", "requests holding a concurrency slot",
                                value=now["in_flight"])
        by_class = GaugeMetricFamily("tokenmill_queue_class_size", "requests waiting, per priority class",
                                     labels=["class"])
        for name, waiting in now["queue_by_class"].items():
            by_class.add_metric([name], waiting)
        yield by_class
        kv = now["kv"]
        if "sleeping" in now:
            yield GaugeMetricFamily("tokenmill_sleeping", "1 while the server sleeps (--sleep-after-idle, POST /sleep)",
                                    value=int(now["sleeping"]))
        yield GaugeMetricFamily("tokenmill_kv_cache_bytes", "bytes of KV cache held", value=kv.get("bytes", 0))
        if "blocks_total" in kv:
            yield GaugeMetricFamily("tokenmill_kv_blocks_used", "KV blocks in use", value=kv["blocks_used"])
            yield GaugeMetricFamily("tokenmill_kv_blocks_free", "KV blocks free",
                                    value=kv["blocks_total"] - kv["blocks_used"])
        yield GaugeMetricFamily("tokenmill_kv_cache_usage_ratio", "share of the KV cache in use, 0 to 1 (blocks "
                                "used of all blocks; without blocks, tokens held of --max-batch-total-tokens)",
                                value=kv_usage_ratio(kv, now.get("max_batch_total_tokens")))
        lora = now.get("lora")
        yield lora_requests_info(lora["limit"] if lora is not None else 0, now.get("adapters_running", ()),
                                 now.get("adapters_waiting", ()))
        if lora is not None:
            # TGI's source exports no such gauge; kept because TGI's production guides alert on it.
            yield GaugeMetricFamily("tgi_lora_cache_size", "LoRA adapters in memory", value=len(lora["loaded"]))
            yield GaugeMetricFamily("tokenmill_lora_cache_bytes", "bytes of LoRA weights in memory",
                                    value=lora["bytes"])
            yield CounterMetricFamily("tokenmill_lora_loads", "LoRA adapters loaded (again, after an eviction)",
                                      value=lora["loads"])
            yield CounterMetricFamily("tokenmill_lora_evictions", "LoRA adapters evicted from memory",
                                      value=lora["evictions"])
        if "blocks_cached" in kv:
            yield GaugeMetricFamily("tokenmill_prefix_cache_blocks", "KV blocks that hold a named prompt prefix "
                                    "(held by a sequence or cached for the next prompt that begins the same way)",
                                    value=kv["blocks_cached"])
        prefix = now.get("prefix_cache")
        if prefix is not None:
            yield CounterMetricFamily("tokenmill_prefix_cache_queries", "tokens of the sequences started that were "
                                      "looked up in the prefix cache", value=prefix["queried_tokens"])
            yield CounterMetricFamily("tokenmill_prefix_cache_hits", "of those, tokens found there (not prefilled)",
                                      value=prefix["hit_tokens"])
        yield CounterMetricFamily("tokenmill_preemptions", "sequences preempted, their KV memory freed to be "
                                  "recomputed later", value=now["preemptions"])
        yield CounterMetricFamily("tokenmill_suspensions", "sequences set aside for a higher class, their KV "
                                  "memory kept", value=now["suspensions"])

    def describe(self) -> Iterable[Metric]:
        return []


def kv_usage_ratio(kv: dict[str, Any], max_batch_total_tokens: int | None) -> float:
    """What share of the KV cache is in use: blocks used of all blocks for a block pool (cached
    prefix blocks nobody holds count as free: they are evicted on demand); for a cache without
    blocks, the tokens the batch holds of ``--max-batch-total-tokens``, which bounds that cache."""
    if kv.get("blocks_total"):
        return min(1.0, kv["blocks_used"] / kv["blocks_total"])
    if max_batch_total_tokens and "tokens_held" in kv:
        return min(1.0, kv["tokens_held"] / max_batch_total_tokens)
    return 0.0


def lora_requests_info(max_lora: int, running: Iterable[str], waiting: Iterable[str]) -> GaugeMetricFamily:
    """The LoRA state as vLLM's ``vllm:lora_requests_info`` shows it, which the Gateway API Inference
    Extension's endpoint picker reads for adapter affinity: comma-separated adapter names in labels,
    the value the time of the scrape (the picker takes the newest series)."""
    info = GaugeMetricFamily("tokenmill_lora_requests_info", "LoRA adapters of the running and of the waiting "
                             "sequences, and how many adapters fit in memory; value: unix time of this reading",
                             labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    info.add_metric([",".join(sorted(running)), ",".join(sorted(waiting)), str(max_lora)], time.time())
    return info


def serve_metrics(metrics: Metrics, host: str, port: int) -> Any:
    """``--prometheus-port``: ``GET /metrics`` on a port of its own, served from a daemon thread.
    Returns the server (``shutdown()`` stops it)."""
    import socket
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class MetricsHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = metrics.exposition()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        # scrapes are not worth a log line each; `format` is BaseHTTPRequestHandler.log_message's own parameter name
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keeps the overridden stdlib signature
            pass

    class MetricsServer(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def shutdown(self) -> None:
            super().shutdown()
            self.server_close()

    server = MetricsServer((host, port), MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="tokenmill-metrics", daemon=True).start()
    return server
