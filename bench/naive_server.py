"""The set-up an inference server replaces: one ``model.generate()`` per request, behind a lock.

A threaded stdlib HTTP server with OpenAI's streaming ``/v1/chat/completions`` and
``/v1/completions`` and a ``/health`` route; requests wait for the lock, so they run one
at a time. Usage: ``python -m bench.naive_server --model DIR --port 8000``.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer


class TokenQueue(BaseStreamer):
    """Hands each generated token id to the HTTP thread as generate() makes it."""

    def __init__(self) -> None:
        self.tokens: queue.Queue[int | None] = queue.Queue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        for token in value.flatten().tolist():
            self.tokens.put(token)

    def end(self) -> None:
        self.tokens.put(None)


class NaiveModel:
    def __init__(self, path: str) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.lock = threading.Lock()

    def prompt_ids(self, route: str, body: dict[str, Any]) -> list[int]:
        if route == "/v1/chat/completions":
            return self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
        return self.tokenizer(body["prompt"])["input_ids"]

    def generate(self, ids: list[int], max_new_tokens: int) -> Iterator[tuple[int, str]]:
        """Yield (token id, new text) pairs, greedily, holding the lock throughout."""
        with self.lock:
            streamer = TokenQueue()
            kwargs = {"input_ids": torch.tensor([ids]),
                      "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                      "max_new_tokens": max_new_tokens, "do_sample": False, "streamer": streamer,
                      "pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id}
            worker = threading.Thread(target=self._generate, args=(kwargs, streamer))
            worker.start()
            generated: list[int] = []
            text = ""
            while (token := streamer.tokens.get()) is not None:
                generated.append(token)
                full = self.tokenizer.decode(generated, skip_special_tokens=True)
                yield token, full[len(text):]
                text = full
            worker.join()

    def _generate(self, kwargs: dict[str, Any], streamer: TokenQueue) -> None:
        try:
            with torch.no_grad():
                self.model.generate(**kwargs)
        finally:
            streamer.end()


def make_handler(model: NaiveModel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                return self._json(404, {"error": "not found"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                ids = model.prompt_ids(self.path, body)
                max_new_tokens = int(body.get("max_tokens") or 16)
            except (ValueError, KeyError, TypeError) as error:
                return self._json(422, {"error": str(error)})
            chat = self.path == "/v1/chat/completions"
            if not body.get("stream"):
                pieces = [text for _, text in model.generate(ids, max_new_tokens)]
                message = {"message": {"role": "assistant", "content": "".join(pieces)}} if chat else {
                    "text": "".join(pieces)}
                return self._json(200, {"choices": [{"index": 0, **message, "finish_reason": "length"}],
                                        "usage": {"prompt_tokens": len(ids), "completion_tokens": len(pieces)}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            created, count = int(time.time()), 0
            for _, text in model.generate(ids, max_new_tokens):
                count += 1
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                self._event({"object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "choices": [choice]})
            self._event({"choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": count}})
            self.wfile.write(b"data: [DONE]\n\n")
            return None

        def _event(self, payload: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


class QueueingServer(ThreadingHTTPServer):
    request_queue_size = 1024  # every client waits on the lock; none is refused at connect
    daemon_threads = True


def parser() -> argparse.ArgumentParser:
    """``python -m bench.naive_server``'s command line."""
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    result.add_argument("--model", required=True)
    result.add_argument("--host", default="127.0.0.1")
    result.add_argument("--port", type=int, default=8000)
    return result


def main() -> None:
    args = parser().parse_args()
    server = QueueingServer((args.host, args.port), make_handler(NaiveModel(args.model)))
    server.serve_forever()


if __name__ == "__main__":
    main()
