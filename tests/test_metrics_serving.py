"""Metrics for dashboards, autoscalers and the Gateway API Inference Extension's endpoint picker
(time to first token, inter-token and end-to-end latency, token counters, KV-cache usage, queued and
running sequences, LoRA info), and W3C ``traceparent`` continued in the request's trace, against a
real server on the tiny model."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningServer, start_server
from otlp_collector import Collector, running_collector
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.observability.telemetry import RequestRecord
from tokenmill.observability.tracing import Tracing

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
LONG_TOKENS = 900
"""A stream this long outlasts the scrapes made while it runs (the tiny model with ``ad0`` meets no EOS in it)."""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and sorted labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def labelled(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> list[dict[str, str]]:
    """The label sets of every sample named ``name``."""
    return [dict(labels) for sample_name, labels in found if sample_name == name]


def scrape(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    answer = httpx.get(f"{server.url}/metrics", timeout=30)
    assert answer.status_code == 200
    return samples(answer.text)


def scrape_until(server: RunningServer, ready: Callable[[dict], bool], timeout: float = 30.0) -> dict:
    """Scrape until ``ready(samples)`` (a stream's request is reported just after its last event is sent)."""
    deadline = time.monotonic() + timeout
    while True:
        found = scrape(server)
        if ready(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


@pytest.fixture(scope="module")
def trace_collector() -> Iterator[Collector | None]:
    """One OTLP collector for the module's servers (None without the otlp extra: no trace tests then)."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        yield None
        return
    with running_collector() as collector:
        yield collector


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("peft", reason="the LoRA adapters are made with peft")
    from bench.lora import write_random_adapter

    root = tmp_path_factory.mktemp("serving-adapters")
    return {name: write_random_adapter(root / name, seed=seed, base_dir=tiny_model_dir)
            for name, seed in (("ad0", 10), ("ad1", 11))}


@pytest.fixture(scope="module", params=[pytest.param("transformers", marks=pytest.mark.slow), "paged"])
def server(request: pytest.FixtureRequest, tiny_model_dir: Path, adapters: dict[str, Path],
           trace_collector: Collector | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One sequence in the batch at a time (so that a second one queues), a small stream buffer (so
    that a reader that stops pauses its sequence where the backend can pause), two adapters, traces
    exported every 50 ms."""
    listed = ",".join(f"{name}={path}" for name, path in adapters.items())
    args = ["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--backend", request.param,
            "--max-input-tokens", "64", "--max-total-tokens", "1024", "--max-batch-total-tokens", "2048",
            "--max-batch-size", "1", "--stream-buffer-tokens", "2", "--lora-adapters", listed]
    if trace_collector is not None:
        args += ["--otlp-endpoint", trace_collector.url]
    running = start_server(args, tmp_path_factory.mktemp("serving"), env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    running.backend = request.param
    yield running
    running.stop()


def stream_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield json.loads(line[5:])


def test_latency_histograms_and_token_counters_follow_a_whole_and_a_streamed_request(server):
    before = scrape(server)
    with server.client() as client:
        whole = client.post("/generate", json={"inputs": "The capital of France is", "parameters": {
            "max_new_tokens": 8, "details": True}})
        with client.stream("POST", "/generate_stream", json={"inputs": "Once upon a time", "parameters": {
                "max_new_tokens": 6, "details": True}}) as streamed:
            events = list(stream_events(streamed))
    assert whole.status_code == 200 and streamed.status_code == 200, whole.text
    final = events[-1]["details"]
    prompt_tokens = int(whole.headers["x-prompt-tokens"]) + final["input_length"]
    generated = whole.json()["details"]["generated_tokens"] + final["generated_tokens"]
    assert len(events) == final["generated_tokens"] and final["generated_tokens"] >= 2

    def delta(found: dict, name: str, **labels: str) -> float:
        return value(found, name, **labels) - value(before, name, **labels)

    after = scrape_until(server, lambda found: delta(found, "tokenmill_e2e_request_latency_seconds_count") >= 2)
    assert delta(after, "tokenmill_e2e_request_latency_seconds_count") == 2
    assert delta(after, "tokenmill_time_to_first_token_seconds_count") == 2
    assert delta(after, "tokenmill_inter_token_latency_seconds_count") == generated - 2  # a gap between two tokens
    first_token = delta(after, "tokenmill_time_to_first_token_seconds_sum")
    gaps = delta(after, "tokenmill_inter_token_latency_seconds_sum")
    end_to_end = delta(after, "tokenmill_e2e_request_latency_seconds_sum")
    assert 0 < first_token < end_to_end and 0 < gaps < end_to_end
    assert first_token + gaps <= end_to_end + 1e-6  # each request: first token, then its gaps, then the end
    assert delta(after, "tokenmill_prompt_tokens_total") == prompt_tokens
    assert delta(after, "tokenmill_generation_tokens_total") == generated
    # buckets for serving: milliseconds to minutes
    assert value(after, "tokenmill_inter_token_latency_seconds_bucket", le="0.001") >= 0
    assert ("tokenmill_time_to_first_token_seconds_bucket", (("le", "600.0"),)) in after
    assert ("tokenmill_e2e_request_latency_seconds_bucket", (("le", "3600.0"),)) in after


def test_garbage_collections_while_serving_are_counted_by_generation(server):
    before = value(scrape(server), "python_gc_collections_total", generation="0")
    with server.client() as client:
        for _ in range(3):
            assert client.post("/generate", json={"inputs": "Count: one, two,", "parameters": {
                "max_new_tokens": 8}}).status_code == 200
    after = scrape_until(server, lambda found: value(found, "python_gc_collections_total", generation="0") > before)
    assert {labels["generation"] for labels in labelled(after, "python_gc_collections_total")} == {"0", "1", "2"}


def test_an_idle_server_reports_no_kv_use_and_no_lora_adapters_at_work(server):
    found = scrape_until(server, lambda found: value(found, "tgi_batch_current_size") == 0
                         and value(found, "tokenmill_kv_cache_usage_ratio") == 0)
    assert value(found, "tokenmill_kv_cache_usage_ratio") == 0
    assert value(found, "tgi_queue_size") == 0 and value(found, "tgi_batch_current_size") == 0
    [info] = labelled(found, "tokenmill_lora_requests_info")
    assert info == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": info["max_lora"]}
    assert int(info["max_lora"]) >= 2
    assert abs(value(found, "tokenmill_lora_requests_info", **info) - time.time()) < 60  # a unix time
    assert value(found, "tgi_lora_cache_size") == 2


def test_kv_usage_queue_running_and_lora_info_move_while_a_long_stream_runs(server):
    body = {"inputs": "Tell me a long story", "parameters": {
        "max_new_tokens": LONG_TOKENS, "adapter_id": "ad0"}}
    waiting_answer: dict[str, httpx.Response] = {}
    with httpx.Client(base_url=server.url, timeout=120) as client, \
            client.stream("POST", "/generate_stream", json=body) as long_stream:
        assert long_stream.status_code == 200
        events = stream_events(long_stream)  # kept: a generator dropped early would close the response
        next(events)  # started; then read nothing more (a paused reader on paged)
        waiting = threading.Thread(target=lambda: waiting_answer.update(answer=httpx.post(
            f"{server.url}/generate", timeout=120,
            json={"inputs": "Hello", "parameters": {"max_new_tokens": 3, "adapter_id": "ad1"}})))
        waiting.start()
        busy = scrape_until(server, lambda found: value(found, "tgi_queue_size") >= 1
                            and labelled(found, "tokenmill_lora_requests_info")[0]["waiting_lora_adapters"] == "ad1",
                            timeout=60)
    # leaving the stream cancels it: the waiting request runs
    waiting.join(120)
    assert waiting_answer["answer"].status_code == 200, waiting_answer["answer"].text
    assert value(busy, "tgi_queue_size") == 1 and value(busy, "tgi_batch_current_size") == 1
    assert 0 < value(busy, "tokenmill_kv_cache_usage_ratio") <= 1
    [info] = labelled(busy, "tokenmill_lora_requests_info")
    assert (info["running_lora_adapters"], info["waiting_lora_adapters"]) == ("ad0", "ad1")
    idle = scrape_until(server, lambda found: value(found, "tgi_batch_current_size") == 0
                        and value(found, "tokenmill_kv_cache_usage_ratio") == 0)
    assert value(idle, "tgi_queue_size") == 0 and value(idle, "tgi_batch_current_size") == 0
    assert value(idle, "tokenmill_kv_cache_usage_ratio") == 0


def root_of(collector: Collector, request_id: str, timeout: float = 30.0) -> Any:
    """The root span of the request ``request_id``, once the collector has it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for span in list(collector.spans):
            ids = [kv.value.string_value for kv in span.attributes if kv.key == "request_id"]
            if ids == [request_id]:
                return span
        time.sleep(0.05)
    raise AssertionError(f"no span for {request_id}")


def test_an_incoming_traceparent_is_continued_and_a_malformed_one_starts_a_new_trace(server, trace_collector):
    if trace_collector is None:
        pytest.skip("needs the otlp extra")
    given = {"continued": {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=42"},
             "malformed": {"traceparent": f"00-{CALLER_TRACE.upper()}-{CALLER_SPAN}-01"},
             "garbage": {"traceparent": "not a trace parent"},
             "none": {}}
    with server.client() as client:
        for name, headers in given.items():
            request_id = f"{server.backend}-{name}"
            answer = client.post("/generate", headers={**headers, "X-Request-Id": request_id},
                                 json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
            assert answer.status_code == 200, (name, answer.text)
    continued = root_of(trace_collector, f"{server.backend}-continued")
    assert continued.trace_id.hex() == CALLER_TRACE and continued.parent_span_id.hex() == CALLER_SPAN
    assert continued.trace_state == "vendor=42"
    assert len(trace_collector.children(continued)) == 3  # validation, queue, inference under it
    for name in ("malformed", "garbage", "none"):
        root = root_of(trace_collector, f"{server.backend}-{name}")
        assert not root.parent_span_id, name
        assert root.trace_id.hex() not in (CALLER_TRACE, "0" * 32), name


def test_tracing_continues_a_record_s_traceparent_and_ignores_bad_ones(collector):
    tracing = Tracing.start(collector.url, "svc")
    cases = {"ok": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "zero-trace": f"00-{'0' * 32}-{CALLER_SPAN}-01",
             "short": f"00-{CALLER_TRACE[:-2]}-{CALLER_SPAN}-01", "version-ff": f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01",
             "empty": ""}
    for name, header in cases.items():
        tracing.record_request(RequestRecord(name, name, time.time_ns(), traceparent=header, total_seconds=0.01))
    tracing.shutdown()
    ok = collector.span("ok")
    assert ok.trace_id.hex() == CALLER_TRACE and ok.parent_span_id.hex() == CALLER_SPAN
    for name in cases.keys() - {"ok"}:
        root = collector.span(name)
        assert not root.parent_span_id and root.trace_id.hex() != CALLER_TRACE, name
