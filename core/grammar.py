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

import torch

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Compact JSON with the separators models are used to: free whitespace lets a small model pad forever."""

_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """The grammar cannot be compiled; the message says why (answered with 422)."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 - imported for from_tokenizer
    except ImportError:
        raise GrammarError("constrained output needs the `llguidance` package: pip install llguidance") from None
    return llguidance


class GrammarCompiler:
    """Compiles grammars for one tokenizer. The tokenizer's token table is built on first use (~0.3 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                llguidance = _llguidance()
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            return self._ll_tokenizer

    def json_schema(self, schema: Any) -> Grammar:
        """A grammar for JSON documents valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object")
        llguidance = _llguidance()
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as error:
            raise GrammarError(f"invalid JSON schema: {error}") from None
        return self._checked("json", source)

    def regex(self, pattern: str) -> Grammar:
        """A grammar for text that matches ``pattern`` as a whole."""
        return self._checked("regex", _llguidance().LLMatcher.grammar_from_regex(pattern))

    def lark(self, source: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (``%json {...}`` embeds a JSON schema)."""
        return self._checked("lark", source)

    def _checked(self, kind: str, source: str) -> Grammar:
        llguidance = _llguidance()
        tokenizer = self.ll_tokenizer()
        problem = llguidance.LLMatcher.validate_grammar(source, tokenizer)
        if problem:
            lines = [line.strip() for line in problem.splitlines() if line.strip()]
            raise GrammarError(f"invalid {kind} grammar: {' '.join(lines[:3])}")
        return Grammar(kind, source, tokenizer, self.vocab_size)


@dataclass(frozen=True)
class Grammar:
    """A checked grammar; ``new_matcher`` starts one sequence's walk through it."""

    kind: str
    source: str
    ll_tokenizer: Any
    vocab_size: int

    def new_matcher(self) -> TokenMatcher:
        llguidance = _llguidance()
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.source, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return TokenMatcher(matcher, self.vocab_size)


class TokenMatcher:
    """Where one sequence stands in its grammar: which tokens may come next, and accepting the chosen one."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """A bool tensor ``[vocab_size]``: True for each token the grammar accepts next."""
        import llguidance.torch as ll_torch

        bitmask = ll_torch.allocate_token_bitmask(1, self.vocab_size)
        ll_torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        return unpack_bitmask(bitmask[0], self.vocab_size)

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} broke the grammar: {self.matcher.get_error()}")


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed mask (one bit per token in int32 words) as a bool tensor ``[vocab_size]``."""
    bits = (words.unsqueeze(-1) >> _BIT_POSITIONS) & 1
    return bits.bool().view(-1)[:vocab_size]


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
