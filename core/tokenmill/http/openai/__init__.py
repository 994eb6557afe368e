"""OpenAI's API over the engine: request parsing (``parse``), response shapes (``shapes``), chat
templates and tools (``chat``) and the routes (``routes``)."""

from tokenmill.http.openai.parse import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_COMPLETION_LOGPROBS,
    MAX_TOP_LOGPROBS,
    OpenAIJob,
    choice_count,
    parse_chat,
    parse_completion,
    sampling_parameters,
)
from tokenmill.http.openai.routes import ChatCompletionsRoute, CompletionsRoute, ModelsRoute, OpenAIRoute, served_model
from tokenmill.http.openai.shapes import ChoiceStream, OpenAIStream, StopHoldback, sse_events, usage_json

__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "MAX_COMPLETION_LOGPROBS", "MAX_TOP_LOGPROBS", "ChatCompletionsRoute",
           "ChoiceStream", "CompletionsRoute", "ModelsRoute", "OpenAIJob", "OpenAIRoute", "OpenAIStream",
           "StopHoldback", "choice_count", "parse_chat", "parse_completion", "sampling_parameters", "served_model",
           "sse_events", "usage_json"]
