"""An asyncio load generator for streaming text-generation APIs.

Speaks TGI's ``/generate_stream`` (``tgi``), OpenAI's ``/v1/chat/completions`` (``chat``)
and ``/v1/completions`` (``completions``). A load is a list of prompts sent greedily with
a fixed ``max_new_tokens`` by ``concurrency`` workers, until every request is answered or
a time bound passes; a request cut by the bound counts its tokens so far as output.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

APIS = ("tgi", "chat", "completions")


@dataclass
class Prompt:
    """One request's input in both forms: chat messages, and the text the chat template makes of them."""

    id: str
    messages: list[dict[str, str]]
    text: str
    tokens: int = 0
    """The text's length in the model's tokens (0: not counted)."""


@dataclass
class RequestResult:
    started: float
    """Seconds after the load began."""
    ok: bool = False
    error: str | None = None
    finished: bool = False
    """False when the time bound cut the request while it streamed or waited."""
    ttft: float | None = None
    """Seconds from sending to the first streamed token."""
    latency: float | None = None
    prompt_tokens: int = 0
    """The prompt's tokens, counted once its first token arrived (the server then computed them)."""
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive streamed chunks, each divided by the tokens in the later one."""
    prompt_id: str = ""
    text: str = ""
    """The generated text: TGI's ``generated_text``, else the streamed pieces joined."""


@dataclass
class LoadReport:
    api: str
    concurrency: int
    sent: int
    completed: int
    failed: int
    unfinished: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p95: float
    itl_p50: float
    itl_p95: float
    latency_p50: float
    latency_p95: float
    latency_p99: float
    errors: list[str] = field(default_factory=list)
    """Up to five distinct error messages, so a failing peer says why."""
    peak_rss_mib: float | None = None
    prompt_tokens: int = 0
    """Prompt tokens of the requests whose first token arrived: the prefill work the level did."""
    itl_mean: float = math.nan
    """Seconds per output token after the first, over every completed request (the server's token
    counts: right where a chunk carries several tokens, as a speculating server's may)."""
    itl_p99: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def request_body(api: str, prompt: Prompt, max_new_tokens: int, model: str) -> tuple[str, dict[str, Any]]:
    """The route and JSON body of one greedy streaming request."""
    if api == "tgi":
        return "/generate_stream", {"inputs": prompt.text, "parameters": {
            "max_new_tokens": max_new_tokens, "do_sample": False, "details": True}}
    common = {"model": model, "max_tokens": max_new_tokens, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}}
    if api == "chat":
        return "/v1/chat/completions", {"messages": prompt.messages, **common}
    if api == "completions":
        return "/v1/completions", {"prompt": prompt.text, **common}
    raise ValueError(f"unknown api {api!r}; expected one of {', '.join(APIS)}")


@dataclass
class Chunk:
    """What one server-sent event carried: streamed tokens, a final token count, or an error."""

    tokens: int = 0
    usage_tokens: int | None = None
    error: str | None = None
    done: bool = False
    text: str = ""
    """The piece of generated text it carried."""
    final_text: str | None = None
    """TGI's last event: the whole generated text."""


def parse_event(api: str, data: str) -> Chunk:
    """Read one SSE ``data:`` payload of ``api``'s stream."""
    if data.strip() == "[DONE]":
        return Chunk(done=True)
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        return Chunk(error=f"not JSON: {data[:120]!r}")
    if not isinstance(event, dict):
        return Chunk(error=f"unexpected event: {data[:120]!r}")
    if event.get("error"):
        error = event["error"]
        return Chunk(error=str(error.get("message", error) if isinstance(error, dict) else error))
    if api == "tgi":
        details = event.get("details") or {}
        token = event.get("token") or {}
        return Chunk(tokens=1 if token else 0, usage_tokens=details.get("generated_tokens"),
                     done=event.get("generated_text") is not None,
                     text="" if token.get("special") else token.get("text") or "",
                     final_text=event.get("generated_text"))
    usage = event.get("usage") or {}
    choices = event.get("choices") or []
    tokens = 0
    piece = None
    if choices:
        choice = choices[0]
        piece = (choice.get("delta") or {}).get("content") if api == "chat" else choice.get("text")
        tokens = 1 if piece else 0
    return Chunk(tokens=tokens, usage_tokens=usage.get("completion_tokens"), text=piece or "")


async def sse_payloads(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, one per event."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


async def one_request(client: httpx.AsyncClient, api: str, prompt: Prompt, max_new_tokens: int, model: str,
                      result: RequestResult, headers: dict[str, str] | None = None) -> None:
    """Send one request and fill ``result`` as its stream arrives (so a cut request keeps its tokens)."""
    route, body = request_body(api, prompt, max_new_tokens, model)
    sent = time.perf_counter()
    last = sent
    usage_tokens = None
    pieces: list[str] = []
    try:
        async with client.stream("POST", route, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for payload in sse_payloads(response):
                chunk = parse_event(api, payload)
                if chunk.error:
                    result.error = chunk.error
                    return
                if chunk.tokens:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - sent
                        result.prompt_tokens = prompt.tokens
                    else:
                        result.gaps.append((now - last) / chunk.tokens)
                    last = now
                    result.tokens += chunk.tokens
                pieces.append(chunk.text)
                if chunk.final_text is not None:
                    pieces = [chunk.final_text]
                if chunk.usage_tokens is not None:
                    usage_tokens = chunk.usage_tokens
                if chunk.done:
                    break
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return
    finally:
        result.text = "".join(pieces)
    if usage_tokens is not None:
        result.tokens = usage_tokens  # a chunk may carry several tokens; the server's count is exact
    result.latency = time.perf_counter() - sent
    result.finished = True
    result.ok = result.tokens > 0
    if not result.ok:
        result.error = "the stream ended without a token"


async def run_load(base_url: str, api: str, prompts: list[Prompt], *, concurrency: int, requests: int,
                   max_new_tokens: int, time_bound_s: float, model: str = "model",
                   progress: Callable[[list[RequestResult], float], None] | None = None,
                   collect: list[RequestResult] | None = None) -> LoadReport:
    """Send ``requests`` requests (cycling through ``prompts``) with ``concurrency`` at once.

    Stops at ``time_bound_s``: requests still streaming then count as unfinished, with the
    tokens they already received counted as output. ``collect``, if given, receives every
    request's result (its prompt's id and generated text with it), in the order sent."""
    results: list[RequestResult] = []
    queue: asyncio.Queue[Prompt] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(prompts[index % len(prompts)])
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(time_bound_s + 60, connect=30)
    started = time.perf_counter()

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                result = RequestResult(started=time.perf_counter() - started, prompt_id=prompt.id)
                results.append(result)
                await one_request(client, api, prompt, max_new_tokens, model, result)

        async def report_progress() -> None:
            while progress is not None:
                await asyncio.sleep(2)
                progress(results, time.perf_counter() - started)

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        reporter = asyncio.create_task(report_progress())
        done, pending = await asyncio.wait(workers, timeout=time_bound_s)
        wall = time.perf_counter() - started
        for task in pending:
            task.cancel()
        reporter.cancel()
        await asyncio.gather(*workers, reporter, return_exceptions=True)
    if collect is not None:
        collect.extend(results)
    return summarize(api, concurrency, results, wall)


def mean_itl(completed: list[RequestResult]) -> float:
    """Streaming seconds after the first token over the tokens after the first, all requests together."""
    timed = [r for r in completed if r.latency is not None and r.ttft is not None and r.tokens > 1]
    tokens = sum(r.tokens - 1 for r in timed)
    return sum(r.latency - r.ttft for r in timed) / tokens if tokens else math.nan  # type: ignore[operator]


def summarize(api: str, concurrency: int, results: list[RequestResult], wall_s: float) -> LoadReport:
    completed = [r for r in results if r.ok]
    failed = [r for r in results if r.error]
    unfinished = [r for r in results if not r.finished and not r.error]
    tokens = sum(r.tokens for r in results if not r.error)
    ttfts = [r.ttft for r in completed if r.ttft is not None]
    gaps = [gap for r in completed for gap in r.gaps]
    latencies = [r.latency for r in completed if r.latency is not None]
    errors = list(dict.fromkeys(r.error for r in failed if r.error))[:5]
    return LoadReport(
        api=api, concurrency=concurrency, sent=len(results), completed=len(completed), failed=len(failed),
        unfinished=len(unfinished), output_tokens=tokens, wall_s=wall_s,
        tokens_per_s=tokens / wall_s if wall_s else 0.0,
        ttft_p50=percentile(ttfts, 50), ttft_p95=percentile(ttfts, 95),
        itl_p50=percentile(gaps, 50), itl_p95=percentile(gaps, 95), itl_p99=percentile(gaps, 99),
        itl_mean=mean_itl(completed),
        latency_p50=percentile(latencies, 50), latency_p95=percentile(latencies, 95),
        latency_p99=percentile(latencies, 99), errors=errors,
        prompt_tokens=sum(r.prompt_tokens for r in results if not r.error))
