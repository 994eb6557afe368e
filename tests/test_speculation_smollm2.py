"""``--speculate`` on the default model (SmolLM2), over HTTP: answers that copy from their prompt and free
writing come out exactly as without speculation (float32; and over two shards), with
stops, grammar, penalties and length limits; /info, /metrics and the request log say what it did."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningServer, free_port, start_server

pytestmark = pytest.mark.slow

PROMPTS = json.loads((Path(__file__).parents[1] / "bench" / "prompts" / "speculate-v1.json").read_text())["prompts"]
COPY = [p for p in PROMPTS if p["load"] == "copy"][:3]
FREE = [p for p in PROMPTS if p["load"] == "free"][:2]
ARGS = ["--server", "uvicorn", "--dtype", "float32", "--max-total-tokens", "2048"]  # one shard's tokens from two


def chat(prompt: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "tgi", "messages": prompt["messages"], "max_tokens": 64, "temperature": 0, **extra}


def requests(stop: str) -> list[dict[str, Any]]:
    """Both loads, then a stop sequence, penalties, a JSON grammar and a short limit on a copying answer."""
    code = COPY[0]
    return [chat(p) for p in COPY + FREE] + [
        chat(code, stop=[stop]),
        chat(code, frequency_penalty=0.4, presence_penalty=0.3),
        chat(COPY[2], response_format={"type": "json_object"}),
        chat(code, max_tokens=13),
    ]


def answers(server: RunningServer, bodies: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    def one(body: dict[str, Any]) -> tuple[str, str, int]:
        with server.client() as client:
            answer = client.post("/v1/chat/completions", json=body).json()
        choice = answer["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], answer["usage"]["completion_tokens"]

    with ThreadPoolExecutor(4) as pool:  # several at once: drafting rows share steps with plain ones
        return list(pool.map(one, bodies))


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[tuple[str, str, int]]:
    server = start_server(ARGS, tmp_path_factory.mktemp("plain"))
    try:
        first = answers(server, [chat(COPY[0])])[0][0]
        stop = first[60:66]  # a few characters inside the copied code
        return [(stop, "", 0)] + answers(server, requests(stop))
    finally:
        server.stop()


def test_speculation_gives_the_answers_of_no_speculation_and_says_what_it_did(plain, tmp_path):
    stop = plain[0][0]
    server = start_server([*ARGS, "--speculate", "4"], tmp_path)
    repeat = {"inputs": "Repeat exactly: one two three four five six seven eight. one two three four five six seven",
              "parameters": {"max_new_tokens": 24, "details": True}}
    try:
        got = answers(server, requests(stop))
        with server.client() as client:
            info = client.get("/info").json()
            whole = client.post("/generate", json=repeat).json()
            streamed = [json.loads(line[5:]) for line in client.post("/generate_stream", json=repeat).text.splitlines()
                        if line.startswith("data:")]
            metrics = client.get("/metrics").text
    finally:
        server.stop()
    assert got == plain[1:]
    assert plain[1 + len(COPY) + len(FREE)][1] == "stop" and plain[-1][2] == 13
    assert info["speculate"] == 4
    drafted = metric(metrics, "tokenmill_speculation_draft_tokens_total")
    accepted = metric(metrics, "tokenmill_speculation_accepted_tokens_total")
    assert 0 < accepted <= drafted and metric(metrics, "tgi_request_skipped_tokens_sum") == accepted
    assert [event["token"]["id"] for event in streamed] == [token["id"] for token in whole["details"]["tokens"]]
    assert [event["index"] for event in streamed] == list(range(1, len(streamed) + 1))  # one event per token
    assert "draft tokens accepted" in server.log() and "acceptance_rate" in server.log()


def test_two_shards_speculate_as_one_does(plain, tmp_path):
    stop = plain[0][0]
    server = start_server([*ARGS, "--speculate", "4", "--num-shard", "2", "--master-port", str(free_port())],
                          tmp_path)
    try:
        got = answers(server, requests(stop)[: len(COPY) + len(FREE)])
        with server.client() as client:
            metrics = client.get("/metrics").text
    finally:
        server.stop()
    assert got == plain[1 : 1 + len(COPY) + len(FREE)]
    assert metric(metrics, "tokenmill_speculation_accepted_tokens_total") > 0
