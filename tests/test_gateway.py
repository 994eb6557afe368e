"""``tokenmill gateway-config``: two tokenmill servers on different checkpoints behind a real nginx run
with the generated config, routed by ``x-model``; the Envoy output checked for its structure."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from conftest import free_port, start_server, tiny_llama_config

from tokenmill.cli import main
from tokenmill.cli.gateway import GatewayConfigError, parse_listen, parse_models

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def generated(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["gateway-config", *args]) == 0
    return capsys.readouterr().out


# ---- the command line -------------------------------------------------------------------------


def test_models_take_instances_timeouts_and_connection_limits():
    small, big = parse_models(["small=http://127.0.0.1:8001,timeout=30,max-connections=4",
                               "big=10.0.0.2:80", "big=http://10.0.0.3:8080/"])
    assert (small.name, small.timeout_s, small.max_connections, small.upstream) == ("small", 30, 4, "model_small")
    assert [i.address for i in small.instances] == ["127.0.0.1:8001"]
    assert [i.address for i in big.instances] == ["10.0.0.2:80", "10.0.0.3:8080"]
    assert parse_listen("0.0.0.0:8080") == ("0.0.0.0", 8080) and parse_listen(":81") == ("0.0.0.0", 81)


@pytest.mark.parametrize("spec, said", [
    ("small", "expected NAME=URL"),
    ("sm all=http://h:1", "a model name is letters"),
    ("small=https://h:1", "must be http://HOST:PORT"),
    ("small=http://h:1/v1", "must be http://HOST:PORT"),
    ("small=http://h:1,timeout=0", "timeout takes a whole number"),
    ("small=http://h:1,retries=2", "unknown option 'retries'"),
    ("small=http://127.0.0.1;include /tmp/evil.conf;x:1", "must be http://HOST:PORT"),  # no nginx directives
    ("small=http://h:1#x", "must be http://HOST:PORT"),
    ("small=http://user@h:1", "must be http://HOST:PORT"),
    ("small=http://h{x}:1", "must be http://HOST:PORT"),
])
def test_a_bad_model_is_a_clear_error(spec, said):
    with pytest.raises(GatewayConfigError, match=said):
        parse_models([spec])


def test_the_command_exits_2_with_the_reason(capsys):
    assert main(["gateway-config", "--format", "nginx", "--listen", "nowhere", "--model", "a=http://h:1"]) == 2
    assert "--listen 'nowhere': expected HOST:PORT" in capsys.readouterr().err
    injected = "127.0.0.1;include /tmp/evil.conf;listen 1.2.3.4:8080"
    assert main(["gateway-config", "--format", "nginx", "--listen", injected, "--model", "a=http://h:1"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and len(said.err.strip().splitlines()) == 1 and "expected HOST:PORT" in said.err
    assert main(["gateway-config", "--format", "nginx"]) == 2
    assert "give at least one --model" in capsys.readouterr().err


def test_models_take_a_body_limit_and_the_nginx_config_reads_bodies_whole_within_the_servers_deadline(capsys):
    (model,) = parse_models(["small=http://127.0.0.1:8001,max-body=4096"])
    assert model.max_body == 4096 and parse_models(["big=http://h:1"])[0].max_body == 2_000_000
    config = generated(capsys, "--format", "nginx", "--model", "small=http://h:1,max-body=4096",
                       "--model", "big=http://h:2")
    assert "proxy_request_buffering off" not in config, "a slow body must not reach a server's concurrency place"
    assert "client_body_timeout 30s;" in config and "client_header_timeout 30s;" in config
    assert "client_max_body_size 4096;" in config and "client_max_body_size 2000000;" in config
    with pytest.raises(GatewayConfigError, match="max-body takes a whole number"):
        parse_models(["small=http://h:1,max-body=lots"])


def test_the_command_needs_no_model_and_does_not_import_torch():
    probe = ("import sys; from tokenmill.cli import main; "
             "code = main(['gateway-config', '--format', 'envoy', '--listen', ':81', '--model', 'a=http://h:1']); "
             "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stderr.strip() == "0 []" and "clusters:" in done.stdout


def test_the_envoy_bootstrap_has_a_cluster_route_and_timeout_per_model(capsys):
    text = generated(capsys, "--format", "envoy", "--listen", "0.0.0.0:8080",
                     "--model", "small=http://10.0.0.1:80,timeout=30,max-connections=8",
                     "--model", "big=http://10.0.0.2:80", "--model", "big=http://10.0.0.3:80")
    config = yaml.safe_load(text)
    listener, = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 8080}
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    by_model = {route["match"]["headers"][0]["string_match"]["exact"]: route["route"]
                for route in routes if "route" in route}
    assert by_model == {"small": {"cluster": "model_small", "timeout": "0s", "idle_timeout": "30s"},
                        "big": {"cluster": "model_big", "timeout": "0s", "idle_timeout": "600s"}}
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    assert set(clusters) == {"model_small", "model_big"}
    endpoints = [e["endpoint"]["address"]["socket_address"]
                 for e in clusters["model_big"]["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert endpoints == [{"address": "10.0.0.2", "port_value": 80}, {"address": "10.0.0.3", "port_value": 80}]
    assert clusters["model_small"]["circuit_breakers"]["thresholds"][0]["max_requests"] == 8
    unknown = next(route for route in routes if route["name"] == "unknown_model")["direct_response"]
    assert unknown["status"] == 404
    assert json.loads(unknown["body"]["inline_string"])["error"].endswith("serves small, big")
    itself = next(route for route in routes if route["name"] == "gateway_itself")
    assert itself["match"]["path"] == "/" and itself["direct_response"]["status"] == 200
    assert [m.get("status_code") for m in manager["local_reply_config"]["mappers"]] == [429, 502, 504, None]
    too_large = manager["local_reply_config"]["mappers"][-1]
    assert json.loads(too_large["body"]["inline_string"])["error_type"] == "validation"
    buffer, router = manager["http_filters"]
    assert buffer["typed_config"]["max_request_bytes"] == 2_000_000 and router["name"] == "envoy.filters.http.router"
    assert manager["request_headers_timeout"] == manager["request_timeout"] == "30s"
    small = next(route for route in routes if route["name"] == "model_small")
    assert small["typed_per_filter_config"]["envoy.filters.http.buffer"]["buffer"] == {"max_request_bytes": 2_000_000}


# ---- a real nginx in front of two real servers ----------------------------------------------------


@pytest.fixture(scope="module")
def nginx() -> str:
    if NGINX is None:
        pytest.skip("nginx is not installed (apt-get install -y nginx-light; .ci/run installs it)")
    return NGINX


@pytest.fixture(scope="module")
def two_models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two servers on two checkpoints, the tiny model and one of other random weights: their /info model_id and
    their greedy answers differ."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    other = tmp_path_factory.mktemp("other-checkpoint") / "tiny-other"
    torch.manual_seed(1)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)
    logs = tmp_path_factory.mktemp("gateway-servers")
    servers = {}
    try:
        for name, checkpoint in (("first", tiny_model_dir), ("second", other)):
            servers[name] = start_server(["--model-id", str(checkpoint), "--server", "uvicorn",
                                          "--dtype", "float32", "--max-total-tokens", "1024"], logs)
        yield servers, {"first": str(tiny_model_dir), "second": str(other)}
    finally:
        for server in servers.values():
            server.stop()


GATEWAY_MAX_CONNECTIONS = 4
"""Requests in flight to one model that the test gateway lets through."""
GATEWAY_MAX_BODY = 65536


@pytest.fixture(scope="module")
def gateway(nginx: str, two_models, tmp_path_factory: pytest.TempPathFactory):
    servers, _ = two_models
    prefix = tmp_path_factory.mktemp("nginx")
    port = free_port()
    config = prefix / "nginx.conf"
    models = [f"{name}={server.url},timeout=60,max-connections={GATEWAY_MAX_CONNECTIONS},max-body={GATEWAY_MAX_BODY}"
              for name, server in servers.items()]
    config.write_text(render_nginx(port, models))
    process = subprocess.Popen([nginx, "-p", str(prefix), "-c", str(config)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, process, prefix)
        yield url
    finally:
        process.terminate()
        process.wait(20)


def render_nginx(port: int, models: list[str]) -> str:
    flags = [part for model in models for part in ("--model", model)]
    result = subprocess.run([sys.executable, "-m", "tokenmill", "gateway-config", "--format", "nginx",
                             "--listen", f"127.0.0.1:{port}", *flags],
                            capture_output=True, text=True, check=True, timeout=120)
    return result.stdout


def wait_for(url: str, process: subprocess.Popen, prefix: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited: {process.stdout.read().decode() if process.stdout else ''}\n"
                               f"{(prefix / 'error.log').read_text(errors='replace')}")
        try:
            if httpx.get(url + "/", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("nginx did not answer within 30 s")


def test_nginx_runs_in_the_foreground_with_its_files_under_the_prefix(gateway):
    answer = httpx.get(gateway + "/")
    assert answer.status_code == 200 and answer.json() == {"status": "ok", "models": ["first", "second"]}


GREEDY = {"inputs": "Hello there", "parameters": {"max_new_tokens": 12}}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}


def streamed_text(response: httpx.Response) -> str:
    events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    return "".join(event["token"]["text"] for event in events if not event["token"]["special"])


def test_each_header_reaches_its_own_model_on_every_route(gateway, two_models):
    servers, checkpoints = two_models
    direct = {name: httpx.post(server.url + "/generate", json=GREEDY, timeout=60).json()["generated_text"]
              for name, server in servers.items()}
    direct_chat = {name: httpx.post(server.url + "/v1/chat/completions", json={"model": name, **CHAT}, timeout=60)
                   .json()["choices"][0]["message"]["content"] for name, server in servers.items()}
    assert direct["first"] != direct["second"], "the two checkpoints must answer differently to tell them apart"
    with httpx.Client(base_url=gateway, timeout=60) as client:
        for name, checkpoint in checkpoints.items():
            headers = {"x-model": name}
            assert client.get("/info", headers=headers).json()["model_id"] == checkpoint
            assert client.get("/health", headers=headers).status_code == 200
            assert "tgi_request_count" in client.get("/metrics", headers=headers).text
            assert client.post("/generate", headers=headers, json=GREEDY).json()["generated_text"] == direct[name]
            with client.stream("POST", "/generate_stream", headers=headers, json=GREEDY) as response:
                assert streamed_text(response) == direct[name]
            chat = client.post("/v1/chat/completions", headers=headers, json={"model": name, **CHAT})
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == direct_chat[name]


def test_a_stream_passes_event_by_event_not_at_its_end(gateway):
    arrivals = []
    started = time.perf_counter()
    with httpx.stream("POST", gateway + "/generate_stream", headers={"x-model": "first"}, timeout=60, json={
            "inputs": "Once upon a time", "parameters": {"max_new_tokens": 200, "stop": []}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) >= 50
    # Buffered, events land in bursts, a proxy buffer (4-8 KB, some 25 events) at a time; streamed, one by one,
    # each a decode step after the one before.
    apart = sum(1 for before, after in zip(arrivals, arrivals[1:]) if after - before > 0.001)
    assert apart > 0.5 * len(arrivals), (apart, len(arrivals))


@pytest.mark.parametrize("headers, said", [({"x-model": "third"}, "unknown model"), ({}, "no x-model header")])
def test_an_unknown_or_missing_model_is_tgis_json_404_naming_the_known_ones(gateway, headers, said):
    answer = httpx.post(gateway + "/generate", headers=headers, json={"inputs": "Hi"})
    assert answer.status_code == 404 and answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert set(body) == {"error", "error_type"} and said in body["error"] and "first, second" in body["error"]


def request_left_open(gateway: str, model: str) -> socket.socket:
    """A request whose headers have reached the gateway but whose body never ends: in flight until closed."""
    url = httpx.URL(gateway)
    held = socket.create_connection((url.host, url.port), timeout=30)
    held.sendall(f"POST /generate HTTP/1.1\r\nHost: {url.host}\r\nx-model: {model}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
    return held


def answer_when(gateway: str, model: str, until: Callable[[int], bool], seconds: float = 10) -> httpx.Response:
    """The first answer to a short request through the gateway to ``model`` whose status ``until`` accepts,
    asking again until then or until time is up (then the last answer): the gateway counts opened and closed
    requests as it gets to them."""
    deadline = time.monotonic() + seconds
    while True:
        answer = httpx.post(gateway + "/generate", headers={"x-model": model}, json=GREEDY, timeout=60)
        if until(answer.status_code) or time.monotonic() > deadline:
            return answer
        time.sleep(0.2)


def test_a_model_at_its_connection_limit_answers_tgis_json_429_while_the_other_serves(gateway):
    with contextlib.ExitStack() as in_flight:
        for _ in range(GATEWAY_MAX_CONNECTIONS):
            in_flight.enter_context(request_left_open(gateway, "first"))
        over = answer_when(gateway, "first", until=lambda status: status == 429)
        other = httpx.post(gateway + "/generate", headers={"x-model": "second"}, json=GREEDY, timeout=60)
    assert over.status_code == 429 and over.headers["content-type"] == "application/json"
    assert over.json()["error_type"] == "overloaded" and set(over.json()) == {"error", "error_type"}
    assert other.status_code == 200
    after = answer_when(gateway, "first", until=lambda status: status != 429)  # the closed ones gave places back
    assert after.status_code == 200


def test_a_model_that_is_down_answers_a_json_502_while_the_other_serves(gateway, two_models):
    servers, checkpoints = two_models
    servers["second"].stop()
    down = httpx.post(gateway + "/generate", headers={"x-model": "second"}, json={"inputs": "Hi"}, timeout=60)
    assert down.status_code in (502, 503) and down.headers["content-type"] == "application/json"
    assert set(down.json()) == {"error", "error_type"}
    up = httpx.get(gateway + "/info", headers={"x-model": "first"}, timeout=60)
    assert up.status_code == 200 and up.json()["model_id"] == checkpoints["first"]


# ---- the worked example in image/gateway ---------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "image" / "gateway"


def test_the_examples_configs_are_what_example_sh_generates(tmp_path):
    copy = tmp_path / "gateway"
    shutil.copytree(EXAMPLE, copy)
    subprocess.run(["bash", str(copy / "example.sh")], check=True, timeout=120, env={**os.environ,
                   "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    for name in ("nginx.conf", "envoy.yaml"):
        assert (copy / name).read_text() == (EXAMPLE / name).read_text(), f"run image/gateway/example.sh: {name}"


def test_the_example_gateway_deployment_serves_the_generated_config_for_each_models_service():
    documents = [d for d in yaml.safe_load_all((EXAMPLE / "k8s" / "gateway.yaml").read_text()) if d]
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    assert config_map["data"]["nginx.conf"] == (EXAMPLE / "nginx.conf").read_text()
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    nginx, = deployment["spec"]["template"]["spec"]["containers"]
    assert nginx["command"][:5] == ["nginx", "-p", "/var/run/gateway", "-c", "/etc/tokenmill-gateway/nginx.conf"]
    models = [d for d in yaml.safe_load_all((EXAMPLE / "k8s" / "models.yaml").read_text()) if d]
    services = {d["metadata"]["name"] for d in models if d["kind"] == "Service"}
    assert {d["kind"] for d in models} == {"Deployment", "Service", "HorizontalPodAutoscaler"} and len(models) == 9
    upstreams = {line.split("http://")[1].split(":")[0] for line in (EXAMPLE / "example.sh").read_text().splitlines()
                 if "--model " in line}
    assert upstreams == services


def test_a_body_over_the_models_limit_is_tgis_json_413_at_the_gateway(gateway):
    answer = httpx.post(gateway + "/generate", headers={"x-model": "first"},
                        json={"inputs": "x" * (GATEWAY_MAX_BODY + 1)})
    assert answer.status_code == 413 and answer.json()["error_type"] == "validation", answer.text


def test_a_body_sent_slowly_is_held_at_the_gateway_not_in_a_servers_concurrency_place(gateway, two_models):
    servers, _ = two_models
    host, port = gateway.removeprefix("http://").split(":")
    stalled = socket.create_connection((host, int(port)))
    stalled.sendall(b"POST /generate HTTP/1.1\r\nHost: gateway\r\nx-model: first\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    try:
        time.sleep(1)
        metrics = httpx.get(servers["first"].url + "/metrics").text
        assert "tokenmill_requests_in_flight 0.0" in metrics
        assert httpx.post(gateway + "/generate", headers={"x-model": "first"}, json=GREEDY,
                          timeout=60).status_code == 200
    finally:
        stalled.close()
