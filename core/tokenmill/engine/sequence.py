"""A request as the engine sees it, and the events it streams back."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.config.settings import PRIORITY_CLASSES  # noqa: F401 - where schedulers import it
from tokenmill.engine.stream import EventSink, EventStream, as_stream
from tokenmill.sampling.params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.model.vision import ImagePrompt
    from tokenmill.sampling.grammar import Grammar

FINISH_LENGTH = "length"
FINISH_EOS = "eos_token"
FINISH_STOP = "stop_sequence"



@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: what the engine needs to run one sequence."""

    inputs: str
    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int = 0
    return_full_text: bool = False
    best_of: int = 1
    priority: str = "normal"
    """One of :data:`PRIORITY_CLASSES`; schedulers that rank requests read it."""
    grammar: Grammar | None = None
    """The grammar every generated token must follow, or None."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """The request's parameters as the client sent them, for hooks and logs."""
    adapter_id: str | None = None
    """The LoRA adapter the request asked for; None for the base model."""
    adapter: Any = None
    """That adapter's weights (a ``tokenmill.model.lora.Adapter``), pinned in memory while the request runs."""
    cache_salt: str | None = None
    """Only requests with the same salt share cached prompt blocks (so one tenant's timings tell
    nothing of another's prompts)."""
    tenant: str | None = None
    """Who sent it: an id derived from the API key it came with (None: the server wants no key).
    Without a ``cache_salt``, its cached prompt blocks are shared only with the same tenant's requests."""
    min_tokens: int = 0
    """vLLM's: no EOS, stop token id or stop sequence ends it before this many tokens (the length limit still does)."""
    ignore_eos: bool = False
    """vLLM's: the model's end-of-sequence tokens do not end it (they are kept in its output)."""
    stop_token_ids: tuple[int, ...] = ()
    """vLLM's: generating one of these ends it, as a stop sequence would."""
    images: ImagePrompt | None = None
    """The prompt's images, for a vision-language model (their pixels, and the positions their embeddings take)."""

    @property
    def cache_partition(self) -> str | None:
        """Its part of the prefix cache, besides the adapter: its salt, else its tenant's (None: the
        part every request without either shares). The parts are length-prefixed, so no salt can
        spell another tenant's part."""
        if self.cache_salt is not None:
            return length_prefixed("salt", self.cache_salt)
        return length_prefixed("key", self.tenant) if self.tenant is not None else None


def length_prefixed(*parts: str) -> str:
    """``parts`` joined so that no other parts join to the same text."""
    return "".join(f"{len(part)}:{part}" for part in parts)


@dataclass
class TokenInfo:
    id: int
    text: str
    logprob: float | None
    special: bool

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, "logprob": self.logprob, "special": self.special}


@dataclass
class TokenEvent:
    """One generated token; ``final`` is set on the sequence's last token."""

    index: int
    token: TokenInfo
    top_tokens: list[TokenInfo]
    final: FinalResult | None = None
    held: int = 0
    """Characters at the end of the text so far that could begin a stop sequence (a stream that
    leaves stop sequences out of its text holds them back)."""
    emitted_at: float = field(default_factory=time.monotonic)
    """When the engine made it (monotonic clock): what time to first token and inter-token latency read."""


@dataclass
class FinalResult:
    generated_text: str
    finish_reason: str
    tokens: list[TokenInfo]
    top_tokens: list[list[TokenInfo]]
    prefill: list[TokenInfo]
    seed: int | None
    input_length: int
    queue_seconds: float
    inference_seconds: float
    cached_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache instead of a prefill."""
    prefill_top: list[list[TokenInfo]] = field(default_factory=list)
    """The top tokens at each prompt position, as ``prefill`` (empty unless asked for with ``top_n_tokens``)."""
    draft_tokens: int = 0
    """With ``--speculate``: draft tokens the model checked for this sequence ..."""
    accepted_tokens: int = 0
    """... and tokens it produced beyond one a step thanks to them (TGI's skipped tokens)."""

    @property
    def generated_tokens(self) -> int:
        return len(self.tokens)

    def logprob_sum(self) -> float:
        return sum(t.logprob or 0.0 for t in self.tokens)


@dataclass
class ErrorEvent:
    message: str
    error_type: str = "generation"

    def as_json(self) -> dict[str, str]:
        """TGI's error body, as a stream's last event carries it."""
        return {"error": self.message, "error_type": self.error_type}


Event = TokenEvent | ErrorEvent

_ids = itertools.count(1)


class Sequence:
    """One generation in flight: its tokens, its sampling state, and the stream its events go to
    (``choice`` tags them: the sequences of one request share its stream)."""

    def __init__(self, request: GenerationRequest, stream: EventStream | EventSink,
                 seed: int | None, choice: int = 0) -> None:
        self.id = next(_ids)
        self.request = request
        self.stream = as_stream(stream)
        self.choice = choice
        self.seed = seed
        self.prompt_ids: list[int] = list(request.input_ids)
        self.generated_ids: list[int] = []
        self.num_computed = 0
        """Tokens whose keys and values the backend holds (while decoding, all but the newest);
        a preemption sets it back to 0."""
        self.cached_tokens = 0
        """Prompt tokens it took from the prefix cache when it first started."""
        self.block_hashes: list[bytes] = []
        """The names of its full blocks, as far as they were needed (see ``tokenmill.engine.kv_cache``)."""
        self.tokens: list[TokenInfo] = []
        self.top_tokens: list[list[TokenInfo]] = []
        self.prefill_tokens: list[TokenInfo] = []
        self.prefill_top_tokens: list[list[TokenInfo]] = []
        """The likeliest tokens at each prompt position (none at the first), when the request asks for top tokens."""
        self.finish_reason: str | None = None
        self.cancelled = False
        self.ended = False
        """Its last event (a final token or an error) was sent; nothing is sent after it."""
        self.paused_since: float | None = None
        """Since when its reader has let its stream's buffer stay full (None: it reads)."""
        self.arrived_at = time.monotonic()
        self.admitted_at: float | None = None
        """When it first joined the batch (a preemption does not reset it)."""
        self.state: Any = None
        """The engine's per-sequence state (``tokenmill.engine.output.SequenceState``: sampler,
        detokenizer), set when admitted."""
        self.speculation: Any = None
        """Its drafting with ``--speculate`` (``tokenmill.engine.speculation.DraftState``), set when it first drafts."""
        self.image_embeddings: Any = None
        """With :attr:`images`: their embeddings, one row per image token, set by the runner the
        first time it prefills them; a preemption keeps them, so a recompute does not encode the images again."""
        self.rotary_positions: Any = None
        """With :attr:`images`, for a model that places them with multimodal rotary positions (Qwen2-VL): its
        tokens' positions (``tokenmill.model.vision.RotaryPositions``), set by the runner before its first step."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated_ids)

    @property
    def token_ids(self) -> list[int]:
        """The prompt and the tokens generated so far."""
        return self.prompt_ids + self.generated_ids

    @property
    def pending_len(self) -> int:
        """Tokens still to prefill before it can decode."""
        return self.total_len - self.num_computed

    @property
    def max_tokens(self) -> int:
        """Prompt plus the most tokens it may generate: what it can occupy in the batch."""
        return self.prompt_len + self.request.max_new_tokens

    @property
    def images(self) -> ImagePrompt | None:
        """The prompt's images (a vision-language model's), which a runner encodes and places."""
        return self.request.images

    @property
    def cache_namespace(self) -> str:
        """What besides its tokens decides who may reuse its cached blocks: the LoRA adapter (which
        shapes its keys and values), and the cache salt or the tenant."""
        return length_prefixed(self.request.adapter_id or "", self.request.cache_partition or "")

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt details need every prompt position's logits: computed once, on the first prefill
        (not again after a preemption), and never taken from the prefix cache."""
        return self.request.decoder_input_details and not self.prefill_tokens

    @property
    def last_token(self) -> int:
        return self.generated_ids[-1] if self.generated_ids else self.prompt_ids[-1]

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, prompt={self.prompt_len}, generated={len(self.generated_ids)})"


def queue_entry(seq: Sequence, state: str, now: float) -> dict[str, Any]:
    """How ``GET /queue`` shows a sequence in ``state`` (waiting, prefilling, decoding, paused):
    ids, class, lengths and times, never prompt text."""
    started = seq.admitted_at if seq.admitted_at is not None and state != "waiting" else now
    return {"id": seq.id, "state": state, "priority": seq.request.priority, "prompt_tokens": seq.prompt_len,
            "generated_tokens": len(seq.generated_ids), "max_new_tokens": seq.request.max_new_tokens,
            "waited_seconds": round(max(0.0, started - seq.arrived_at), 3),
            "unsent_tokens": seq.stream.unsent(), "cached_tokens": seq.cached_tokens,
            "adapter_id": seq.request.adapter_id,
            "preempted": seq.admitted_at is not None and state == "waiting"}


def queue_snapshot(incoming: list[Sequence], waiting: tuple[Sequence, ...], prefilling: tuple[Sequence, ...],
               running: tuple[Sequence, ...], paused: Callable[[Sequence], bool]) -> dict[str, list[dict[str, Any]]]:
    """How ``GET /queue`` shows the pending sequences (``incoming`` then ``waiting``) and the running ones
    (``prefilling`` then ``running``, some of them ``paused``): ids, classes, lengths and times; never prompt text."""
    now = time.monotonic()
    return {"pending": [queue_entry(s, "waiting", now) for s in incoming + list(waiting)],
            "running": [queue_entry(s, "prefilling", now) for s in prefilling]
            + [queue_entry(s, "paused" if paused(s) else "decoding", now) for s in running]}
