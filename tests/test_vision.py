"""Images in, text out: tiny random LLaVA, Idefics3, Gemma 3 and Qwen2-VL checkpoints served on the paged
backend (and the transformers one) answer as transformers' own ``generate`` does on the same images, through
TGI's markdown form, OpenAI's ``image_url`` parts, the openai client and huggingface_hub's InferenceClient."""

from __future__ import annotations

import concurrent.futures
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import RunningServer, start_server
from vision_models import (
    QWEN2_VL_IMAGE,
    data_url,
    random_image,
    reference_tokens,
    save_tiny_gemma3,
    save_tiny_idefics3,
    save_tiny_llava,
    save_tiny_qwen2_vl,
)

LLAVA_PROMPT = "<|im_start|>user\n{image}What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
CHAT_PROMPT = LLAVA_PROMPT.format(image="<image>")  # what the chat template renders for one image and that text
LONG_SYSTEM = "You are a careful assistant who describes pictures for people who cannot see them. " * 4


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


def serve(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, *extra: str) -> RunningServer:
    return start_server(["--model-id", str(model_dir), "--server", "uvicorn", "--dtype", "float32",
                         "--max-images", "2", *extra], tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def llava(llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """LLaVA on the paged backend, its prompts prefilled 16 tokens a step: an image's tokens span two steps."""
    server = serve(llava_dir, tmp_path_factory, "--backend", "paged", "--max-batch-prefill-tokens", "16")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def idefics3(idefics3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = serve(idefics3_dir, tmp_path_factory, "--backend", "paged")
    yield server
    server.stop()


def generate(server: RunningServer, inputs: str, max_new_tokens: int = 8) -> list[int]:
    with server.client() as client:
        response = client.post("/generate", json={"inputs": inputs, "parameters": {
            "max_new_tokens": max_new_tokens, "details": True}})
    assert response.status_code == 200, response.text
    return [token["id"] for token in response.json()["details"]["tokens"]]


def chat(server: RunningServer, content: list[dict[str, Any]], max_tokens: int = 8,
         system: str | None = None) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    with server.client() as client:
        return client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                         "temperature": 0})


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


# --- answers equal transformers' generate ---------------------------------------------------------------


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_the_paged_backend_answers_as_transformers_generate_does_on_the_same_image(
        family: str, request: pytest.FixtureRequest) -> None:
    server, model_dir = request.getfixturevalue(family), request.getfixturevalue(f"{family}_dir")
    image = random_image(0)
    served = generate(server, LLAVA_PROMPT.format(image=f"![]({data_url(image)})"))
    assert served == reference_tokens(model_dir, CHAT_PROMPT, [image], 8)


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_different_images_give_different_answers(family: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(family)
    answers = {tuple(generate(server, LLAVA_PROMPT.format(image=f"![]({data_url(random_image(seed))})")))
               for seed in (1, 2, 3)}
    assert len(answers) == 3


def test_an_image_url_part_in_a_chat_reaches_the_same_prompt(llava: RunningServer, llava_dir: Path) -> None:
    from transformers import AutoTokenizer

    image = random_image(4)
    response = chat(llava, [image_part(data_url(image)), text_part("What is in this picture?")])
    assert response.status_code == 200, response.text
    body = response.json()
    expected = reference_tokens(llava_dir, CHAT_PROMPT, [image], 8)
    tokenizer = AutoTokenizer.from_pretrained(llava_dir)
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(tokenizer(CHAT_PROMPT)["input_ids"]) - 1 + 16  # 16 image tokens


def test_two_images_in_one_message_each_take_their_place(idefics3: RunningServer, idefics3_dir: Path) -> None:
    first, second = random_image(5), random_image(6, (30, 70))
    served = generate(idefics3, f"<|im_start|>user\n![]({data_url(first)})and ![]({data_url(second)})?<|im_end|>\n")
    assert served == reference_tokens(idefics3_dir, "<|im_start|>user\n<image>and <image>?<|im_end|>\n",
                                      [first, second], 8)


def test_concurrent_requests_with_and_without_images_each_get_their_own_answer(llava: RunningServer) -> None:
    prompts = [LLAVA_PROMPT.format(image=f"![]({data_url(random_image(seed))})") for seed in range(4)]
    prompts += ["<|im_start|>user\nHello there<|im_end|>\n", "Once upon a time"]
    alone = [generate(llava, prompt) for prompt in prompts]
    results: list[list[int]] = [[] for _ in prompts]

    def run(index: int) -> None:
        results[index] = generate(llava, prompts[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == alone


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_the_images_of_several_prompts_encode_together_as_each_alone(family: str,
                                                                    request: pytest.FixtureRequest) -> None:
    import base64

    import torch
    from transformers import AutoModelForImageTextToText

    from tokenmill.model.vision import Vision, decode_image, encode_images, load_processor

    model_dir = request.getfixturevalue(f"{family}_dir")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    vision = Vision(load_processor(model_dir), model.config)
    decoded = [decode_image(base64.b64decode(data_url(random_image(seed)).split(",", 1)[1])) for seed in range(3)]
    prompts = [vision.prompt("<image>Hi", [decoded[0]])[1], vision.prompt("<image>Hi", [decoded[1]])[1],
               vision.prompt("<image> and <image>", decoded[1:])[1]]
    with torch.inference_mode():
        together = encode_images(model, prompts)
        alone = [encode_images(model, [prompt])[0] for prompt in prompts]
    for prompt, batched, single in zip(prompts, together, alone):
        assert batched.shape == (len(prompt.positions), model.config.text_config.hidden_size)
        torch.testing.assert_close(batched, single)


def test_a_preempted_sequence_recomputes_from_its_encoded_images(llava_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import base64

    import torch
    from engine_helpers import Collector, build_engine
    from transformers import AutoModelForImageTextToText

    from tokenmill.engine.sequence import GenerationRequest, SamplingParams
    from tokenmill.model import vision as vision_module
    from tokenmill.model.vision import Vision, decode_image, load_processor

    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    processor = load_processor(llava_dir)
    vision = Vision(processor, model.config)
    encoded: list[int] = []
    encode = vision_module._image_features
    monkeypatch.setattr(vision_module, "_image_features",
                        lambda model, pixels: encoded.append(len(pixels["pixel_values"])) or encode(model, pixels))
    images = [random_image(seed) for seed in range(20, 24)]
    engine = build_engine(model, processor.tokenizer, backend="paged", block_size=4,
                          max_batch_total_tokens=112)  # 28 blocks: two sequences of ~70 tokens, not four
    sinks = [Collector() for _ in images]
    for image, sink in zip(images, sinks):
        ids, prompt = vision.prompt(CHAT_PROMPT, [decode_image(base64.b64decode(data_url(image).split(",")[1]))])
        engine.submit(GenerationRequest(CHAT_PROMPT, ids, 40, SamplingParams(), images=prompt), sink)
    while not all(sink.done for sink in sinks):
        engine.run_once()
    assert engine.preemptions > 0
    assert sum(encoded) == len(images)  # each image encoded once, preemptions or not
    for image, sink in zip(images, sinks):
        assert sink.token_ids == reference_tokens(llava_dir, CHAT_PROMPT, [image], 40)


def test_images_the_encoder_fails_on_fail_their_request_alone(llava_dir: Path) -> None:
    import base64
    import dataclasses

    import torch
    from engine_helpers import Collector, build_engine
    from transformers import AutoModelForImageTextToText

    from tokenmill.engine.sequence import GenerationRequest, SamplingParams
    from tokenmill.model.vision import Vision, decode_image, load_processor

    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    processor = load_processor(llava_dir)
    vision = Vision(processor, model.config)
    image = decode_image(base64.b64decode(data_url(random_image(30)).split(",")[1]))
    ids, good = vision.prompt(CHAT_PROMPT, [image])
    bad = dataclasses.replace(good, positions=good.positions[:-1])  # one embedding more than the places for them
    engine = build_engine(model, processor.tokenizer, backend="paged")
    sinks = [Collector(), Collector()]
    engine.submit(GenerationRequest(CHAT_PROMPT, ids, 8, SamplingParams(), images=bad), sinks[0])
    engine.submit(GenerationRequest(CHAT_PROMPT, ids, 8, SamplingParams(), images=good), sinks[1])
    while not all(sink.done for sink in sinks):
        engine.run_once()
    assert sinks[0].final is None and "embeddings for 15 image tokens" in str(sinks[0].events[-1])
    assert sinks[1].token_ids == reference_tokens(llava_dir, CHAT_PROMPT, [image.image], 8)


def test_a_backend_whose_runner_places_no_images_refuses_requests_with_images(llava_dir: Path) -> None:
    import base64

    import torch
    from engine_helpers import build_engine
    from transformers import AutoModelForImageTextToText

    from tokenmill.engine.sequence import GenerationRequest, SamplingParams
    from tokenmill.model.vision import Vision, decode_image, load_processor

    model = AutoModelForImageTextToText.from_pretrained(llava_dir, dtype=torch.float32).eval()
    processor = load_processor(llava_dir)
    ids, images = Vision(processor, model.config).prompt(
        CHAT_PROMPT, [decode_image(base64.b64decode(data_url(random_image(31)).split(",")[1]))])
    engine = build_engine(model, processor.tokenizer, backend="paged")
    request = GenerationRequest(CHAT_PROMPT, ids, 8, SamplingParams(), images=images)
    assert engine.unavailable_reason(request) is None
    engine.scheduler.runner.takes_images = False  # as a third-party runner that knows nothing of images
    assert "does not take images" in engine.unavailable_reason(request)
    assert engine.unavailable_reason(GenerationRequest(CHAT_PROMPT, ids, 8, SamplingParams())) is None


@pytest.mark.parametrize("family", ["llava", "idefics3"])
def test_each_image_s_first_token_is_known_for_the_prefix_cache(family: str, request: pytest.FixtureRequest) -> None:
    import base64

    from transformers import AutoConfig

    from tokenmill.model.vision import Vision, decode_image, load_processor

    model_dir = request.getfixturevalue(f"{family}_dir")
    vision = Vision(load_processor(model_dir), AutoConfig.from_pretrained(model_dir))
    small, tall = (decode_image(base64.b64decode(data_url(random_image(seed, size)).split(",")[1]))
                   for seed, size in ((18, (20, 20)), (19, (30, 70))))
    _, alone = vision.prompt("<image>", [small], add_special_tokens=False)
    _, both = vision.prompt("A <image> and <image>?", [small, tall])
    assert both.starts == (both.positions[0], both.positions[len(alone.positions)])
    assert both.block_digest(both.starts[1] // 4, 4).endswith(tall.digest)


# --- the prefix cache ---------------------------------------------------------------------------------


def test_the_prefix_cache_never_gives_one_image_s_blocks_to_another(llava: RunningServer, llava_dir: Path) -> None:
    from transformers import AutoTokenizer

    first, second = data_url(random_image(7)), data_url(random_image(8))
    question = [image_part(first), text_part("What is in this picture?")]
    before = chat(llava, question, system=LONG_SYSTEM)
    other = chat(llava, [image_part(second), text_part("What is in this picture?")], system=LONG_SYSTEM)
    again = chat(llava, question, system=LONG_SYSTEM)
    for response in (before, other, again):
        assert response.status_code == 200, response.text
    with llava.client() as client:
        block = client.get("/info").json()["block_size"]
    prompt_tokens = before.json()["usage"]["prompt_tokens"]
    tokenizer = AutoTokenizer.from_pretrained(llava_dir)
    text_before_image = len(tokenizer(f"<|im_start|>system\n{LONG_SYSTEM}<|im_end|>\n<|im_start|>user\n")["input_ids"])
    cached_other = other.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    cached_again = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached_other <= text_before_image  # the system prompt's blocks, none holding an image token
    assert cached_again >= (prompt_tokens - 1) // block * block > cached_other  # the same image: its blocks too
    assert again.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
    assert other.json()["choices"][0]["message"] != before.json()["choices"][0]["message"]


def test_a_later_turn_with_a_new_image_reuses_the_earlier_image_s_blocks(llava: RunningServer) -> None:
    first, second = data_url(random_image(16)), data_url(random_image(17))
    turn = [{"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": [image_part(first), text_part("What is in this picture?")]}]
    with llava.client() as client:
        answer = client.post("/v1/chat/completions", json={"messages": turn, "max_tokens": 8, "temperature": 0})
        turn += [answer.json()["choices"][0]["message"],
                 {"role": "user", "content": [image_part(second), text_part("And in this one?")]}]
        later = client.post("/v1/chat/completions", json={"messages": turn, "max_tokens": 8, "temperature": 0})
        tokens = client.post("/tokenize", json={"messages": turn}).json()["tokens"]
        block = client.get("/info").json()["block_size"]
    assert later.status_code == 200, later.text
    image_token = max(tokens, key=tokens.count)  # 32 of them: the two images' 16 each
    positions = [i for i, token in enumerate(tokens) if token == image_token]
    cached = later.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert positions[15] < cached <= positions[16] // block * block  # the first image's blocks, not the second's


# --- the clients' forms ---------------------------------------------------------------------------------


def test_the_openai_client_sends_an_image_url_part(llava: RunningServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{llava.url}/v1", api_key="none")
    completion = client.chat.completions.create(model="tgi", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Describe it."},
                                     {"type": "image_url", "image_url": {"url": data_url(random_image(9))}}]}])
    assert completion.choices[0].message.content
    assert completion.usage.prompt_tokens > 16


def test_huggingface_hub_s_inference_client_sends_an_image_part(llava: RunningServer) -> None:
    hub = pytest.importorskip("huggingface_hub")
    client = hub.InferenceClient(base_url=llava.url)
    output = client.chat_completion(max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(random_image(10))}},
                                     {"type": "text", "text": "Describe it."}]}])
    assert output.choices[0].message.content


def test_the_responses_and_messages_apis_take_images_as_chat_does(llava: RunningServer) -> None:
    url = data_url(random_image(15))
    expected = chat(llava, [image_part(url), text_part("Describe it.")]).json()["choices"][0]["message"]["content"]
    with llava.client() as client:
        responses = client.post("/v1/responses", json={"max_output_tokens": 8, "temperature": 0, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": "Describe it."}]}]})
        conversation = [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]}},
            {"type": "text", "text": "Describe it."}]}]
        messages = client.post("/v1/messages", json={"max_tokens": 8, "temperature": 0, "model": "tgi",
                                                     "messages": conversation})
        counted = client.post("/v1/messages/count_tokens", json={"model": "tgi", "messages": conversation})
    assert responses.status_code == 200, responses.text
    assert messages.status_code == 200, messages.text
    assert responses.json()["output"][-1]["content"][0]["text"] == expected
    assert messages.json()["content"][0]["text"] == expected
    assert counted.json()["input_tokens"] == messages.json()["usage"]["input_tokens"]  # the image's 16 tokens too


def test_vllm_s_tokenize_counts_an_image_s_tokens_as_a_chat_does(llava: RunningServer) -> None:
    content = [image_part(data_url(random_image(14))), text_part("What is in this picture?")]
    answered = chat(llava, content)
    with llava.client() as client:
        tokenized = client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["count"] == answered.json()["usage"]["prompt_tokens"]


def test_info_says_the_model_takes_images(llava: RunningServer) -> None:
    with llava.client() as client:
        info = client.get("/info").json()
    assert info["takes_images"] is True and info["max_images"] == 2
    assert info["model_pipeline_tag"] == "image-text-to-text"


# --- errors -------------------------------------------------------------------------------------------


def refused(server: RunningServer, content: list[dict[str, Any]]) -> str:
    response = chat(server, content)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_type"] == "validation"
    return body["error"]


def test_bad_base64_is_a_422(llava: RunningServer) -> None:
    assert "base64" in refused(llava, [image_part("data:image/png;base64,not*base64")])


def test_bytes_that_are_no_image_are_a_422(llava: RunningServer) -> None:
    assert "cannot be decoded" in refused(llava, [image_part("data:image/png;base64,aGVsbG8gd29ybGQ=")])


def test_more_images_than_max_images_is_a_422(llava: RunningServer) -> None:
    url = data_url(random_image(11))
    assert "up to 2 images" in refused(llava, [image_part(url)] * 3 + [text_part("?")])


def test_a_decompression_bomb_is_refused_from_its_header(llava: RunningServer) -> None:
    from PIL import Image

    bomb = Image.new("1", (10_000, 5_000))  # 50 megapixels in a few kilobytes of PNG
    assert "pixels is over" in refused(llava, [image_part(data_url(bomb))])


def test_an_http_url_is_refused_without_allow_image_urls(llava: RunningServer) -> None:
    assert "--allow-image-urls" in refused(llava, [image_part("http://example.com/cat.png")])


def test_tgi_markdown_with_a_url_is_refused_the_same_way(llava: RunningServer) -> None:
    with llava.client() as client:
        response = client.post("/generate", json={"inputs": "![](https://example.com/cat.png)What is this?"})
    assert response.status_code == 422 and "--allow-image-urls" in response.json()["error"]


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    body = b""
    hosts: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.hosts.append(self.headers.get("Host", ""))
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://10.0.0.1/cat.png")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """An http server on loopback that answers every path with a PNG (and /redirect with a private address)."""
    import base64

    _ImageHandler.body = base64.b64decode(data_url(random_image(12)).split(",", 1)[1])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_with_allow_image_urls_a_loopback_address_is_still_refused(llava_dir: Path, image_host: str,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    server = serve(llava_dir, tmp_path_factory, "--allow-image-urls")
    try:
        message = refused(server, [image_part(f"{image_host}/cat.png")])
    finally:
        server.stop()
    assert "not a public address" in message


def test_fetching_follows_the_operator_s_rule_for_each_address(image_host: str) -> None:
    from tokenmill.http.images import fetch
    from tokenmill.http.schemas import ValidationError

    loopback = lambda address: address.is_loopback  # noqa: E731 - the stand-in's public internet
    assert fetch(f"{image_host}/cat.png", loopback) == _ImageHandler.body
    with pytest.raises(ValidationError, match="10.0.0.1, not a public address"):
        fetch(f"{image_host}/redirect", loopback)


def test_a_host_is_fetched_at_the_address_that_was_checked(image_host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: a name that resolves to an allowed address for the check and to another one for the
    connection must not lead the fetch to the other one."""
    import socket

    from tokenmill.http.images import fetch

    port, resolve = int(image_host.rsplit(":", 1)[1]), socket.getaddrinfo
    answers = iter(["127.0.0.1"])  # the first lookup; every later one says 10.255.255.1

    def rebinding(host: str, *args: Any, **kwargs: Any) -> Any:
        if host != "images.example":
            return resolve(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers, "10.255.255.1"), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    assert fetch(f"http://images.example:{port}/cat.png", lambda address: address.is_loopback) == _ImageHandler.body
    assert _ImageHandler.hosts[-1] == f"images.example:{port}"


def test_fetched_images_are_capped(image_host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenmill.http import images
    from tokenmill.http.schemas import ValidationError

    monkeypatch.setattr(images, "MAX_FETCHED_BYTES", 100)
    with pytest.raises(ValidationError, match="over 100 bytes"):
        images.fetch(f"{image_host}/cat.png", lambda address: True)


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False), ("192.168.0.1", False),
    ("169.254.169.254", False), ("::1", False), ("::ffff:127.0.0.1", False), ("0.0.0.0", False), ("fd00::1", False),
    ("224.0.0.1", False)])
def test_only_public_addresses_are_fetched(address: str, public: bool) -> None:
    import ipaddress

    from tokenmill.http.images import is_public

    assert is_public(ipaddress.ip_address(address)) is public


def test_markdown_images_become_placeholders_in_order_for_a_model_that_takes_images() -> None:
    from types import SimpleNamespace

    from tokenmill.http.images import markdown_images

    inputs = "![](data:a)Look ![cat](https://x/y.png) at these"
    text, urls = markdown_images(inputs, SimpleNamespace(inline="<image>"))  # type: ignore[arg-type]
    assert text == "<image>Look <image> at these" and urls == ["data:a", "https://x/y.png"]
    assert markdown_images(inputs, None) == (inputs, [])  # a text model reads them as text


def test_an_image_part_for_a_text_model_is_a_clear_error() -> None:
    from tokenmill.http.openai.chat import ChatError, parse_messages
    from tokenmill.http.openai.schemas import Message

    message = Message.model_validate({"role": "user", "content": [image_part("data:image/png;base64,AA==")]})
    with pytest.raises(ChatError, match="this model takes no images"):
        parse_messages([message])


def test_sharding_a_vision_language_model_is_refused_at_start_with_the_reason(llava_dir: Path) -> None:
    import subprocess
    import sys

    command = [sys.executable, "-m", "tokenmill", "launch", "--model-id", str(llava_dir), "--num-shard", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "vision-language model: it runs on one shard" in done.stderr and "--num-shard 1" in done.stderr


# --- the transformers backend ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_transformers_backend_answers_as_generate_does(llava_dir: Path,
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    server = serve(llava_dir, tmp_path_factory, "--backend", "transformers")
    try:
        image = random_image(13)
        served = generate(server, LLAVA_PROMPT.format(image=f"![]({data_url(image)})"))
    finally:
        server.stop()
    assert served == reference_tokens(llava_dir, CHAT_PROMPT, [image], 8)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


def test_gemma_3_s_two_way_image_attention_runs_on_the_transformers_backend(
        gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The paged backend's causal steps cannot attend both ways over image tokens: --backend auto takes the
    transformers backend, which passes the processor's token types to the model's own mask."""
    server = serve(gemma3_dir, tmp_path_factory)
    try:
        image = random_image(32)
        served = generate(server, LLAVA_PROMPT.format(image=f"![]({data_url(image)})"))
        with server.client() as client:
            backend = client.get("/info").json()["backend"]
    finally:
        server.stop()
    assert backend == "transformers"
    assert served == reference_tokens(gemma3_dir, LLAVA_PROMPT.format(image="<start_of_image>"), [image], 8)


def test_gemma_3_on_the_paged_backend_is_refused_with_the_way_out(gemma3_dir: Path, tmp_path: Path) -> None:
    from conftest import launch_server

    server = launch_server(["--model-id", str(gemma3_dir), "--backend", "paged"], tmp_path)
    try:
        server.process.wait(120)
    finally:
        server.stop()
    assert server.process.returncode != 0
    assert "attend to each other both ways" in server.log() and "--backend transformers" in server.log()


# --- Qwen2-VL: multimodal rotary positions --------------------------------------------------------------

QWEN2_VL_PROMPT = LLAVA_PROMPT.format(image=QWEN2_VL_IMAGE)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


@pytest.mark.parametrize(("generation", "backend"), [("2", "paged"), ("2", "transformers"), ("2.5", "paged")])
def test_qwen2_vl_s_image_tokens_take_their_multimodal_rotary_positions(
        generation: str, backend: str, qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Its image tokens take (time, height, width) positions and the text after them positions shifted by
    how much shorter those run than the tokens: on both backends, in prefill chunks that cut the image (paged)
    and through decode, beside a request without an image, the tokens are generate's. The same image again
    in a chat (paged: its blocks from the prefix cache, so no step holds its tokens) answers the same.
    Qwen2.5-VL places its images the same way."""
    from transformers import AutoTokenizer

    if generation != "2":
        qwen2_vl_dir = save_tiny_qwen2_vl(tmp_path_factory.mktemp(f"tiny-qwen{generation}-vl"), generation)
    chunks = ("--max-batch-prefill-tokens", "16") if backend == "paged" else ()
    server = serve(qwen2_vl_dir, tmp_path_factory, "--backend", backend, *chunks)
    images = [random_image(seed) for seed in (40, 41)]
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda inputs: generate(server, inputs, 12), [
                *(LLAVA_PROMPT.format(image=f"![]({data_url(image)})") for image in images),
                LLAVA_PROMPT.format(image="")]))
        again = chat(server, [image_part(data_url(images[0])), text_part("What is in this picture?")], 12)
    finally:
        server.stop()
    expected = [reference_tokens(qwen2_vl_dir, QWEN2_VL_PROMPT, [image], 12) for image in images]
    assert answers[:2] == expected
    assert answers[0] != answers[1]
    assert again.status_code == 200, again.text
    decoded = AutoTokenizer.from_pretrained(qwen2_vl_dir).decode(expected[0], skip_special_tokens=True)
    assert again.json()["choices"][0]["message"]["content"] == decoded
    if backend == "paged":
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_a_markdown_image_stands_between_qwen2_vl_s_image_start_and_end_tokens(qwen2_vl_dir: Path) -> None:
    from transformers import AutoConfig

    from tokenmill.model.vision import Vision, load_processor

    vision = Vision(load_processor(qwen2_vl_dir), AutoConfig.from_pretrained(qwen2_vl_dir))
    assert vision.inline == QWEN2_VL_IMAGE  # as its chat template writes an image
    assert vision.placeholder == "<|image_pad|>"


def test_multimodal_rotary_positions_run_on_past_the_prompt_by_its_delta() -> None:
    from tokenmill.model.vision import RotaryPositions

    prompt = torch.tensor([[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]])
    positions = RotaryPositions(prompt, delta=-2)
    assert torch.equal(positions.at(1, 3), prompt[:, 1:4])
    assert torch.equal(positions.at(5, 4), torch.tensor([[2, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]]))
    assert torch.equal(positions.at(9, 1), torch.tensor([[7], [7], [7]]))
