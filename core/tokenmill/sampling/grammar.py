"""Grammar-constrained decoding: JSON schemas and regular expressions, through llguidance.

A request's grammar is compiled and checked once, at validation (a broken schema
or regex is a 422). Each constrained sequence then gets its own matcher, which
says before every step which tokens may come next; the engine masks the logits of
constrained rows to those tokens, so the sampler can only pick text the grammar
accepts, and once the grammar is complete only the end-of-sequence token remains.
Unconstrained rows are never touched.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy
import torch

LARK_REGEX_SPECIALS = frozenset("\\.+*?()|[]{}^$#&-~/")
"""What a literal needs escaped inside a ``/.../`` regex of llguidance's Lark."""

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Compact JSON with the separators models are used to: free whitespace lets a small model pad forever."""


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message says why (answered with 422)."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - imported for from_tokenizer
    except ImportError:
        raise GrammarError("constrained output needs the `llguidance` package: pip install llguidance") from None
    return llguidance


GRAMMARS_DISABLED = ("grammar support is disabled on this server (--disable-grammar-support): no `grammar`, "
                     "JSON `response_format` or tools")


class GrammarCompiler:
    """Compiles grammars for one tokenizer. The tokenizer's token table is built on first use (~0.3 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int, disabled: bool = False) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.disabled = GRAMMARS_DISABLED if disabled else None
        """Why this server compiles no grammar (``--disable-grammar-support``); None: it does."""
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def _require_enabled(self) -> None:
        if self.disabled:
            raise GrammarError(self.disabled)

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                llguidance = _llguidance()
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def json_schema(self, schema: Any) -> Grammar:
        """A grammar for JSON documents valid against ``schema`` (a dict, or its JSON text)."""
        self._require_enabled()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        llguidance = _llguidance()
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as error:
            raise GrammarError(f"invalid JSON schema: {error}") from None
        return self._checked("json", source)

    def regex(self, pattern: str) -> Grammar:
        """A grammar for text that matches ``pattern`` as a whole."""
        self._require_enabled()
        return self._checked("regex", _llguidance().LLMatcher.grammar_from_regex(pattern))

    def lark(self, source: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (``%json {...}`` embeds a JSON schema)."""
        self._require_enabled()
        return self._checked("lark", source)

    def after_free_text(self, grammar: Grammar, end: str) -> Grammar:
        """``grammar`` after free text that ends at the first ``end`` (a reasoning section, such as
        everything up to ``</think>``), blank space allowed between: the model thinks freely, then
        its answer follows ``grammar``."""
        self._require_enabled()
        try:
            inner = [dict(part) for part in json.loads(grammar.source)["grammars"]]
        except (ValueError, KeyError, TypeError):  # a Lark grammar is its text
            inner = [{"lark_grammar": grammar.source}]
        inner[0]["name"] = "answer"
        free = "(?s:.*)" + "".join("\\" + char if char in LARK_REGEX_SPECIALS else char for char in end)
        outer = f"start: free_text SPACE? @answer\nfree_text[lazy]: /{free}/\nSPACE: /[ \\t\\r\\n]+/\n"
        return self._checked(grammar.kind, json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": outer},
                                                                     *inner]}))

    def _checked(self, kind: str, source: str) -> Grammar:
        llguidance = _llguidance()
        # Compiling is the check: the matcher built here is the start state every sequence copies.
        start = llguidance.LLMatcher(self.ll_tokenizer(), source, log_level=0, limits=compile_limits(llguidance))
        if start.is_error():
            lines = [line.strip() for line in start.get_error().splitlines() if line.strip()]
            raise GrammarError(f"invalid {kind} grammar: {' '.join(lines[:3])}")
        return Grammar(kind, start, self.vocab_size, source)


GRAMMAR_LIMITS = {"max_grammar_size": 200_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
                  "step_max_items": 50_000, "max_lexer_states": 100_000}
"""llguidance's limits on one grammar: its size, the work of building its lexer (about 20 ms of fuel) and
of each token's mask, so that no request's grammar takes unbounded time or memory."""


def compile_limits(llguidance: Any) -> Any:
    return llguidance.LLParserLimits(verbose_errors=False, **GRAMMAR_LIMITS)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar; ``new_matcher`` starts one sequence's walk through it."""

    kind: str
    start: Any
    """llguidance's matcher at the grammar's start, never advanced itself."""
    vocab_size: int
    source: str = ""
    """The grammar in llguidance's serialized form, for an engine that compiles grammars itself."""

    def new_matcher(self, end_ids: frozenset[int] = frozenset()) -> TokenMatcher:
        """A fresh walk: a copy of the start state (a thousand times cheaper than compiling again).
        ``end_ids`` are the tokens that end generation for this model (all may end a complete output)."""
        return TokenMatcher(self.start.deep_copy(), self.vocab_size, end_ids)


class TokenMatcher:
    """Where one sequence stands in its grammar: which tokens may come next, and accepting the chosen one."""

    def __init__(self, matcher: Any, vocab_size: int, end_ids: frozenset[int] = frozenset()) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.end_ids = end_ids
        """llguidance knows one end token (the tokenizer's); a model may end with others too."""

    def allowed(self) -> torch.Tensor:
        """A bool tensor ``[vocab_size]``: True for each token the grammar accepts next."""
        return batch_allowed([self])[0]

    def accept(self, token_id: int) -> None:
        if token_id in self.end_ids and self.matcher.is_accepting():
            return  # the output is complete and generation ends here
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} broke the grammar: {self.matcher.get_error()}")


def batch_allowed(matchers: list[TokenMatcher]) -> torch.Tensor:
    """The next-token masks of many sequences, ``[len(matchers), vocab_size]``, unpacked in one go
    (what the engine uses each step). One thread on purpose: llguidance's parallel fill is several
    times slower here, its pool fighting torch's spinning OpenMP threads for the cores."""
    import llguidance.torch as ll_torch

    vocab_size = matchers[0].vocab_size
    bitmask = ll_torch.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        ll_torch.fill_next_token_bitmask(matcher.matcher, bitmask, row)
    allowed = unpack_bitmask(bitmask, vocab_size)
    for row, matcher in enumerate(matchers):
        if matcher.end_ids and matcher.matcher.is_accepting():
            allowed[row, list(matcher.end_ids)] = True
    return allowed


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed masks (one bit per token in int32 words, ``[..., words]``) as bools ``[..., vocab_size]``.
    numpy's unpackbits does it in one pass, ~8x faster than shifting in torch; its 0/1 bytes are valid bools."""
    as_bytes = words.numpy().view(numpy.uint8)  # little-endian words: bit k of the mask is bit k%8 of byte k//8
    bits = numpy.unpackbits(as_bytes, axis=-1, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)[..., :vocab_size]


def grammar_from_parameter(compiler: GrammarCompiler, grammar: Any) -> Grammar:
    """TGI's ``grammar`` parameter: ``{"type": "json" | "json_schema" | "regex", "value": ...}``."""
    if not isinstance(grammar, dict) or "type" not in grammar or "value" not in grammar:
        raise GrammarError('`grammar` must be an object with `type` ("json", "json_schema" or "regex") and `value`')
    kind, value = grammar["type"], grammar["value"]
    if kind == "json":
        return compiler.json_schema(value)
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise GrammarError('`grammar`: a "json_schema" value is an object with `schema` (and an optional `name`)')
        return compiler.json_schema(value["schema"])
    if kind == "regex":
        if not isinstance(value, str):
            raise GrammarError("`grammar`: a regex value must be a string")
        return compiler.regex(value)
    raise GrammarError(f'`grammar.type` must be "json", "json_schema" or "regex", got {kind!r}')
