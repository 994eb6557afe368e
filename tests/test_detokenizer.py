"""Incremental detokenization: the Rust DecodeStream path gives exactly the Python window's pieces."""

from __future__ import annotations

import random

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer, decode_stream_for

TRICKY = [
    "Hello 👋🏽 world, 日本語のテキスト, ça va? 🇫🇷\n\n  tabs\tand   spaces",
    "éèê" * 12 + "😀" * 9 + "한국어 텍스트",
    "<|im_start|>user\nhi<|im_end|> after the special tokens <|endoftext|>",
    "  leading spaces, trailing ones   ",
]


def pieces(tokenizer, ids: list[int], use_stream: bool) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, use_stream=use_stream)
    assert (detokenizer.stream is not None) == use_stream
    sent = [detokenizer.push(i) for i in ids]
    sent.append(detokenizer.finish())
    return sent, detokenizer.text


def id_cases(tokenizer, texts: list[str], random_cases: int) -> list[list[int]]:
    rng = random.Random(0)
    cases = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    return cases + [[rng.randrange(len(tokenizer)) for _ in range(120)] for _ in range(random_cases)]


def test_decode_stream_pieces_equal_the_python_window_on_tricky_text_and_random_ids(tiny_model):
    _, tokenizer = tiny_model
    for ids in id_cases(tokenizer, TRICKY, 60):  # random ids split UTF-8 bytes between tokens all the time
        streamed, text = pieces(tokenizer, ids, True)
        assert (streamed, text) == pieces(tokenizer, ids, False)
        assert "".join(streamed) == text == tokenizer.decode(ids, skip_special_tokens=True,
                                                             clean_up_tokenization_spaces=False)
    emoji = tokenizer("👋🏽", add_special_tokens=False)["input_ids"]  # two characters in six byte tokens
    assert pieces(tokenizer, emoji, True)[0] == ["", "", "👋", "", "", "🏽", ""]  # each one whole, never split


def test_decode_stream_matches_on_a_metaspace_tokenizer_with_byte_fallback():
    """A Llama-2 style tokenizer (sentencepiece pieces, ``▁`` for spaces, bytes as <0x..> tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens])
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    for ids in id_cases(tokenizer, ["the fox 日本 jumps 😀 over", " the  lazy dog"], 40):
        streamed, text = pieces(tokenizer, ids, True)
        assert (streamed, text) == pieces(tokenizer, ids, False)


class PythonOnly:
    """A tokenizer without a Rust backend (as a slow tokenizer is): only ``decode``."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def test_a_tokenizer_without_a_backend_uses_the_python_window(tiny_model):
    _, tokenizer = tiny_model
    assert decode_stream_for(PythonOnly(tokenizer)) is None
    ids = tokenizer(TRICKY[0], add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(PythonOnly(tokenizer))
    assert detokenizer.stream is None
    assert [detokenizer.push(i) for i in ids] + [detokenizer.finish()] == pieces(tokenizer, ids, True)[0]


@pytest.mark.parametrize("fails_at", [1, 5, 17])
def test_when_the_stream_refuses_a_step_the_python_window_takes_over_seamlessly(tiny_model, fails_at):
    _, tokenizer = tiny_model
    ids = id_cases(tokenizer, [], 1)[0]
    detokenizer = IncrementalDetokenizer(tokenizer)
    real, backend = detokenizer.stream
    calls = []

    class Refusing:
        def step(self, tokenizer_backend, token_id):
            calls.append(token_id)
            if len(calls) == fails_at:
                raise Exception("DecodeStream error: Invalid prefix encountered")
            return real.step(tokenizer_backend, token_id)

    detokenizer.stream = (Refusing(), backend)
    sent = [detokenizer.push(i) for i in ids] + [detokenizer.finish()]
    assert detokenizer.stream is None and len(calls) == fails_at
    assert sent == pieces(tokenizer, ids, False)[0]
