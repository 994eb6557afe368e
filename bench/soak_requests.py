"""What ``bench soak`` sends: valid requests with random parameters, and every kind of bad one.

Each kind of request (``KINDS``) is made by :func:`make_job` as raw bytes for one route, so that
malformed JSON and bodies the client's JSON encoder would refuse can be sent as well.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

TOPICS = ("the sea", "a red bicycle", "prime numbers", "rain in spring", "a lost key", "the moon", "bread")
STOPS = ("\n", ".", " the", "!", "END", "###")
ROUTES = {"generate": ("/generate", False), "generate_stream": ("/generate_stream", True), "root": ("/", None),
          "completions": ("/v1/completions", False), "completions_stream": ("/v1/completions", True),
          "chat": ("/v1/chat/completions", False), "chat_stream": ("/v1/chat/completions", True)}
"""Each valid kind: its route and whether it streams (None: ``/``, whose body decides)."""
KINDS = {**dict.fromkeys(ROUTES, 6), "bad_type": 7, "out_of_range": 7, "too_many_stops": 4, "too_long": 3,
         "malformed_json": 4, "deep_json": 3, "unknown_fields": 4, "disconnect": 6, "abandon": 3, "slow_reader": 4,
         "burst": 1}
"""The kinds of request and their weights: each ``burst`` is ``2 × --max-concurrent-requests`` requests."""


@dataclass
class Job:
    kind: str
    route: str
    content: bytes
    stream: bool = False
    cut_after: int | None = None  # hang up after this many stream events (disconnect) or ms (abandon)
    pause_s: float = 0.0  # seconds to wait after each stream event (slow_reader)


def encode(body: Any) -> bytes:
    return json.dumps(body).encode()


def prompt(rng: random.Random) -> str:
    return f"Soak {rng.randrange(10**6)}. Write one sentence about {rng.choice(TOPICS)}."


def maybe(rng: random.Random, chance: float, fields: dict[str, Any]) -> dict[str, Any]:
    return fields if rng.random() < chance else {}


def tgi_parameters(rng: random.Random, stream: bool) -> dict[str, Any]:
    """Valid TGI parameters, a random selection of them."""
    params: dict[str, Any] = {"max_new_tokens": rng.randint(1, 16)}
    if rng.random() < 0.5:
        params.update(do_sample=True, temperature=round(rng.uniform(0.2, 1.5), 2), **maybe(rng, 0.5, {
            "top_p": round(rng.uniform(0.1, 0.95), 2), "top_k": rng.randint(1, 50)}))
        # TGI refuses a seed with best_of, and best_of with a stream
        params.update(maybe(rng, 0 if stream else 0.15, {"best_of": 2}) or {"seed": rng.randrange(2**32)})
    params.update(**maybe(rng, 0.3, {"stop": rng.sample(STOPS, rng.randint(1, 4))}),
                  **maybe(rng, 0.2, {"repetition_penalty": round(rng.uniform(1.0, 1.5), 2)}),
                  **maybe(rng, 0.15, {"return_full_text": True}))
    if rng.random() < 0.5:
        params.update(details=True, **maybe(rng, 0.4, {"top_n_tokens": rng.randint(1, 5)}),
                      **maybe(rng, 0 if stream else 0.3, {"decoder_input_details": True}))
    return params


def openai_fields(rng: random.Random, chat: bool) -> dict[str, Any]:
    """Valid OpenAI fields, a random selection of them."""
    top = rng.randint(0, 5)
    return {"model": "tgi", "max_tokens": rng.randint(1, 16),
            **maybe(rng, 0.6, {"temperature": round(rng.uniform(0, 2), 2)}),
            **maybe(rng, 0.3, {"top_p": round(rng.uniform(0.05, 1), 2)}),
            **maybe(rng, 0.3, {"seed": rng.randrange(-(2**40), 2**40)}),
            **maybe(rng, 0.3, {"stop": rng.choice([rng.choice(STOPS), rng.sample(STOPS, rng.randint(1, 4))])}),
            **maybe(rng, 0.2, {"n": 2}),
            **maybe(rng, 0.2, {"presence_penalty": round(rng.uniform(-2, 2), 2),
                               "frequency_penalty": round(rng.uniform(-2, 2), 2)}),
            **maybe(rng, 0.3, {"logprobs": True, "top_logprobs": top} if chat else {"logprobs": top})}


def valid_body(kind: str, rng: random.Random) -> tuple[str, bool, dict[str, Any]]:
    """(route, streams, body) of a valid request of ``kind`` (one of ``ROUTES``)."""
    route, stream = ROUTES[kind]
    if stream is None:
        stream = rng.random() < 0.5
        return route, stream, {"inputs": prompt(rng), "parameters": tgi_parameters(rng, stream), "stream": stream}
    if route.startswith("/v1/"):
        chat = route.endswith("chat/completions")
        body = openai_fields(rng, chat)
        if chat:
            system = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.3 else []
            body["messages"] = [*system, {"role": "user", "content": prompt(rng)}]
        else:
            body["prompt"] = prompt(rng)
        if stream:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        return route, stream, body
    return route, stream, {"inputs": prompt(rng), "parameters": tgi_parameters(rng, stream)}


T = {"max_new_tokens": 4}
X = {"inputs": "x", "parameters": T}
M = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
P = {"prompt": "x", "max_tokens": 4}
BAD = {"tgi": ({**X, "inputs": 42}, {**X, "inputs": ["a"]}, {"parameters": T}, {**X, "parameters": []},
               {**X, "stream": "no"}, *({**X, "parameters": {**T, name: value}} for name, value in (
                   ("max_new_tokens", "ten"), ("temperature", "hot"), ("stop", "\n"), ("stop", [1, 2]), ("seed", 1.5),
                   ("max_new_tokens", True), ("do_sample", "yes"), ("top_k", 2.5), ("grammar", "json"))),
               [1, 2], "text", None),
       "openai": ({**M, "messages": "hi"}, {**M, "messages": [{"role": "user"}]}, {**M, "messages": []},
                  {**M, "messages": [{"role": "?", "content": "x"}]},
                  {**M, "messages": [{"role": "user", "content": 5}]},
                  {**P, "prompt": 5}, {**P, "prompt": {"a": 1}}, {**P, "max_tokens": "x"}, {**P, "n": "2"},
                  {**P, "stream": "yes"}, {**M, "stream": True, "stream_options": {"include_usage": 1}},
                  {**P, "temperature": "hot"}, {**P, "stop": 5}, {**M, "tools": "x"}, {**M, "logprobs": "x"}, [], 3)}
"""Bodies with a field of the wrong type (or no body object at all)."""
RANGE = {"tgi": ({"temperature": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": 0},
                 {"top_k": -5}, {"typical_p": 2}, {"repetition_penalty": 0}, {"frequency_penalty": 3},
                 {"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_new_tokens": 10**9}, {"max_new_tokens": 10**30},
                 {"seed": -1}, {"seed": 2**70}, {"best_of": 3, "do_sample": True}, {"best_of": 0},
                 {"top_n_tokens": 99}, {"truncate": -1}),
         "openai": ({"temperature": -0.5}, {"temperature": 2.5}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0},
                    {"max_tokens": -4}, {"max_tokens": 10**9}, {"n": 0}, {"n": 9}, {"presence_penalty": 5},
                    {"top_logprobs": 99, "logprobs": True}, {"logprobs": 99})}
"""Changes that put a valid request's parameter out of its range."""
MALFORMED = (b'{"inputs": "x", "parameters": {', b'{"inputs": "x",}', b"\xff\xfe not json", b'{"inputs": NaN}', b"",
             b'{"inputs": "x"} trailing', b"{'inputs': 'x'}",
             b'{"inputs": "x", "parameters": {"max_new_tokens": 1e400}}',
             b'{"prompt": "x", "max_tokens": 4, "temperature": -1e400}',
             b'{"inputs": "\\ud800 lone surrogate", "parameters": {"max_new_tokens": 4}}',
             b'{"prompt": "\\udfff", "max_tokens": 4}',
             b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}')
"""Bodies that are not JSON, or JSON with what JSON allows and UTF-8 does not (lone surrogates)."""


def deep(depth: int, rng: random.Random) -> bytes:
    """``depth`` nested lists or objects, alone or as a field's value (in a body asking for 4 tokens)."""
    nested = rng.choice([b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth])
    return rng.choice([nested, b'{"inputs": "x", "parameters": {"max_new_tokens": 4, "a": ' + nested + b"}}",
                       b'{"inputs": "x", "parameters": {"max_new_tokens": 4}, "extra": ' + nested + b"}",
                       b'{"model": "tgi", "max_tokens": 4, "messages": ' + nested + b"}",
                       b'{"max_tokens": 4, "prompt": ' + nested + b"}"])


def make_job(kind: str, rng: random.Random) -> Job:
    """One request of ``kind`` with random content."""
    if kind in ROUTES:
        route, stream, body = valid_body(kind, rng)
        return Job(kind, route, encode(body), stream)
    valid = rng.choice(list(ROUTES))
    route, stream, body = valid_body(valid, rng)
    family = "openai" if route.startswith("/v1/") else "tgi"
    params = body.get("parameters", body)  # where the sampling fields go
    if kind == "bad_type":
        body = rng.choice(BAD[family])
    elif kind == "out_of_range":
        params.update(rng.choice(RANGE[family]))
    elif kind == "too_many_stops":
        params["stop"] = [f"s{i}" for i in range(rng.randint(5, 64))]
    elif kind == "too_long":  # over the token limit; the longest over the payload limit too
        text = "word " * rng.choice([9000, 40000, 700_000])
        if "messages" in body:
            body["messages"][-1]["content"] = text
        else:
            body["inputs" if family == "tgi" else "prompt"] = text
    elif kind == "malformed_json":
        return Job(kind, route, rng.choice(MALFORMED), stream)
    elif kind == "deep_json":
        return Job(kind, route, deep(rng.choice([1000, 100_000]), rng), stream)
    elif kind == "unknown_fields":
        body.update(frobnicate={"x": [1, 2]}, **{"extra field": None})
        params["unknown_parameter"] = 3
    elif kind == "abandon":
        body = {"inputs": prompt(rng), "parameters": {"max_new_tokens": 16}}
        return Job(kind, "/generate", encode(body), False, cut_after=rng.randint(5, 800))
    elif kind in ("disconnect", "slow_reader"):
        route, _, body = valid_body(rng.choice(["generate_stream", "completions_stream", "chat_stream"]), rng)
        if kind == "slow_reader":
            return Job(kind, route, encode(body), True, pause_s=rng.uniform(0.05, 0.4))
        body.get("parameters", body)["max_new_tokens" if "parameters" in body else "max_tokens"] = rng.randint(16, 48)
        return Job(kind, route, encode(body), True, cut_after=rng.randint(0, 3))  # longer answers: cut mid-stream
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return Job(kind, route, encode(body), stream)
