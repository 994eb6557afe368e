"""Turning the embedding and score routes' inputs into token ids, on a validation worker, within the
server's limits: at most ``--max-client-batch-size`` inputs, each at most ``--max-input-tokens`` tokens
(cut instead when the request asks: TEI's ``truncate`` keeps the first tokens, vLLM's
``truncate_prompt_tokens`` the last N)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.http.schemas import ValidationError
from tokenmill.http.tgi.validation import Validator, token_id_prompt


@dataclass(frozen=True)
class Cut:
    """How a request asks long inputs to be cut: ``last`` tokens kept, or ``to_limit`` (the first ones)."""

    last: int | None = None
    to_limit: bool = False


def check_count(count: int, validator: Validator, field: str) -> None:
    limit = validator.config.max_client_batch_size
    if count > limit:
        raise ValidationError(f"`{field}` holds {count} inputs, more than the {limit} a request may "
                              f"(--max-client-batch-size)")


def within_limit(token_ids: list[int], validator: Validator, cut: Cut, field: str) -> list[int]:
    limit = validator.config.max_input_tokens
    assert limit is not None
    if cut.last is not None:
        if cut.last > limit:
            raise ValidationError(f"`truncate_prompt_tokens` must be <= {limit}. Given: {cut.last}")
        token_ids = token_ids[-cut.last:]
    elif cut.to_limit:
        token_ids = token_ids[:limit]
    if len(token_ids) > limit:
        raise ValidationError(f"`{field}` must have at most {limit} tokens. Given: {len(token_ids)}")
    return token_ids


def encode(validator: Validator, text: str | list[int], cut: Cut, field: str,
           add_special_tokens: bool = True) -> list[int]:
    """One input's token ids: a text tokenized (with the special tokens the model expects), or token ids checked."""
    if isinstance(text, str):
        if not text:
            raise ValidationError(f"`{field}` cannot hold an empty string")
        token_ids = list(validator.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    else:
        token_ids = token_id_prompt(text, validator.vocab_size, field)
    if not token_ids:
        raise ValidationError(f"`{field}` cannot be empty")
    return within_limit(token_ids, validator, cut, field)


def encode_all(validator: Validator, texts: list[str] | list[str | list[int]], cut: Cut, field: str,
               add_special_tokens: bool = True) -> list[tuple[list[int], None]]:
    """A request's inputs, each encoded alone (:func:`encode`), at most ``--max-client-batch-size`` of them."""
    check_count(len(texts), validator, field)
    return [(encode(validator, text, cut, field, add_special_tokens), None) for text in texts]


def encode_pair(validator: Validator, first: str, second: str, cut: Cut, field: str) -> tuple[list[int], list[int]]:
    """A cross-encoder's input: the two texts as one sequence (the tokenizer's pair template), with token types.
    A pair cut to the limit loses the end of ``second``."""
    if not first or not second:
        raise ValidationError(f"`{field}` cannot hold an empty string")
    limit = validator.config.max_input_tokens
    cut_second = cut.to_limit or cut.last is not None
    try:
        encoding = validator.tokenizer(first, second, truncation="only_second" if cut_second else False,
                                       max_length=min(limit, cut.last or limit) if cut_second else None)
    except Exception as error:  # noqa: BLE001 - the tokenizer's: cutting the document cannot make the pair fit
        raise ValidationError(f"`query` is too long to pair with `{field}` within {limit} tokens ({error})") from None
    token_ids = list(encoding["input_ids"])
    types = encoding.get("token_type_ids")
    if len(token_ids) > (limit or 0):
        raise ValidationError(f"`{field}` must have at most {limit} tokens as a pair with the query. "
                              f"Given: {len(token_ids)}")
    return token_ids, list(types) if types is not None else None  # type: ignore[return-value]


def texts_of(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def document_text(document: str | dict[str, object], index: int) -> str:
    """A rerank document: a string, or Jina's and Cohere's ``{"text": ...}``."""
    if isinstance(document, str):
        return document
    text = document.get("text")
    if not isinstance(text, str):
        raise ValidationError(f"`documents[{index}]` must be a string or an object with a string `text`")
    return text
