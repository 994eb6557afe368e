"""What an SRE relies on, against real server processes: readiness, the SIGTERM drain, the container
entrypoint under gunicorn, the API key, CORS, the payload limit, metrics, JSON logs, traces and profiles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningServer, free_port, launch_server, start_server
from otlp_collector import attributes

from tokenmill.http.serve import REPEAT_SECONDS

REPO = Path(__file__).resolve().parent.parent
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CANARY = "zebra canary 7319 says"
"""A prompt that must never show up in the logs unless --log-prompts."""


def stream_slowly(client: httpx.Client, prompt: str, max_new_tokens: int, events: list[dict],
                  started: threading.Event, pause: float = 0.02, headers: dict | None = None) -> None:
    """Read a /generate_stream response one event at a time, slower than the engine writes it."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    with client.stream("POST", "/generate_stream", json=body, headers=headers or {}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                started.set()
                time.sleep(pause)
    started.set()


def start_streams(server: RunningServer, count: int, max_new_tokens: int, headers: dict | None = None
                  ) -> tuple[list[list[dict]], list[threading.Thread]]:
    streams: list[list[dict]] = [[] for _ in range(count)]
    threads = []
    for events in streams:
        started = threading.Event()
        thread = threading.Thread(target=stream_slowly, args=(server.client(), "Once upon a time", max_new_tokens,
                                                              events, started), kwargs={"headers": headers})
        thread.start()
        assert started.wait(60)
        threads.append(thread)
    return streams, threads


def health_statuses_until_ready(server: RunningServer, timeout: float = 120) -> list[int]:
    statuses: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and 200 not in statuses:
        assert server.process.poll() is None, server.log()
        try:
            statuses.append(httpx.get(f"{server.url}/health", timeout=2).status_code)
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return statuses


def wait_until_draining(server: RunningServer, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)


# ---- lifecycle ----------------------------------------------------------------------------------


def test_health_is_503_while_loading_200_when_ready_and_503_while_draining_then_streams_finish_and_exit_is_0(
        tiny_model_dir, tmp_path):
    server = launch_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                     "--stream-buffer-tokens", "2", "--graceful-termination-timeout", "60"], tmp_path)
    try:
        statuses = health_statuses_until_ready(server)
        assert statuses[0] == 503 and statuses[-1] == 200 and set(statuses) == {503, 200}
        streams, threads = start_streams(server, 3, max_new_tokens=400)  # a few seconds of decoding
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with server.client() as client:
            assert client.get("/health").status_code == 503
            refused = client.post("/generate", json={"inputs": "late", "parameters": {"max_new_tokens": 2}})
        assert refused.status_code == 503 and refused.json()["error_type"] == "unhealthy"
        for thread in threads:
            thread.join(120)
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    for events in streams:  # every stream in flight ran to its end
        assert events[-1]["generated_text"] is not None and len(events) == 400
    assert "draining: 3 requests in flight" in server.log()


LONG = 2000
"""New tokens of a request that outlasts a drain: a few seconds on the tiny model, however fast the machine,
since a slow reader cannot hold it back (the sockets' buffers take a whole stream of the tiny model's)."""


def test_requests_still_running_when_the_grace_period_ends_get_a_final_error_event(tiny_model_dir, tmp_path):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "2048",
                           "--stream-buffer-tokens", "2", "--graceful-termination-timeout", "1"], tmp_path)
    whole: list[httpx.Response] = []
    try:
        streams, threads = start_streams(server, 2, max_new_tokens=LONG)
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": LONG}}
        threads.append(threading.Thread(target=lambda: whole.append(server.client().post("/generate", json=body))))
        threads[-1].start()
        time.sleep(0.2)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    for events in streams:
        assert 1 <= len(events) < LONG
        assert events[-1] == {"error": "the server is shutting down", "error_type": "unhealthy"}
    assert whole[0].status_code == 503 and whole[0].json()["error_type"] == "unhealthy"


def test_a_request_still_uploading_when_sigterm_comes_is_served(tiny_model_dir, tmp_path):
    import socket

    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
                           "--graceful-termination-timeout", "30"], tmp_path)
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 3}}).encode()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
            connection.sendall(b"POST /generate HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
            time.sleep(0.5)  # the request has arrived; its body has not
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            connection.sendall(body[10:])
            answer = connection.makefile("rb").read()
        assert server.process.wait(30) == 0
    finally:
        server.stop()
    assert answer.startswith(b"HTTP/1.1 200") and b"generated_text" in answer
    assert b"connection: close" in answer.lower()  # a draining server does not keep the connection
    assert "draining: 1 requests in flight" in server.log()


# gunicorn, the image's server, passes the second signal on to its worker
@pytest.mark.parametrize("server_kind", ["gunicorn", pytest.param("uvicorn", marks=pytest.mark.slow)])
def test_a_second_sigterm_ends_the_requests_in_flight_at_once(tiny_model_dir, tmp_path, server_kind):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", server_kind, "--max-total-tokens", "2048",
                           "--stream-buffer-tokens", "2", "--graceful-termination-timeout", "300"], tmp_path)
    try:
        streams, threads = start_streams(server, 1, max_new_tokens=LONG)
        server.process.send_signal(signal.SIGTERM)
        wait_until_draining(server)  # the first one has been handled (a busy machine may take a while)
        time.sleep(REPEAT_SECONDS + 0.5)  # a deliberate second one, not the first delivered twice
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.process.wait(30) == 0
    finally:
        server.stop()
    events = streams[0]
    assert events[-1].get("error_type") == "unhealthy" and len(events) < LONG, (len(events), events[-1],
                                                                                 server.log()[-4000:])


def test_the_container_entrypoint_maps_env_vars_and_flags_runs_gunicorn_and_drains_on_sigterm(tiny_model_dir,
                                                                                              tmp_path):
    port = free_port()
    env = {**os.environ, "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "1", "MODEL_ID": str(tiny_model_dir),
           "PORT": str(port), "HOSTNAME": "127.0.0.1", "MAX_TOTAL_TOKENS": "256", "API_KEY": KEY,
           "JSON_OUTPUT": "true", "STREAM_BUFFER_TOKENS": "2", "GRACEFUL_TERMINATION_TIMEOUT": "60"}
    log_path = tmp_path / "entrypoint.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(REPO / "image" / "entrypoint.sh"), "--max-batch-size", "3",
                                    "--max-concurrent-requests", "7"],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
    server = RunningServer(process, port, log_path)
    try:
        statuses = health_statuses_until_ready(server)
        assert statuses[-1] == 200
        with server.client() as client:
            info = client.get("/info").json()
            assert (info["max_total_tokens"], info["max_batch_size"], info["max_concurrent_requests"]) == (256, 3, 7)
            assert client.post("/generate", json={"inputs": "hi"}).status_code == 401  # API_KEY reached the server
        streams, threads = start_streams(server, 2, max_new_tokens=200, headers=AUTH)
        process.send_signal(signal.SIGTERM)  # to gunicorn, which passes it to its worker
        for thread in threads:
            thread.join(120)
        assert process.wait(60) == 0
    finally:
        server.stop()
    for events in streams:
        assert events[-1]["generated_text"] is not None and len(events) == 200
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    messages = [r["message"] for r in records]
    assert sum("Booting worker" in m for m in messages) == 1
    assert any("draining: 2 requests in flight" in m for m in messages)


def test_gunicorn_waits_longer_than_the_drain_and_runs_one_draining_worker():
    from tokenmill.config import parse_config
    from tokenmill.http import state as server
    from tokenmill.http.serve import gunicorn_options

    options = gunicorn_options(parse_config(["--graceful-termination-timeout", "45", "--hostname", "::1",
                                             "--port", "8080"]))
    assert options["bind"] == ["[::1]:8080"] and options["workers"] == 1
    assert options["worker_class"] == "tokenmill.http.serve.TokenmillWorker"
    after_the_grace_period = server.ENGINE_STOP_SECONDS + server.ANSWER_SECONDS + 5  # + uvicorn closing connections
    assert options["graceful_timeout"] > 45 + after_the_grace_period


def test_both_servers_keep_an_idle_connection_longer_than_clients_pools_do():
    """Else a client that reuses a pooled connection just as the server closes it gets no answer."""
    from tokenmill.config import parse_config
    from tokenmill.http.serve import gunicorn_options, uvicorn_config

    config = parse_config([])
    assert uvicorn_config(object(), config).timeout_keep_alive == gunicorn_options(config)["keepalive"] == 75
    assert httpx.Limits().keepalive_expiry < 75


def test_bad_settings_in_the_environment_stop_the_entrypoint_with_one_line(tmp_path):
    result = subprocess.run([str(REPO / "image" / "entrypoint.sh")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "MAX_TOTAL_TOKENS": "-5", "PORT": str(free_port())})
    assert result.returncode == 2
    assert "--max-total-tokens must be > 0" in result.stderr


# ---- one server with every operator option on ---------------------------------------------------


@pytest.fixture(scope="module")
def ops_server(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[RunningServer, int]]:
    metrics_port = free_port()
    server = start_server(
        ["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "512",
         "--api-key", KEY, "--cors-allow-origin", "https://app.example,https://admin.example",
         "--payload-limit", "4096", "--json-output", "--enable-profiling", "--prometheus-port", str(metrics_port)],
        tmp_path_factory.mktemp("ops"))
    yield server, metrics_port
    server.stop()


def ask(server: RunningServer, prompt: str = CANARY, headers: dict | None = None, **parameters: Any) -> httpx.Response:
    with server.client() as client:
        return client.post("/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 3, **parameters}},
                           headers=AUTH if headers is None else headers)


def test_generation_routes_want_the_api_key_and_probes_do_not(ops_server):
    server, _ = ops_server
    counted = value(scrape(f"{server.url}/metrics"), "tgi_request_count")
    assert ask(server, headers={}).status_code == 401
    wrong = ask(server, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error_type"] == "authentication"
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert value(scrape(f"{server.url}/metrics"), "tgi_request_count") == counted  # refused before counting
    assert ask(server).status_code == 200
    with server.client() as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
        assert client.post("/tokenize", json={"inputs": "hi"}).status_code == 401
        for path in ("/health", "/info", "/metrics"):
            assert client.get(path).status_code == 200


def test_cors_answers_allowed_origins_only(ops_server):
    server, _ = ops_server
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with server.client() as client:
        answer = client.options("/generate", headers=preflight)
        assert answer.status_code == 200  # no API key on a preflight
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in answer.headers["access-control-allow-methods"]
        assert "authorization" in answer.headers["access-control-allow-headers"]
        stranger = client.options("/generate", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in stranger.headers
    denied = ask(server, headers={"Origin": "https://admin.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://admin.example"


def test_a_body_over_the_payload_limit_is_413(ops_server):
    server, _ = ops_server
    answer = ask(server, prompt="x " * 3000)
    assert answer.status_code == 413 and answer.json()["error_type"] == "validation"


def test_responses_carry_the_request_id_and_tgi_timing_headers(ops_server):
    server, _ = ops_server
    answer = ask(server, headers={**AUTH, "X-Request-Id": "client-chosen-42"})
    assert answer.headers["x-request-id"] == "client-chosen-42"
    for name in ("x-compute-time", "x-total-time", "x-validation-time", "x-queue-time", "x-inference-time",
                 "x-time-per-token", "x-prompt-tokens", "x-generated-tokens"):
        assert name in answer.headers
    assert answer.headers["x-generated-tokens"] == "3"
    assert len(ask(server).headers["x-request-id"]) == 32  # made up when the client sends none


def scrape(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], name: str, sample: str | None = None, **labels: str) -> float:
    family = families[name]
    wanted = sample or family.samples[0].name
    return sum(s.value for s in family.samples if s.name == wanted and all(s.labels.get(k) == v
                                                                           for k, v in labels.items()))


def test_metrics_parse_and_move_as_requests_pass(ops_server):
    server, metrics_port = ops_server
    before = scrape(f"{server.url}/metrics")
    assert ask(server).status_code == 200 and ask(server).status_code == 200
    assert ask(server, temperature=-1).status_code == 422
    after = scrape(f"{server.url}/metrics")
    moved = {name: value(after, name) - value(before, name)
             for name in ("tgi_request_count", "tgi_request_success")}
    assert moved == {"tgi_request_count": 3, "tgi_request_success": 2}
    assert value(after, "tgi_request_failure", err="validation") - value(before, "tgi_request_failure",
                                                                          err="validation") == 1
    assert value(after, "tgi_request_duration", "tgi_request_duration_count") - value(
        before, "tgi_request_duration", "tgi_request_duration_count") == 2
    assert value(after, "tgi_request_generated_tokens", "tgi_request_generated_tokens_sum") - value(
        before, "tgi_request_generated_tokens", "tgi_request_generated_tokens_sum") == 6
    assert value(after, "tgi_batch_inference_count", method="decode") > value(before, "tgi_batch_inference_count",
                                                                              method="decode")
    buckets = [s.labels["le"] for s in after["tgi_request_duration"].samples if s.name.endswith("_bucket")]
    assert len(buckets) == 36 and float(buckets[0]) == pytest.approx(0.00015)  # TGI's 35 buckets, then +Inf
    for name in ("tgi_queue_size", "tgi_batch_current_size", "tgi_batch_current_max_tokens"):
        assert after[name].type == "gauge"
    on_its_port = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    assert value(on_its_port, "tgi_request_count") >= value(after, "tgi_request_count")


def test_json_logs_are_json_with_a_request_id_and_never_the_prompt(ops_server):
    server, _ = ops_server
    assert ask(server, headers={**AUTH, "X-Request-Id": "log-check-1"}).status_code == 200
    time.sleep(0.2)
    lines = [line for line in server.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is JSON
    mine = [r for r in records if r.get("request_id") == "log-check-1"]
    assert any(r["message"].startswith("generate succeeded") and r["fields"]["generated_tokens"] == 3 for r in mine)
    assert not any(CANARY in line for line in lines)
    assert any(r["message"].startswith("load stage warm-up:") for r in records)  # load stages with durations


def test_debug_profile_returns_a_flame_graph_behind_the_api_key(ops_server):
    server, _ = ops_server
    with server.client() as client:
        assert client.get("/debug/profile", params={"seconds": 1}).status_code == 401
        assert client.get("/debug/profile", params={"seconds": 0}, headers=AUTH).status_code == 422
        answer = client.get("/debug/profile", params={"seconds": 1}, headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "image/svg+xml" and b"<svg" in answer.content[:500]


@pytest.mark.slow
def test_profiling_is_off_unless_enabled_and_prompts_are_logged_only_when_asked(tiny_model_dir, tmp_path):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "256",
                           "--log-prompts"], tmp_path)
    try:
        with server.client() as client:
            assert client.get("/debug/profile").status_code == 404
        assert ask(server, headers={}).status_code == 200
    finally:
        server.stop()
    assert CANARY in server.log()


@pytest.mark.slow
def test_requests_are_traced_to_the_otlp_collector(tiny_model_dir, tmp_path, collector):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "256",
                           "--otlp-endpoint", collector.url, "--otlp-service-name", "tokenmill-test"], tmp_path)
    try:
        answer = ask(server, headers={"X-Request-Id": "traced-1"})
        assert answer.status_code == 200
    finally:
        server.stop()  # shutting down flushes the spans
    root = collector.span("generate")
    assert attributes(root.attributes)["request_id"] == "traced-1"
    assert [span.name for span in collector.children(root)] == ["validation", "queue", "inference"]
    assert {resource["service.name"] for resource in collector.resources} == {"tokenmill-test"}
    assert "inputs" not in attributes(root.attributes)
