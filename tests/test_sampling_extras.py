"""vLLM's and OpenAI's extra sampling fields (min_p, min_tokens, ignore_eos, stop_token_ids,
logit_bias), over HTTP against the real tiny server on both backends: /generate takes them as
parameters, the OpenAI routes as body fields."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

PROMPT = "The quick brown fox"
CAT = 2644
""" cat, one token of SmolLM2's tokenizer."""
EOS = 2
"""<|im_end|>: the tiny model's end-of-sequence token."""


def generate(server: Any, **parameters: Any) -> dict[str, Any]:
    """/generate with ``details``: the answer's body (asserted a 200)."""
    with server.client() as http:
        response = http.post("/generate", json={"inputs": PROMPT, "parameters": {"details": True, **parameters}})
    assert response.status_code == 200, response.text
    return response.json()


def token_ids(answer: dict[str, Any]) -> list[int]:
    return [token["id"] for token in answer["details"]["tokens"]]


def completion(server: Any, **fields: Any) -> dict[str, Any]:
    with server.client() as http:
        response = http.post("/v1/completions", json={"prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_bias_of_100_forces_a_token_greedy_and_sampled(tiny_server):
    assert token_ids(generate(tiny_server, max_new_tokens=4, logit_bias={str(CAT): 100})) == [CAT] * 4
    sampled = generate(tiny_server, max_new_tokens=4, do_sample=True, seed=3, logit_bias={str(CAT): 100})
    assert token_ids(sampled) == [CAT] * 4
    reply = completion(tiny_server, max_tokens=3, temperature=1.0, seed=5, logit_bias={str(CAT): 100})
    assert reply["choices"][0]["text"] == " cat cat cat"
    with tiny_server.client() as http:
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                       "max_tokens": 2, "temperature": 0,
                                                       "logit_bias": {str(CAT): 100}}).json()
    assert chat["choices"][0]["message"]["content"] == " cat cat"


def test_a_bias_of_minus_100_bans_the_greedy_choice(tiny_server):
    greedy = token_ids(generate(tiny_server, max_new_tokens=1))[0]
    banned = token_ids(generate(tiny_server, max_new_tokens=3, logit_bias={str(greedy): -100}))
    assert greedy not in banned


def test_a_biased_request_leaves_its_batch_neighbours_alone(tiny_server):
    plain = token_ids(generate(tiny_server, max_new_tokens=16))
    with ThreadPoolExecutor(4) as pool:
        biased = [pool.submit(generate, tiny_server, max_new_tokens=16, logit_bias={str(CAT): 100})
                  for _ in range(2)]
        neighbours = [pool.submit(generate, tiny_server, max_new_tokens=16) for _ in range(2)]
        assert all(token_ids(f.result()) == [CAT] * 16 for f in biased)
        assert all(token_ids(f.result()) == plain for f in neighbours)


def test_min_tokens_holds_back_a_forced_eos(tiny_server):
    ended = generate(tiny_server, max_new_tokens=10, logit_bias={str(EOS): 100})
    assert token_ids(ended) == [EOS] and ended["details"]["finish_reason"] == "eos_token"
    held = generate(tiny_server, max_new_tokens=10, min_tokens=4, logit_bias={str(EOS): 100})
    ids = token_ids(held)
    assert len(ids) == 5 and EOS not in ids[:4] and ids[4] == EOS
    assert held["details"]["finish_reason"] == "eos_token"
    reply = completion(tiny_server, max_tokens=10, temperature=0, min_tokens=3, logit_bias={str(EOS): 100})
    assert reply["usage"]["completion_tokens"] == 4 and reply["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_runs_to_max_tokens_with_the_eos_tokens_in_the_output(tiny_server):
    answer = generate(tiny_server, max_new_tokens=5, ignore_eos=True, logit_bias={str(EOS): 100})
    assert token_ids(answer) == [EOS] * 5 and answer["details"]["finish_reason"] == "length"
    reply = completion(tiny_server, max_tokens=6, temperature=0, ignore_eos=True, logit_bias={str(EOS): 100})
    assert reply["usage"]["completion_tokens"] == 6 and reply["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_end_generation_at_the_token_after_min_tokens(tiny_server):
    forced = {"logit_bias": {str(CAT): 100}, "stop_token_ids": [CAT]}
    stopped = generate(tiny_server, max_new_tokens=10, **forced)
    assert token_ids(stopped) == [CAT] and stopped["details"]["finish_reason"] == "stop_sequence"
    later = generate(tiny_server, max_new_tokens=10, min_tokens=2, **forced)
    ids = token_ids(later)
    assert len(ids) == 3 and CAT not in ids[:2] and ids[2] == CAT
    reply = completion(tiny_server, max_tokens=10, temperature=0, **forced)
    assert reply["usage"]["completion_tokens"] == 1 and reply["choices"][0]["finish_reason"] == "stop"


def test_stop_sequences_do_not_end_generation_before_min_tokens(tiny_server):
    cats = generate(tiny_server, max_new_tokens=10, stop=[" cat"], min_tokens=3, logit_bias={str(CAT): 100})
    assert token_ids(cats) == [CAT] * 3 and cats["details"]["finish_reason"] == "stop_sequence"


def test_min_p_of_one_while_sampling_is_the_greedy_choice(tiny_server):
    greedy = token_ids(generate(tiny_server, max_new_tokens=8))
    for seed in (1, 2):
        assert token_ids(generate(tiny_server, max_new_tokens=8, do_sample=True, seed=seed, min_p=1.0)) == greedy
    greedy_text = completion(tiny_server, max_tokens=8, temperature=0)["choices"][0]["text"]
    sampled = completion(tiny_server, max_tokens=8, temperature=1.5, seed=4, min_p=1.0)
    assert sampled["choices"][0]["text"] == greedy_text


INVALID = [
    ("min_p", {"min_p": 2}), ("min_p", {"min_p": -0.1}), ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}), ("min_tokens", {"min_tokens": 1.5}),
    ("stop_token_ids", {"stop_token_ids": ["a"]}), ("stop_token_ids", {"stop_token_ids": [49152]}),
    ("stop_token_ids", {"stop_token_ids": 7}), ("stop_token_ids", {"stop_token_ids": list(range(1025))}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("logit_bias", {"logit_bias": {"x": 1}}), ("logit_bias", {"logit_bias": {"5": 1000}}),
    ("logit_bias", {"logit_bias": {"49152": 1}}), ("logit_bias", {"logit_bias": {"-1": 1}}),
    ("logit_bias", {"logit_bias": {"5": "high"}}),
]


@pytest.mark.parametrize("name, fields", INVALID)
def test_invalid_values_are_a_422_that_names_the_field_on_every_route(tiny_server, name, fields):
    tgi = {("max_new_tokens" if key == "max_tokens" else key): value for key, value in fields.items()}
    bodies = {"/v1/completions": {"prompt": PROMPT, "max_tokens": 4, **fields},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields},
              "/generate": {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **tgi}}}
    with tiny_server.client() as http:
        for route, body in bodies.items():
            response = http.post(route, json=body)
            assert response.status_code == 422, (route, response.text)
            error = response.json()
            assert error["error_type"] == "validation" and f"`{name}" in error["error"], (route, error)
