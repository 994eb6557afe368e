"""Plugins in a running server: an entry-point plugin's processor and route, and its failures kept to one request."""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import start_server

PLUGIN = textwrap.dedent('''
    import falcon
    import tokenmill

    @tokenmill.hookimpl
    def tokenmill_logits_processors(parameters):
        if not parameters.get("explode_after"):
            return []
        limit = parameters["explode_after"]
        generated = []

        def explode(token_ids, scores):
            generated.append(token_ids[-1])
            if len(generated) > limit:
                raise RuntimeError("processor exploded")
            return scores

        return [explode]

    @tokenmill.hookimpl
    def tokenmill_request_started(request_id, inputs, parameters):
        if request_id.startswith("observer-explodes"):
            raise RuntimeError("the audit log is down")

    @tokenmill.hookimpl
    def tokenmill_request_finished(request_id, finish_reason, generated_tokens, error):
        if request_id.startswith("observer-explodes"):
            raise RuntimeError("the billing service is down")

    class Ping:
        async def on_get(self, req, resp):
            resp.media = {"pong": True, "ready": self.state.engine is not None}

    @tokenmill.hookimpl
    def tokenmill_add_routes(app, server):
        ping = Ping()
        ping.state = server
        app.add_route("/ping", ping)
''')


@pytest.fixture(scope="module")
def plugin_server(tiny_model_dir, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    (site / "exploding_plugin.py").write_text(PLUGIN)
    dist = site / "exploding_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: exploding-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tokenmill]\nexploding = exploding_plugin\n")
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--json-output"],
                          tmp_path_factory.mktemp("plugin-server"),
                          env={"PYTHONPATH": str(site), "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD": "0"})
    yield server
    server.stop()


def test_a_route_added_by_an_entry_point_plugin_answers(plugin_server):
    with plugin_server.client() as client:
        assert client.get("/ping").json() == {"pong": True, "ready": True}


def test_a_failing_processor_is_424_for_its_request_only(plugin_server):
    with plugin_server.client() as client:
        with client.stream("POST", "/generate_stream",
                           json={"inputs": "Hello there", "parameters": {"max_new_tokens": 40}}) as healthy:
            lines = healthy.iter_lines()
            first = next(lines)
            failed = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 20,
                                                                                     "explode_after": 3}})
            rest = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert failed.status_code == 424
        assert failed.json()["error_type"] == "generation" and "processor exploded" in failed.json()["error"]
        assert first.startswith("data:") and rest[-1]["index"] == 40 and rest[-1]["generated_text"]

        with client.stream("POST", "/generate_stream", json={"inputs": "Hello", "parameters": {
                "max_new_tokens": 20, "explode_after": 2}}) as stream:
            events = [json.loads(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
        assert [e.get("index") for e in events[:-1]] == [1, 2]
        assert events[-1]["error_type"] == "generation" and "processor exploded" in events[-1]["error"]
        assert client.post("/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_json_output_logs_json_lines(plugin_server):
    lines = [line for line in plugin_server.log().splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]
    assert any(r["message"].startswith("ready:") for r in records)
    assert any("objects kept out of garbage collection" in r["message"] for r in records)
    assert all({"timestamp", "level", "target", "message"} <= set(r) for r in records)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_an_observer_hook_that_raises_leaves_the_response_intact(plugin_server, path):
    body = ({"inputs": "Hello", "parameters": {"max_new_tokens": 3}} if path == "/generate"
            else {"model": "tgi", "prompt": "Hello", "max_tokens": 3})
    with plugin_server.client() as client:
        whole = client.post(path, json=body, headers={"X-Request-Id": "observer-explodes-1"})
        stream_path = "/generate_stream" if path == "/generate" else path
        with client.stream("POST", stream_path, json={**body, "stream": True},
                           headers={"X-Request-Id": "observer-explodes-2"}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert whole.status_code == 200, whole.text
    assert stream.status_code == 200 and lines
    if path == "/generate":
        assert json.loads(lines[-1][5:])["generated_text"] is not None
    else:
        assert lines[-1] == "data: [DONE]"
    assert plugin_server.log().count("hook tokenmill_request_finished raised") == 1  # logged once, not per request

