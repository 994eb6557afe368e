"""OpenAI's response bodies and stream chunks, from the engine's results and events. Errors keep
TGI's ``{"error", "error_type"}`` body, which the ``openai`` client reads as the message."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import falcon.asgi

from tokenmill.engine.sequence import FINISH_LENGTH, FinalResult, GenerationRequest, TokenEvent, TokenInfo
from tokenmill.http.openai.convert import OpenAIJob
from tokenmill.http.openai.reading import OutputReader, ReadOutput, calls_json, read_output


def finish_reason(result: FinalResult, called: bool = False) -> str:
    """``tool_calls`` when the output is whole calls (and was not cut by ``max_tokens``)."""
    if called and result.finish_reason != FINISH_LENGTH:
        return "tool_calls"
    return "length" if result.finish_reason == FINISH_LENGTH else "stop"


def without_stop(text: str, stops: tuple[str, ...]) -> str:
    """OpenAI leaves the stop sequence out of the text (TGI keeps it)."""
    cuts = [text.find(stop) for stop in stops if stop in text]
    return text[: min(cuts)] if cuts else text


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprob(token: TokenInfo, top: list[TokenInfo]) -> dict[str, Any]:
    def entry(t: TokenInfo) -> dict[str, Any]:
        return {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}

    return {**entry(token), "top_logprobs": [entry(t) for t in top]}


def output_text(result: FinalResult, job: OpenAIJob, stops: tuple[str, ...]) -> str:
    """The text the parsers read: the output without its stop sequence, and with the special tokens
    the tool parser uses as markers (other special tokens are never text)."""
    markers = job.output.special_texts
    if not markers:
        return without_stop(result.generated_text, stops)
    return without_stop("".join(t.text for t in result.tokens if not t.special or t.text in markers), stops)


def final_output(result: FinalResult, job: OpenAIJob, stops: tuple[str, ...]) -> tuple[str, ReadOutput]:
    """A whole output's text and what the request's parsers read in it (all content when none reads)."""
    text = output_text(result, job, stops)
    return text, read_output(job.output, text, final=True) if job.output.reads else ReadOutput(content=text)


def chat_message(result: FinalResult, job: OpenAIJob, read: ReadOutput) -> tuple[dict[str, Any], str]:
    """The assistant's message and its finish reason: ``tool_calls`` when the output is whole calls. A
    call cut short (by ``max_tokens``) is still returned, its arguments as far as they got. With a
    reasoning parser the thinking is ``reasoning_content`` (vLLM's field) and ``reasoning``."""
    if not job.output.reads:
        return {"role": "assistant", "content": read.content}, finish_reason(result)
    message: dict[str, Any] = {"role": "assistant",
                               "content": None if read.calls and not read.content.strip() else read.content}
    if job.output.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = read.reasoning or None
    if read.calls:
        message["tool_calls"] = calls_json(read.calls)
    return message, finish_reason(result, read.finished_calls)


def reasoning_tokens(result: FinalResult, text: str, read: ReadOutput) -> int:
    """How many output tokens the reasoning took: those before the answer's text begins."""
    if not read.reasoning:
        return 0
    answer_starts = len(text) - len(read.content) if read.content or read.calls else len(text)
    count, position = 0, 0
    for token in result.tokens:
        if position >= answer_starts:
            break
        position += 0 if token.special else len(token.text)
        count += 1
    return count


def chat_completion_json(job: OpenAIJob, results: list[FinalResult]) -> dict[str, Any]:
    request = job.requests[0]
    outputs = [final_output(result, job, request.stop) for result in results]
    choices = []
    for index, (result, (_, read)) in enumerate(zip(results, outputs)):
        message, reason = chat_message(result, job, read)
        logprobs = None
        if job.logprobs:
            logprobs = {"content": [chat_logprob(t, top) for t, top in
                                    zip(result.tokens, result.top_tokens or [[]] * len(result.tokens))
                                    if not t.special]}
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": reason})
    completion_tokens = sum(r.generated_tokens for r in results)
    usage = usage_json(len(request.input_ids), completion_tokens, job.cached_tokens(results))
    if job.output.reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(
            reasoning_tokens(result, text, read) for result, (text, read) in zip(results, outputs))}
    return {**job.common("chat.completion"), "choices": choices, "usage": usage}


def completion_logprobs(tokens: list[TokenInfo], tops: list[list[TokenInfo]], start: int) -> dict[str, Any]:
    offsets, position = [], start
    for token in tokens:
        offsets.append(position)
        position += len(token.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [({t.text: t.logprob for t in top} if top else None) for top in tops],
            "text_offset": offsets}


def choice_logprobs(job: OpenAIJob, request: GenerationRequest, result: FinalResult) -> dict[str, Any]:
    """One completion choice's ``logprobs``. With ``echo`` they cover every token of the prompt and the
    completion, special ones too: a scorer (lm-evaluation-harness) lines them up with the token ids
    it sent, and reads the prompt's from the first (null) on. Without, the completion's text tokens."""
    generated = [] if job.scores_prompt else list(zip(result.tokens, result.top_tokens))
    if not job.echo:
        generated = [(token, top) for token, top in generated if not token.special]
    completion = completion_logprobs([t for t, _ in generated], [top for _, top in generated],
                                     len(request.inputs) if job.echo else 0)
    if not job.echo:
        return completion
    prompt = completion_logprobs(result.prefill, result.prefill_top or [[] for _ in result.prefill], 0)
    return {key: prompt[key] + completion[key] for key in prompt}


def completion_json(job: OpenAIJob, results: list[FinalResult]) -> dict[str, Any]:
    choices = []
    for index, result in enumerate(results):
        request = job.requests[index // job.n]
        text = "" if job.scores_prompt else without_stop(result.generated_text, request.stop)
        logprobs = choice_logprobs(job, request, result) if job.logprobs else None
        choices.append({"index": index, "text": (request.inputs if job.echo else "") + text,
                        "logprobs": logprobs, "finish_reason": finish_reason(result)})
    prompt_tokens = sum(len(r.input_ids) for r in job.requests)
    completion_tokens = 0 if job.scores_prompt else sum(r.generated_tokens for r in results)
    return {**job.common("text_completion"), "choices": choices,
            "usage": usage_json(prompt_tokens, completion_tokens, job.cached_tokens(results))}


class StopHoldback:
    """Streams text without the stop sequence: holds back any tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, text: str, held: int) -> str:
        """The text that can be sent now, given the new ``text`` and how many characters at the end of
        the output could begin a stop sequence (``TokenEvent.held``, counted by the engine)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        cut = without_stop(self.pending, self.stops)
        if len(cut) < len(self.pending):
            self.stopped, self.pending = True, ""
            return cut
        keep = min(held, len(self.pending))
        ready, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return ready

    def finish(self) -> str:
        rest, self.pending = ("" if self.stopped else self.pending), ""
        return rest


class ChoiceStream:
    """Turns one choice's token events into OpenAI stream chunks (chat or completion)."""

    def __init__(self, job: OpenAIJob, index: int, chat: bool) -> None:
        self.job, self.index, self.chat = job, index, chat
        self.request = job.requests[index // job.n]
        self.holdback = StopHoldback(self.request.stop)
        self.reader = OutputReader(job.output) if chat and job.output.reads else None
        """Reads reasoning and tool calls out of the output as it grows (None: the text is the content)."""
        self.markers = job.output.special_texts
        self.logprobs: list[Any] = []
        """Tokens' logprobs not sent yet: the reader may hold their text back a while."""
        self.offset = 0
        """Characters of this choice's text sent so far (completions' ``text_offset``)."""

    def opening(self) -> dict[str, Any] | None:
        if self.chat:
            return self._chunk({"role": "assistant", "content": ""}, None, None)
        if self.job.echo:
            self.offset = len(self.request.inputs)
            return self._text_chunk(self.request.inputs, None, None)
        return None

    def on_token(self, event: TokenEvent) -> list[dict[str, Any]]:
        token = event.token
        shown = not token.special or token.text in self.markers
        text = self.holdback.push(token.text, event.held) if shown else ""
        if event.final is not None:
            text += self.holdback.finish()
        logprobs = self._logprobs(event) if self.job.logprobs and not token.special else None
        if self.reader is None:
            chunks = [self._text_chunk(text, logprobs, None)] if text or logprobs else []
            if event.final is not None:
                chunks.append(self._text_chunk("", None, finish_reason(event.final)))
            return chunks
        if logprobs is not None:
            self.logprobs += logprobs["content"]
        chunks = []
        for delta in self.reader.push(text, event.final is not None):
            held, self.logprobs = ({"content": self.logprobs} if self.logprobs else None), []
            chunks.append(self._chunk(delta, held, None))
        if event.final is not None:
            chunks.append(self._chunk({}, None, finish_reason(event.final, self.reader.sent.finished_calls)))
        return chunks

    def _text_chunk(self, text: str, logprobs: Any, reason: str | None) -> dict[str, Any]:
        if self.chat:
            return self._chunk({"content": text} if text or not reason else {}, logprobs, reason)
        return {**self.job.common("text_completion"),
                "choices": [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}

    def _chunk(self, delta: dict[str, Any], logprobs: Any, reason: str | None) -> dict[str, Any]:
        return {**self.job.common("chat.completion.chunk"),
                "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}

    def _logprobs(self, event: TokenEvent) -> Any:
        if self.chat:
            return {"content": [chat_logprob(event.token, event.top_tokens)]}
        logprobs = completion_logprobs([event.token], [event.top_tokens], self.offset)
        self.offset += len(event.token.text)
        return logprobs


class OpenAIStream:
    """The SSE events of a streamed OpenAI response, from the (choice, event) pairs of its sequences."""

    def __init__(self, job: OpenAIJob, chat: bool) -> None:
        self.job = job
        self.choices = [ChoiceStream(job, i, chat) for i in range(len(job.requests) * job.n)]
        self.completion_tokens = 0
        self.finals: list[FinalResult | None] = [None] * len(self.choices)

    def opening(self) -> list[dict[str, Any]]:
        return [chunk for choice in self.choices if (chunk := choice.opening()) is not None]

    def on_event(self, index: int, event: TokenEvent) -> list[dict[str, Any]]:
        self.completion_tokens += 1
        if event.final is not None:
            self.finals[index] = event.final
        chunks = self.choices[index].on_token(event)
        if self.job.include_usage:
            for chunk in chunks:
                chunk["usage"] = None
        return chunks

    def closing(self) -> list[dict[str, Any]]:
        if not self.job.include_usage:
            return []
        prompt_tokens = sum(len(r.input_ids) for r in self.job.requests)
        kind = "chat.completion.chunk" if self.choices[0].chat else "text_completion"
        usage = usage_json(prompt_tokens, self.completion_tokens, self.job.cached_tokens(self.finals))
        return [{**self.job.common(kind), "choices": [], "usage": usage}]


async def sse_events(events: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[falcon.asgi.SSEvent]:
    """Each chunk as an SSE ``data:`` event, then ``data: [DONE]`` once the stream ends normally."""
    async for chunk in events:
        if chunk is None:
            yield falcon.asgi.SSEvent(data=b"[DONE]")
            return
        yield falcon.asgi.SSEvent(data=json.dumps(chunk).encode())
