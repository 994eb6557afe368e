"""/v1/completions with token-id prompts, and ``echo`` with ``logprobs`` scoring the prompt (what
lm-evaluation-harness's ``local-completions`` sends), against the real server on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def http(tiny_server):
    with tiny_server.client() as client:
        yield client


def complete(http, **body) -> dict:
    response = http.post("/v1/completions", json={"model": "any", "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def prompt_ids(tiny_model, text: str = PROMPT) -> list[int]:
    return list(tiny_model[1](text)["input_ids"])  # as the server tokenizes a text prompt


def test_a_token_id_prompt_completes_as_its_text_does(http, tiny_model):
    ids = prompt_ids(tiny_model)
    by_text = complete(http, prompt=PROMPT, max_tokens=6, logprobs=2)
    by_ids = complete(http, prompt=ids, max_tokens=6, logprobs=2)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"] != ""
    assert by_ids["choices"][0]["logprobs"]["tokens"] == by_text["choices"][0]["logprobs"]["tokens"]
    assert by_ids["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        by_text["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    assert by_ids["usage"]["prompt_tokens"] == len(ids) == by_text["usage"]["prompt_tokens"]


def test_a_batch_of_token_id_prompts_answers_each_in_order(http, tiny_model):
    texts = [PROMPT, "def add(a, b):"]  # with n=2, the server's --max-client-batch-size (4)
    batch = complete(http, prompt=[prompt_ids(tiny_model, t) for t in texts], max_tokens=5, n=2)
    alone = [complete(http, prompt=t, max_tokens=5)["choices"][0]["text"] for t in texts]
    assert [c["index"] for c in batch["choices"]] == list(range(4))
    assert [c["text"] for c in batch["choices"]] == [text for text in alone for _ in range(2)]
    assert batch["usage"]["prompt_tokens"] == sum(len(prompt_ids(tiny_model, t)) for t in texts)


def test_echo_with_logprobs_scores_every_prompt_token_as_the_model_does(http, tiny_model):
    model, tokenizer = tiny_model
    ids = prompt_ids(tiny_model)
    body = complete(http, prompt=ids, max_tokens=2, logprobs=3, echo=True)
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    total = len(ids) + 2
    assert [len(logprobs[key]) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [total] * 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"][: len(ids)] == [tokenizer.decode([i]) for i in ids]
    prompt_text = tokenizer.decode(ids)
    assert choice["text"].startswith(prompt_text) and logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][len(ids)] == len(prompt_text)
    assert all(isinstance(top, dict) and len(top) == 3 for top in logprobs["top_logprobs"][1:])
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for position in range(1, len(ids)):
        token_logprob = logprobs["token_logprobs"][position]
        assert math.isclose(token_logprob, float(expected[position - 1, ids[position]]), abs_tol=1e-4)
        top = logprobs["top_logprobs"][position]
        values, top_ids = torch.topk(expected[position - 1], 3)
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=1e-4)
        assert set(top) == {tokenizer.decode([i]) for i in top_ids.tolist()}
        assert token_logprob <= max(top.values())


def test_a_greedy_continuation_scores_as_greedy(http, tiny_model):
    """lm-eval's ``is_greedy``: each continuation token's logprob equals the best of its top
    logprobs, exactly, when the model would have chosen it."""
    ids = prompt_ids(tiny_model)
    generated = http.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}})
    continuation = [t["id"] for t in generated.json()["details"]["tokens"]]
    scored = complete(http, prompt=[ids + continuation], max_tokens=1, logprobs=1, echo=True)
    logprobs = scored["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + len(continuation) + 1
    for position in range(len(ids), len(ids) + len(continuation)):
        assert logprobs["token_logprobs"][position] == max(logprobs["top_logprobs"][position].values())


def test_max_tokens_0_with_echo_scores_the_prompt_alone(http, tiny_model):
    ids = prompt_ids(tiny_model)
    body = complete(http, prompt=ids, max_tokens=0, logprobs=1, echo=True)
    choice = body["choices"][0]
    assert choice["text"] == tiny_model[1].decode(ids)
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) and body["usage"]["completion_tokens"] == 0
    for refused in ({"echo": False}, {"stream": True}):
        response = http.post("/v1/completions", json={"model": "any", "prompt": ids, "max_tokens": 0, "echo": True,
                                                      **refused})
        assert response.status_code == 422 and response.json()["error_type"] == "validation", response.text


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [-1], [49152], [[1, 2], 5], [1.5], [True], [[1], [2.5]],
                                    {"ids": [1]}, ["fine", [3, 4], None]])
def test_a_broken_token_id_prompt_is_a_422(http, prompt):
    response = http.post("/v1/completions", json={"model": "any", "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation" and "prompt" in response.json()["error"]
