"""OpenTelemetry traces (``--otlp-endpoint``): what a real OTLP/HTTP collector receives for finished requests."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from otlp_collector import Collector, attributes

from tokenmill.observability.telemetry import RequestRecord
from tokenmill.observability.tracing import Tracing, TracingUnavailable

MS = 1_000_000  # nanoseconds

NOW = time.time_ns()

SUCCESS = RequestRecord(
    request_id="req-ok", route="generate", started_ns=NOW,
    validation_seconds=0.002, queue_seconds=0.010, inference_seconds=0.250, total_seconds=0.265,
    input_tokens=7, generated_tokens=20, max_new_tokens=32, finish_reason="length",
    parameters={"temperature": 0.7, "do_sample": True, "seed": 42, "stop": ["\n"], "grammar": None,
                "adapter_id": "base"},
)

FAILURE = RequestRecord(
    request_id="req-bad", route="chat_completions", started_ns=NOW + 5 * MS,
    validation_seconds=0.001, queue_seconds=0.0, inference_seconds=0.0, total_seconds=0.001,
    input_tokens=0, max_new_tokens=16, error="`inputs` must not be empty", error_type="validation",
    inputs="a kept prompt",
)


@pytest.fixture
def exported(collector: Collector) -> Collector:
    """The collector after one successful and one failed request were traced and tracing shut down."""
    tracing = Tracing.start(collector.url, "svc")
    tracing.record_request(SUCCESS)
    tracing.record_request(FAILURE)
    tracing.shutdown()  # flushes
    return collector


def test_spans_are_posted_to_v1_traces_as_the_named_service(exported: Collector) -> None:
    assert exported.paths and set(exported.paths) == {"/v1/traces"}
    assert {resource["service.name"] for resource in exported.resources} == {"svc"}


def test_each_request_is_a_root_span_named_after_its_route(exported: Collector) -> None:
    roots = [span for span in exported.spans if not span.parent_span_id]
    assert sorted(span.name for span in roots) == ["chat_completions", "generate"]
    ok, bad = exported.span("generate"), exported.span("chat_completions")
    assert ok.trace_id != bad.trace_id
    assert ok.start_time_unix_nano == NOW
    assert abs(ok.end_time_unix_nano - NOW - 265 * MS) < MS


def test_phases_are_children_laid_end_to_end_from_the_start(exported: Collector) -> None:
    root = exported.span("generate")
    children = exported.children(root)
    assert [child.name for child in children] == ["validation", "queue", "inference"]
    expected_ms = [2, 10, 250]
    begin = root.start_time_unix_nano
    for child, ms in zip(children, expected_ms):
        assert abs(child.start_time_unix_nano - begin) < MS
        assert abs(child.end_time_unix_nano - child.start_time_unix_nano - ms * MS) < MS
        begin = child.end_time_unix_nano
    assert len(exported.children(exported.span("chat_completions"))) == 3
    assert len(exported.spans) == 8


def test_root_span_carries_the_request_attributes(exported: Collector) -> None:
    found = attributes(exported.span("generate").attributes)
    assert found["request_id"] == "req-ok"
    assert found["route"] == "generate"
    assert (found["input_tokens"], found["generated_tokens"], found["max_new_tokens"]) == (7, 20, 32)
    assert (found["gen_ai.usage.input_tokens"], found["gen_ai.usage.output_tokens"]) == (7, 20)
    assert found["finish_reason"] == "length"
    assert found["parameters.temperature"] == pytest.approx(0.7)
    assert found["parameters.do_sample"] is True
    assert found["parameters.seed"] == 42
    assert found["parameters.adapter_id"] == "base"
    assert "parameters.stop" not in found and "parameters.grammar" not in found  # not scalar: skipped
    assert "inputs" not in found  # the record kept no prompt
    assert "error_type" not in found


def test_a_successful_request_has_no_error_status(exported: Collector) -> None:
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    assert exported.span("generate").status.code != Status.STATUS_CODE_ERROR


def test_a_failed_request_has_error_status_message_and_type(exported: Collector) -> None:
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    root = exported.span("chat_completions")
    assert root.status.code == Status.STATUS_CODE_ERROR
    assert root.status.message == "`inputs` must not be empty"
    found = attributes(root.attributes)
    assert found["error_type"] == "validation"
    assert "finish_reason" not in found


def test_the_prompt_is_exported_only_when_the_record_kept_it(exported: Collector) -> None:
    assert attributes(exported.span("chat_completions").attributes)["inputs"] == "a kept prompt"


def exported_names(collector: Collector) -> list[str]:
    return sorted(span.name for span in collector.spans)


def test_an_endpoint_already_ending_in_v1_traces_is_used_as_is(collector: Collector) -> None:
    tracing = Tracing.start(f"{collector.url}/v1/traces/", "svc")
    tracing.record_request(SUCCESS)
    tracing.shutdown()
    assert set(collector.paths) == {"/v1/traces"}
    assert exported_names(collector) == ["generate", "inference", "queue", "validation"]


def test_recording_does_not_wait_for_a_slow_collector(collector: Collector) -> None:
    collector.gate.clear()  # every export now hangs until released
    tracing = Tracing.start(collector.url, "svc")
    began = time.perf_counter()
    for _ in range(200):  # 800 spans: past the 512-span batch, which wakes the export thread
        tracing.record_request(SUCCESS)
    assert time.perf_counter() - began < 1.0
    collector.gate.set()
    tracing.shutdown()
    assert exported_names(collector).count("generate") == 200
    assert len(collector.spans) == 800


def test_shutdown_is_safe_twice_and_later_requests_are_dropped(collector: Collector) -> None:
    tracing = Tracing.start(collector.url, "svc")
    tracing.shutdown()
    tracing.shutdown()
    tracing.record_request(SUCCESS)
    assert collector.spans == []


def test_missing_packages_raise_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(TracingUnavailable, match=r"pip install 'tokenmill\[otlp\]'"):
        Tracing.start("http://127.0.0.1:4318", "tokenmill")


def test_importing_the_module_does_not_import_opentelemetry() -> None:
    code = ("import sys, tokenmill.observability.tracing; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
