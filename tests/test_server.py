"""The HTTP API over a real server on loopback: TGI's routes, shapes, errors and concurrency."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import start_server
from engine_helpers import PROMPTS, reference_greedy


def reference(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    return reference_greedy(model, tokenizer, prompt, max_new_tokens, eos_token_id=2)


def generate(client: httpx.Client, prompt: str, **parameters) -> httpx.Response:
    return client.post("/generate", json={"inputs": prompt, "parameters": parameters})


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_greedy_output_equals_model_generate(tiny_server, tiny_model):
    model, tokenizer = tiny_model
    with tiny_server.client() as client:
        body = generate(client, PROMPTS[1], max_new_tokens=20, details=True).json()
    ids = [t["id"] for t in body["details"]["tokens"]]
    assert ids == reference(model, tokenizer, PROMPTS[1], 20)
    assert body["generated_text"] == tokenizer.decode(ids, skip_special_tokens=True)


def test_eight_concurrent_requests_of_different_lengths_equal_model_generate(tiny_server, tiny_model):
    model, tokenizer = tiny_model
    lengths = [40, 25, 60, 33, 50, 20, 45, 30]

    def one(index: int) -> list[int]:
        time.sleep(0.03 * (index % 4) + (0.15 if index >= 4 else 0))  # the second half joins mid-batch
        with tiny_server.client() as client:
            response = generate(client, PROMPTS[index], max_new_tokens=lengths[index], details=True)
        assert response.status_code == 200, response.text
        return [t["id"] for t in response.json()["details"]["tokens"]]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for prompt, length, ids in zip(PROMPTS, lengths, results):
        assert ids == reference(model, tokenizer, prompt, length), prompt


def test_details_shape_follows_tgi(tiny_server):
    with tiny_server.client() as client:
        response = generate(client, PROMPTS[2], max_new_tokens=5, details=True, decoder_input_details=True,
                            top_n_tokens=3)
    body = response.json()
    details = body["details"]
    assert set(details) >= {"finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens"}
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5 and details["seed"] is None
    assert details["prefill"][0]["logprob"] is None and all(p["logprob"] < 0 for p in details["prefill"][1:])
    assert all(set(t) == {"id", "text", "logprob", "special"} for t in details["tokens"])
    assert len(details["top_tokens"]) == 5 and all(len(step) == 3 for step in details["top_tokens"])
    assert details["top_tokens"][0][0]["id"] == details["tokens"][0]["id"]
    assert "".join(t["text"] for t in details["tokens"]) == body["generated_text"]
    for header in ("x-compute-time", "x-total-time", "x-validation-time", "x-queue-time", "x-inference-time",
                   "x-time-per-token", "x-prompt-tokens", "x-generated-tokens"):
        assert header in response.headers
    assert response.headers["x-generated-tokens"] == "5"


def test_without_details_only_the_text_comes_back(tiny_server):
    with tiny_server.client() as client:
        assert set(generate(client, "Hi", max_new_tokens=3).json()) == {"generated_text"}


def test_return_full_text_prepends_the_prompt(tiny_server):
    with tiny_server.client() as client:
        plain = generate(client, PROMPTS[4], max_new_tokens=4).json()["generated_text"]
        full = generate(client, PROMPTS[4], max_new_tokens=4, return_full_text=True).json()["generated_text"]
    assert full == PROMPTS[4] + plain


def test_truncate_keeps_the_last_tokens(tiny_server, tiny_model):
    _, tokenizer = tiny_model
    with tiny_server.client() as client:
        body = generate(client, PROMPTS[6], max_new_tokens=2, truncate=3, details=True,
                        decoder_input_details=True).json()
    assert [p["id"] for p in body["details"]["prefill"]] == tokenizer(PROMPTS[6])["input_ids"][-3:]


def test_sampling_with_a_seed_is_reproducible_and_reports_the_seed(tiny_server):
    params = {"max_new_tokens": 10, "do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 40,
              "typical_p": 0.95, "repetition_penalty": 1.1, "frequency_penalty": 0.2, "seed": 42, "details": True}
    with tiny_server.client() as client:
        first, second = (generate(client, PROMPTS[2], **params).json() for _ in range(2))
    assert first["generated_text"] == second["generated_text"]
    assert first["details"]["seed"] == 42


def test_best_of_returns_the_most_likely_sequence_and_the_others(tiny_server):
    with tiny_server.client() as client:
        body = generate(client, PROMPTS[0], max_new_tokens=6, best_of=2, do_sample=True, details=True).json()
    details = body["details"]
    others = details["best_of_sequences"]
    assert len(others) == 1
    best_sum = sum(t["logprob"] for t in details["tokens"])
    assert best_sum >= sum(t["logprob"] for t in others[0]["tokens"])


def test_stream_events_parse_and_concatenate_to_the_final_text(tiny_server):
    with tiny_server.client() as client:
        with client.stream("POST", "/generate_stream",
                           json={"inputs": PROMPTS[3], "parameters": {"max_new_tokens": 12, "details": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
        non_stream = generate(client, PROMPTS[3], max_new_tokens=12).json()["generated_text"]
    assert [e["index"] for e in events] == list(range(1, 13))
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    final = events[-1]
    assert final["details"]["finish_reason"] == "length" and final["details"]["generated_tokens"] == 12
    assert final["details"]["input_length"] > 0
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert text == final["generated_text"] == non_stream


def test_compat_route_dispatches_on_stream(tiny_server):
    with tiny_server.client() as client:
        listed = client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 3}}).json()
        assert isinstance(listed, list) and set(listed[0]) == {"generated_text"}
        with client.stream("POST", "/", json={"inputs": "Hi", "stream": True,
                                              "parameters": {"max_new_tokens": 3}}) as r:
            assert len(sse_events(r)) == 3


def test_compat_route_stream_must_be_a_boolean(tiny_server):
    """Found by .ci/fuzz: ``"stream": "false"`` (or {}) was read as true and streamed."""
    with tiny_server.client() as client:
        for stream in ("false", {}, None, 1):
            response = client.post("/", json={"inputs": "Hi", "stream": stream, "parameters": {"max_new_tokens": 2}})
            assert response.status_code == 422 and "`stream`" in response.json()["error"], stream


def test_the_smallest_temperature_and_repetition_penalty_still_generate(tiny_server):
    """Found by .ci/fuzz: 5e-324 (0 in float32) made the scores inf or NaN and failed the sequence."""
    with tiny_server.client() as client:
        with client.stream("POST", "/generate_stream", json={"inputs": "Hi", "parameters": {
                "max_new_tokens": 3, "temperature": 5e-324}}) as r:
            events = sse_events(r)
        assert [e.get("index") for e in events] == [1, 2, 3], events
        penalized = generate(client, "Hi Hi Hi", max_new_tokens=3, repetition_penalty=5e-324, do_sample=True,
                             details=True)
        assert penalized.status_code == 200, penalized.text
        assert all(t["logprob"] <= 0 for t in penalized.json()["details"]["tokens"])


def test_tokenize_returns_ids_and_offsets(tiny_server, tiny_model):
    _, tokenizer = tiny_model
    with tiny_server.client() as client:
        tokens = client.post("/tokenize", json={"inputs": "Hello world"}).json()
    assert [t["id"] for t in tokens] == tokenizer("Hello world")["input_ids"]
    assert "".join(t["text"] for t in tokens) == "Hello world"
    assert tokens[1]["start"] == 5 and tokens[1]["stop"] == 11


def test_health_info_and_metrics(tiny_server):
    with tiny_server.client() as client:
        assert client.get("/health").status_code == 200
        info = client.get("/info").json()
        metrics = client.get("/metrics").text
    assert info["max_input_tokens"] == 512 and info["max_total_tokens"] == 1024
    assert info["router"] == "tokenmill" and info["backend"] == tiny_server.backend
    assert info["model_dtype"] == "float32" and info["attention"] == "sdpa"
    assert [s["stage"] for s in info["load_stages"]] == ["resolving", "loading weights", "packing weights",
                                                         "warm-up"]
    assert all(s["seconds"] >= 0 for s in info["load_stages"])
    assert "/" not in " ".join(s["detail"] for s in info["load_stages"]), "/info tells where files are"
    assert "tgi_queue_size 0" in metrics and "tgi_batch_current_size 0" in metrics
    if tiny_server.backend == "paged":
        assert info["kv_allocator"] == "paged" and info["block_size"] == 16
        assert info["kv"]["blocks_used"] == 0 and info["kv"]["blocks_total"] > 0
        assert "tokenmill_kv_blocks_used 0" in metrics
        assert f"tokenmill_kv_blocks_free {info['kv']['blocks_total']}" in metrics
    else:
        assert info["kv_allocator"] == "dynamic" and info["block_size"] is None


INVALID = [
    ({"temperature": 0}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.0}, "top_p"),
    ({"typical_p": 1.5}, "typical_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 5000}, "max_new_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"top_n_tokens": 6}, "top_n_tokens"),
    ({"best_of": 3, "do_sample": True}, "best_of"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "seed"),
    ({"truncate": 0}, "truncate"),
    ({"truncate": 100000}, "truncate"),
    ({"temperature": "hot"}, "temperature"),
    ({"watermark": "yes"}, "watermark"),
    ({"grammar": {"type": "regex"}}, "grammar"),
    ({"grammar": {"type": "xml", "value": "<a/>"}}, "grammar.type"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
]


@pytest.mark.parametrize("parameters, named", INVALID)
def test_invalid_parameters_are_422_naming_the_parameter(tiny_server, parameters, named):
    with tiny_server.client() as client:
        response = generate(client, "Hello", **parameters)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_type"] == "validation" and f"`{named}`" in body["error"]


@pytest.mark.parametrize("body, named", [
    ({"inputs": ""}, "inputs"),
    ({"parameters": {}}, "inputs"),
    ({"inputs": 42}, "inputs"),
    ({"inputs": "word " * 600, "parameters": {"max_new_tokens": 1}}, "inputs"),
    ({"inputs": "Hi", "parameters": "fast"}, "parameters"),
    ({"inputs": "Hi", "parameters": []}, "parameters"),
    # Null where TGI's GenerateRequest has no Option (found by .ci/fuzz): TGI answers 422, and so do we.
    ({"inputs": "Hi", "parameters": None}, "parameters"),
    ({"inputs": "Hi", "parameters": {"details": None}}, "details"),
    ({"inputs": "Hi", "parameters": {"stop": None}}, "stop"),
])
def test_invalid_bodies_are_422(tiny_server, body, named):
    with tiny_server.client() as client:
        response = client.post("/generate", json=body)
    assert response.status_code == 422 and named in response.json()["error"]


def test_stream_only_rules_are_422(tiny_server):
    with tiny_server.client() as client:
        for params, named in (({"decoder_input_details": True}, "decoder_input_details"),
                              ({"best_of": 2, "do_sample": True}, "best_of")):
            response = client.post("/generate_stream", json={"inputs": "Hi", "parameters": params})
            assert response.status_code == 422 and named in response.json()["error"]


def test_malformed_json_is_422_and_oversized_body_is_413(tiny_server):
    with tiny_server.client() as client:
        bad = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 422 and bad.json()["error_type"] == "validation"
        for constant in (b"NaN", b"Infinity", b"-Infinity"):
            body = b'{"inputs": "Hi", "parameters": {"repetition_penalty": ' + constant + b"}}"
            response = client.post("/generate", content=body, headers={"content-type": "application/json"})
            assert response.status_code == 422, constant
        huge = client.post("/generate", json={"inputs": "x" * 2_100_000})
        assert huge.status_code == 413
        assert generate(client, "Still fine", max_new_tokens=2).status_code == 200


def batch_size(client: httpx.Client) -> int:
    return client.get("/info").json()["batch_size"]


def test_a_client_that_disconnects_mid_stream_leaves_the_batch(tiny_server):
    with tiny_server.client() as watcher:
        client = tiny_server.client()
        with client.stream("POST", "/generate_stream",
                           json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 500}}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data:") and json.loads(line[5:])["index"] >= 3:
                    break
            assert batch_size(watcher) == 1
        client.close()
        deadline = time.monotonic() + 5
        while batch_size(watcher) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batch_size(watcher) == 0, "the cancelled sequence left the batch"
        assert watcher.get("/info").json()["kv"]["bytes"] == 0, "and its KV memory is free"
        assert generate(watcher, "after", max_new_tokens=2).status_code == 200


def test_a_client_that_disconnects_while_waiting_for_json_is_cancelled(tiny_server):
    with tiny_server.client() as watcher:
        def abandon():
            try:
                httpx.post(f"{tiny_server.url}/generate", timeout=0.5,
                           json={"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 900}})
            except httpx.TimeoutException:
                pass
        abandon()
        deadline = time.monotonic() + 5
        while batch_size(watcher) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batch_size(watcher) == 0


@pytest.fixture(scope="module")
def small_server(tiny_model_dir, tmp_path_factory):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn",
                           "--max-concurrent-requests", "2", "--max-total-tokens", "1024"],
                          tmp_path_factory.mktemp("small"))
    yield server
    server.stop()


def test_overload_is_429_and_slots_come_back(small_server):
    clients = [small_server.client() for _ in range(2)]
    streams, readers = [], []
    try:
        for client in clients:
            stream = client.stream("POST", "/generate_stream",
                                   json={"inputs": "Hold on", "parameters": {"max_new_tokens": 1000}})
            readers.append(stream.__enter__().iter_lines())  # kept: dropping it closes the connection
            streams.append(stream)
            assert next(readers[-1]).startswith("data:")
        with small_server.client() as client:
            response = generate(client, "one too many", max_new_tokens=2)
            assert response.status_code == 429
            assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
        for client in clients:
            client.close()
    with small_server.client() as client:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            response = generate(client, "room again", max_new_tokens=2)
            if response.status_code == 200:
                break
            time.sleep(0.05)
        assert response.status_code == 200


def test_gunicorn_serves_with_one_uvicorn_worker_logs_json_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "gunicorn", "--json-output"], tmp_path,
                          env={"MAX_TOTAL_TOKENS": "256"})
    try:
        with server.client() as client:
            assert generate(client, "Hello", max_new_tokens=3).status_code == 200
            assert client.get("/info").json()["max_total_tokens"] == 256
    finally:
        server.process.terminate()
        assert server.process.wait(30) == 0
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    messages = [r["message"] for r in records]
    assert any("tokenmill.http.serve.TokenmillWorker" in m for m in messages)  # a uvicorn worker that drains
    assert sum("Booting worker" in m for m in messages) == 1


def test_the_app_answers_503_until_the_model_is_ready():
    import asyncio

    from tokenmill.config import Config
    from tokenmill.http.app import create_app

    async def ask() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        # httpx's ASGI transport sends no lifespan start-up, so the model never starts loading.
        transport = httpx.ASGITransport(app=create_app(Config()))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return (await client.get("/health"), await client.post("/generate", json={"inputs": "Hi"}),
                    await client.get("/info"))

    health, generate_response, info = asyncio.run(ask())
    assert health.status_code == 503 and health.json()["error_type"] == "unhealthy"
    assert generate_response.status_code == 503
    assert info.json()["ready"] is False and info.json()["load_stage"] == "starting"


@pytest.mark.slow
def test_paged_server_with_a_small_pool_preempts_and_still_answers_like_generate(tiny_model_dir, tiny_model,
                                                                                 tmp_path):
    model, tokenizer = tiny_model
    server = start_server(["--model-id", str(tiny_model_dir), "--server", "uvicorn", "--backend", "paged",
                           "--block-size", "4", "--max-batch-total-tokens", "96", "--max-total-tokens", "64",
                           "--max-input-tokens", "16", "--max-batch-prefill-tokens", "16", "--dtype", "float32"],
                          tmp_path)
    prompts = [p for p in PROMPTS if len(tokenizer(p)["input_ids"]) <= 16][:6]
    try:
        def one(prompt: str) -> list[int]:
            with server.client() as client:
                response = generate(client, prompt, max_new_tokens=40, details=True)
            assert response.status_code == 200, response.text
            return [t["id"] for t in response.json()["details"]["tokens"]]

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        for prompt, ids in zip(prompts, results):
            assert ids == reference(model, tokenizer, prompt, 40), prompt
        with server.client() as client:
            metrics = client.get("/metrics").text
            too_long = generate(client, "word " * 40, max_new_tokens=1)
        preemptions = float(next(line.split()[1] for line in metrics.splitlines()
                                 if line.startswith("tokenmill_preemptions_total")))
        assert preemptions > 0 and "tokenmill_kv_blocks_used 0" in metrics
        assert too_long.status_code == 422, "a request that could never fit is refused up front"
    finally:
        server.stop()


@pytest.mark.parametrize("where", ["parameter", "header"])
def test_an_unknown_priority_class_is_422(tiny_server, where):
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    headers = {}
    if where == "parameter":
        body["parameters"]["priority"] = "urgent"
    else:
        headers["X-Priority"] = "urgent"
    with tiny_server.client() as client:
        response = client.post("/generate", json=body, headers=headers)
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation" and "priority" in response.json()["error"]


def test_a_client_that_stops_reading_pauses_its_sequence_while_others_are_served_and_queue_shows_it(
        tiny_model_dir):
    """Driven through the ASGI app itself, so that the client's stall is exact (over TCP the
    kernel's socket buffers absorb megabytes before the server's writes block)."""
    import asyncio

    from tokenmill.config import parse_config
    from tokenmill.http.app import create_app
    from tokenmill.plugin_manager import build_plugin_manager

    config = parse_config(["--model-id", str(tiny_model_dir), "--backend", "paged", "--stream-buffer-tokens", "4",
                           "--max-total-tokens", "512", "--max-input-tokens", "64", "--no-compile-model"], env={})
    app = create_app(config, build_plugin_manager(autoload=False))
    body = json.dumps({"inputs": "The password is swordfish. " + PROMPTS[1],
                       "parameters": {"max_new_tokens": 200}}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/generate_stream", "raw_path": b"/generate_stream", "query_string": b"", "root_path": "",
             "scheme": "http", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"x-priority", b"high")]}

    async def scenario() -> tuple[list[dict], list[bytes], int]:
        lifespan_in: asyncio.Queue = asyncio.Queue()
        lifespan_out: asyncio.Queue = asyncio.Queue()
        await lifespan_in.put({"type": "lifespan.startup"})
        lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, lifespan_in.get,
                                           lifespan_out.put))
        assert (await lifespan_out.get())["type"] == "lifespan.startup.complete"
        state = app.state
        while not (state.engine is not None and state.engine.healthy):
            await asyncio.sleep(0.1)
        requests = [{"type": "http.request", "body": body, "more_body": False}]
        never = asyncio.Event()

        async def receive() -> dict:
            if requests:
                return requests.pop()
            await never.wait()  # the client stays connected
            return {"type": "http.disconnect"}

        chunks: list[bytes] = []
        reading = asyncio.Event()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if len(chunks) >= 2:
                    await reading.wait()  # the client stops reading after two events

        stream = asyncio.create_task(app(scope, receive, send))
        views = []
        for _ in range(100):
            await asyncio.sleep(0.05)
            views.append(state.engine.queue_view()["running"])
            if len(views) > 10 and views[-1] and views[-1][0]["state"] == "paused":
                break
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            other = await client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 20}})
            for _ in range(100):  # the engine publishes its queue at the end of the step that ended `other`
                queue = await client.get("/queue")
                if queue.json()["batch_size"] == 1:
                    break
                await asyncio.sleep(0.02)
            metrics = (await client.get("/metrics")).text
        paused_at = state.engine.queue_view()["running"]
        reading.set()
        await asyncio.wait_for(stream, 60)
        await lifespan_in.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(lifespan, 30)
        assert other.status_code == 200 and other.json()["generated_text"], "another client was served meanwhile"
        return [views[-1][0], paused_at[0]], chunks, queue, metrics

    (paused, still_paused), chunks, queue, metrics = asyncio.run(scenario())
    view = queue.json()
    assert queue.status_code == 200 and view["batch_size"] == 1 and view["queue_size"] == 0
    assert view["scheduler"] == "fifo" and "swordfish" not in queue.text, "no prompt text in /queue"
    [running] = view["running"]
    assert running["priority"] == "high" and running["state"] == "paused" and running["unsent_tokens"] >= 4
    assert running["prompt_tokens"] > 5 and running["max_new_tokens"] == 200 and running["waited_seconds"] >= 0
    assert 'tokenmill_queue_class_size{class="high"} 0' in metrics and "tgi_batch_current_size 1" in metrics
    assert paused["state"] == "paused" and still_paused["state"] == "paused"
    assert paused["generated_tokens"] == still_paused["generated_tokens"] < 12, "it stopped near its buffer"
    events = [json.loads(line[5:]) for chunk in chunks for line in chunk.decode().splitlines()
              if line.startswith("data:")]
    assert len(events) == 200 and events[-1]["details"] is None and events[-1]["generated_text"], \
        "once the client read again, the stream ran to its end"


def test_unknown_routes_and_methods_answer_with_tgi_error_body():
    """Falcon's own 404 and 405 (no route, a method the route lacks) carry TGI's body, not Falcon's
    ``{"title": ...}``; 405 keeps its Allow header. No model is needed: the app is not started."""
    import asyncio

    from tokenmill.config import parse_config
    from tokenmill.http.app import create_app
    from tokenmill.plugin_manager import build_plugin_manager

    app = create_app(parse_config(["--model-id", "never-loaded"], env={}), build_plugin_manager(autoload=False))

    async def requests() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return [await client.post("/v2/generate", json={"inputs": "Hi"}), await client.get("/nonexistent"),
                    await client.get("/generate"), await client.delete("/v1/models")]

    invocations, nonexistent, get_generate, delete_models = asyncio.run(requests())
    for response, status, error_type in ((invocations, 404, "not_found"), (nonexistent, 404, "not_found"),
                                         (get_generate, 405, "method_not_allowed"),
                                         (delete_models, 405, "method_not_allowed")):
        assert response.status_code == status and response.headers["content-type"].startswith("application/json")
        assert set(response.json()) == {"error", "error_type"} and response.json()["error_type"] == error_type
    assert "/v2/generate" in invocations.json()["error"]
    assert get_generate.headers["allow"] == "POST, OPTIONS" and "GET" in get_generate.json()["error"]
