"""Work per request is bounded where the client chooses it: its concurrency place is taken before it
is read, stop sequences, tools, top log-probabilities and JSON nesting have limits (a 422 that
names the limit), and none of it runs on the event loop."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import RunningServer, start_server

from tokenmill.http.body import MAX_JSON_DEPTH
from tokenmill.http.openai.schemas import MAX_TOOLS
from tokenmill.http.tgi.schemas import MAX_STOP_CHARACTERS

BODY_SECONDS = 2


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[RunningServer]:
    running = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--max-total-tokens", "1024",
                            "--max-top-n-tokens", "2", "--max-concurrent-requests", "2", "--stream-buffer-tokens",
                            "4", "--backend", "paged", "--body-read-timeout", str(BODY_SECONDS)],
                           tmp_path_factory.mktemp("bounds"))
    yield running
    running.stop()


def error_of(answer: httpx.Response) -> str:
    assert answer.status_code == 422, answer.text
    assert set(answer.json()) == {"error", "error_type"} and answer.json()["error_type"] == "validation"
    return answer.json()["error"]


def test_a_stop_sequence_longer_than_the_limit_is_a_422(server):
    with server.client() as client:
        answer = client.post("/generate", json={"inputs": "Hi", "parameters": {"stop": ["x" * 500_000]}})
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "stop": "y" * (MAX_STOP_CHARACTERS + 1)})
        fits = client.post("/generate", json={"inputs": "Hi", "parameters": {
            "stop": ["z" * MAX_STOP_CHARACTERS], "max_new_tokens": 3}})
    assert f"`stop[0]` must be a string of 1 to {MAX_STOP_CHARACTERS} characters" in error_of(answer)
    assert f"1 to {MAX_STOP_CHARACTERS} characters" in error_of(chat)
    assert fits.status_code == 200, fits.text


def test_a_long_stop_sequence_streams_without_holding_the_event_loop(server):
    """The holdback of OpenAI streams is counted by the engine: /health answers while it streams."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": ["q" * MAX_STOP_CHARACTERS],
            "max_tokens": 60, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert client.get("/health").status_code == 200
    assert lines[-1] == "data: [DONE]"


def test_too_many_tools_is_a_422_that_names_the_limit(server):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
             for i in range(MAX_TOOLS + 1)]
    with server.client() as client:
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "tools": tools})
    assert f"`tools` must hold at most {MAX_TOOLS} item(s)" in error_of(answer)


def test_openai_log_probabilities_obey_max_top_n_tokens(server):
    messages = [{"role": "user", "content": "Hi"}]
    with server.client() as client:
        chat = client.post("/v1/chat/completions", json={"messages": messages, "logprobs": True,
                                                          "top_logprobs": 3, "max_tokens": 2})
        completion = client.post("/v1/completions", json={"prompt": "Hi", "logprobs": 3, "max_tokens": 2})
        allowed = client.post("/v1/chat/completions", json={"messages": messages, "logprobs": True,
                                                             "top_logprobs": 2, "max_tokens": 2})
    assert "between 0 and 2 (--max-top-n-tokens)" in error_of(chat)
    assert "between 0 and 2 (--max-top-n-tokens)" in error_of(completion)
    assert allowed.status_code == 200
    assert len(allowed.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_deeply_nested_json_is_a_422_not_a_crash(server, route):
    deep = b"[" * 60_000 + b"]" * 60_000  # under the count of values a body may hold
    nested = {"inputs": "Hi", "parameters": {"grammar": {"type": "json", "value": {}}}}
    value = nested["parameters"]["grammar"]["value"]
    for _ in range(MAX_JSON_DEPTH):
        value["items"] = {}
        value = value["items"]
    with server.client() as client:
        raw = client.post(route, content=deep, headers={"Content-Type": "application/json"})
        parsed = client.post(route, json=nested)
        assert client.get("/health").status_code == 200
    assert "nests deeper than" in error_of(raw)
    assert "nests deeper than" in error_of(parsed)
    assert "Traceback" not in raw.text + parsed.text


def test_the_concurrency_place_is_taken_before_the_request_is_validated(server):
    """As TGI takes its permit first: with every place held, even an invalid request gets 429."""
    started = threading.Barrier(3)

    def hold() -> None:
        with server.client() as client, client.stream("POST", "/generate_stream", json={
                "inputs": "Hi", "parameters": {"max_new_tokens": 200}}) as stream:
            lines = stream.iter_lines()
            next(lines)
            started.wait(timeout=60)
            started.wait(timeout=60)  # hold the place, unread, until the checks are done

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)
    try:
        with server.client() as client:
            invalid = client.post("/generate", json={"inputs": "Hi", "parameters": {"temperature": -1}})
            chat = client.post("/v1/chat/completions", json={"messages": "not a list"})
    finally:
        started.wait(timeout=60)
        for thread in threads:
            thread.join(60)
    assert invalid.status_code == 429 and invalid.json()["error_type"] == "overloaded"
    assert chat.status_code == 429
    with server.client() as client:  # both places came back
        assert client.post("/generate", json={"inputs": "Hi", "parameters": {"temperature": -1}}).status_code == 422


@pytest.mark.parametrize("route, body", [
    ("/generate", b'{"inputs": "\\ud800 lone", "parameters": {"max_new_tokens": 2}}'),
    ("/v1/completions", b'{"prompt": "hi \\udfff", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}'),
])
def test_a_lone_surrogate_escape_is_a_422_not_a_crash(server, route, body):
    """JSON may escape half of a UTF-16 pair; such a string is no Unicode text, and no tokenizer takes it."""
    with server.client() as client:
        answer = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert "lone UTF-16 surrogate" in error_of(answer)


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/tokenize"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_a_415(server, route, content_type):
    body = b'{"inputs": "Hi", "prompt": "Hi", "parameters": {"max_new_tokens": 2}, "max_tokens": 2}'
    headers = {"Content-Type": content_type} if content_type else {}
    with server.client() as client:
        answer = client.post(route, content=body, headers=headers)  # what a web page's "no-cors" POST can send
        typed = client.post(route, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert answer.status_code == 415 and "Content-Type: application/json" in answer.json()["error"]
    assert set(answer.json()) == {"error", "error_type"}
    assert typed.status_code == 200, typed.text


def test_a_post_without_a_body_or_a_type_is_the_422_of_a_missing_object(server):
    with server.client() as client:  # as schemathesis sends it: TGI's spec documents 422 here, not 415
        assert "must be a JSON object" in error_of(client.post("/generate"))


def stalled_body(url: str, path: str = "/generate") -> socket.socket:
    """A connection that sends a POST's headers and one byte of its body, then nothing."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    connection = socket.create_connection((host, int(port)))
    connection.sendall(f"POST {path} HTTP/1.1\r\nHost: tokenmill\r\nContent-Type: application/json\r\n"
                       "Content-Length: 1000000\r\n\r\n{".encode())
    return connection


@pytest.mark.parametrize("path", ["/tokenize", "/chat_tokenize", "/detokenize", "/invocations"])
def test_every_route_that_reads_a_body_holds_a_concurrency_place_while_it_does(server, path):
    stalled = [stalled_body(server.url, path) for _ in range(2)]  # --max-concurrent-requests 2
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}
    try:
        time.sleep(0.5)
        with server.client() as client:
            assert client.post("/generate", json=body).status_code == 429
            assert client.post("/tokenize", json={"inputs": "Hi"}).status_code == 429
            assert [connection.recv(200).split(b" ", 2)[1] for connection in stalled] == [b"408"] * 2
            assert client.post("/generate", json=body).status_code == 200
    finally:
        for connection in stalled:
            connection.close()


def test_clients_that_send_their_bodies_slowly_hold_no_slot_past_the_body_timeout(server):
    stalled = [stalled_body(server.url) for _ in range(2 + 8)]  # --max-concurrent-requests 2, and 8 more
    started = time.monotonic()
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    try:
        with server.client() as client:
            while (answer := client.post("/generate", json=body)).status_code != 200:
                assert answer.status_code == 429, answer.text
                assert time.monotonic() - started < BODY_SECONDS + 30, "the stalled bodies kept their slots"
                time.sleep(0.1)
            waited = time.monotonic() - started
            firsts = [connection.recv(200).split(b" ", 2)[1] for connection in stalled]
            both = [client.post("/generate", json=body).status_code for _ in range(2)]
    finally:
        for connection in stalled:
            connection.close()
    assert waited < BODY_SECONDS + 30 and set(firsts) <= {b"408", b"429"} and firsts.count(b"408") >= 2
    assert both == [200, 200]


def test_large_bodies_are_parsed_off_the_event_loop_so_health_answers_throughout(tiny_server):
    body = json.dumps({"model": "tiny", "prompt": [[1]] * 390_000, "max_tokens": 1}).encode()  # 1.95 MB of ids
    answers: list[int] = []

    def send() -> None:  # encoded once, above: the senders hold no lock the probe below would wait for
        answers.append(httpx.post(f"{tiny_server.url}/v1/completions", content=body, timeout=120,
                                  headers={"Content-Type": "application/json"}).status_code)

    senders = [threading.Thread(target=send) for _ in range(8)]
    for sender in senders:
        sender.start()
    slowest = 0.0
    with tiny_server.client() as client:
        while any(sender.is_alive() for sender in senders):
            started = time.monotonic()
            assert client.get("/health", timeout=10).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.05)
    assert answers == [422] * 8  # too many prompts, said without decoding them all first or not
    assert slowest < 1.0, f"/health took {slowest:.2f} s while the bodies were read"


@pytest.mark.parametrize("parameters", [None, "fast", [1]])
def test_parameters_of_the_wrong_type_are_a_422_with_or_without_a_priority_header(server, parameters):
    with server.client() as client:
        for headers in ({}, {"X-Priority": "high"}):
            answer = client.post("/generate", json={"inputs": "Hi", "parameters": parameters}, headers=headers)
            assert "parameters" in error_of(answer)



def closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``connection`` within ``seconds`` (reading whatever it sends first)."""
    connection.settimeout(seconds)
    try:
        while connection.recv(4096):
            pass
        return True
    except TimeoutError:
        return False


def test_clients_that_send_their_headers_slowly_are_closed_at_the_deadline(server):
    """The header phase has the body's deadline: a connection that sends nothing, half a request, or
    half of a second request after a first one, is closed; the one that finished its headers is not."""
    host, port = server.url.removeprefix("http://").split(":")
    silent = socket.create_connection((host, int(port)))
    partial = socket.create_connection((host, int(port)))
    partial.sendall(b"POST /generate HTTP/1.1\r\nHost: tokenmill\r\n")
    kept_alive = socket.create_connection((host, int(port)))
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: tokenmill\r\n\r\n")
    assert kept_alive.recv(4096).startswith(b"HTTP/1.1 200")
    kept_alive.sendall(b"GET /health HTTP/1.1\r\n")
    started = time.monotonic()
    try:
        for connection in (silent, partial, kept_alive):
            assert closed_within(connection, BODY_SECONDS + 10)
        assert time.monotonic() - started >= BODY_SECONDS - 0.5
    finally:
        for connection in (silent, partial, kept_alive):
            connection.close()
    with server.client() as client:
        assert client.get("/health").status_code == 200


def test_a_log_line_escapes_client_text_and_caps_each_field(server):
    """A client's text cannot end a log line (forging another) nor make one megabytes long."""
    with server.client() as client:
        answer = client.post("/generate", json={
            "inputs": "Hi", "parameters": {"max_new_tokens": 1, "junk": "\nFORGED" + "x" * 100_000}})
    assert answer.status_code == 200
    lines = server.log().splitlines()
    assert any("generate succeeded" in line and "FORGEDxxxx" in line for line in lines), lines[-5:]
    assert not any(line.startswith("FORGED") for line in lines)
    assert all(len(line) < 8 * 1024 for line in lines), max(len(line) for line in lines)


def test_log_formatters_escape_control_characters_and_cap_fields():
    import logging

    from tokenmill.observability.logs import MAX_FIELD_CHARS, JsonFormatter, PlainFormatter

    record = logging.LogRecord("tokenmill", logging.INFO, __file__, 1, "failed: %s", ("bad\nFORGED\r\x1b[31m",),
                               None)
    record.fields = {"parameters": {"stop": ["y" * 10_000]}, "route": "generate"}
    plain = PlainFormatter().format(record)
    assert "\n" not in plain and "\r" not in plain and "\x1b" not in plain and "bad\\nFORGED" in plain
    assert len(plain) < 2 * MAX_FIELD_CHARS + 200 and 'route="generate"' in plain
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "failed: bad\nFORGED\r\x1b[31m"  # JSON escapes it in the line itself
    assert len(entry["fields"]["parameters"]) < MAX_FIELD_CHARS + 50 and entry["fields"]["route"] == "generate"
