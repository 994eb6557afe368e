"""The green-list watermark (Kirchenbauer et al. 2023): green lists, the logits bias, the z-test, the CLI."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from tokenmill.cli import main
from tokenmill.sampling.watermark import HASH_KEY, WatermarkProcessor, detect, detect_text, green_list

VOCAB = 49152  # SmolLM2's logits width, as in the tiny test model
GAMMA = 0.5
DELTA = 2.0


def test_the_seed_key_is_the_papers_prime():
    assert HASH_KEY == 15485863


def test_the_green_list_holds_a_gamma_share_of_distinct_vocabulary_ids():
    for gamma in (0.25, 0.5):
        green = green_list(7, VOCAB, gamma)
        assert green.dtype == torch.int64 and len(green) == int(gamma * VOCAB)
        assert len(torch.unique(green)) == len(green)
        assert 0 <= int(green.min()) and int(green.max()) < VOCAB


def test_the_green_list_depends_only_on_its_arguments():
    first = green_list(1234, VOCAB, GAMMA).clone()
    assert torch.equal(first, green_list(1234, VOCAB, GAMMA))
    generator = torch.Generator().manual_seed(HASH_KEY * 1234)
    assert torch.equal(first, torch.randperm(VOCAB, generator=generator)[: VOCAB // 2])


def test_different_previous_tokens_draw_independent_green_lists():
    a = set(green_list(1, VOCAB, GAMMA).tolist())
    b = set(green_list(2, VOCAB, GAMMA).tolist())
    assert a != b
    assert 0.45 < len(a & b) / len(a) < 0.55  # about gamma of one list is green in the other, as for independent draws


def test_green_list_rejects_a_gamma_outside_0_1():
    with pytest.raises(ValueError, match="gamma"):
        green_list(1, VOCAB, 1.0)


def test_the_processor_adds_delta_to_exactly_the_green_scores_of_the_last_tokens_list():
    scores = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    original = scores.clone()
    biased = WatermarkProcessor(GAMMA, DELTA)([5, 9, 42], scores)

    assert torch.equal(scores, original), "the input scores must not change"
    is_green = torch.zeros(VOCAB, dtype=torch.bool)
    is_green[green_list(42, VOCAB, GAMMA)] = True
    assert torch.allclose(biased[is_green] - scores[is_green], torch.tensor(DELTA))
    assert torch.equal(biased[~is_green], scores[~is_green])


def generate(steps: int, seed: int, watermark: WatermarkProcessor | None, allowed: torch.Tensor | None = None,
             first_token: int = 0) -> list[int]:
    """Sample ``steps`` tokens from fresh random logits at each step, as a stand-in for a model.

    ``allowed`` restricts sampling to those ids (the others get -inf).
    """
    generator = torch.Generator().manual_seed(seed)
    token_ids = [first_token]
    for _ in range(steps):
        logits = torch.randn(VOCAB, generator=generator) * 2
        if allowed is not None:
            logits = torch.full((VOCAB,), -math.inf).index_copy(0, allowed, logits[allowed])
        if watermark is not None:
            logits = watermark(token_ids, logits)
        token_ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return token_ids


SEEDS = (0, 1, 2, 3, 4)


def test_sampled_text_with_the_watermark_scores_far_above_the_threshold():
    processor = WatermarkProcessor(GAMMA, DELTA)
    for seed in SEEDS:
        assert detect(generate(200, seed, processor), VOCAB, GAMMA).z_score > 4


def test_sampled_text_without_the_watermark_scores_like_chance():
    z_scores = [detect(generate(200, seed, None), VOCAB, GAMMA).z_score for seed in SEEDS]
    assert abs(sum(z_scores) / len(z_scores)) < 2
    assert all(abs(z) < 4 for z in z_scores)


def green_successor(previous: int, vocab: int, gamma: float) -> int:
    return int(green_list(previous, vocab, gamma)[0])


def red_successor(previous: int, vocab: int, gamma: float) -> int:
    green = set(green_list(previous, vocab, gamma).tolist())
    return next(token for token in range(vocab) if token not in green)


def test_detect_counts_green_successors_and_applies_the_z_formula():
    vocab = 100
    tokens = [3]
    for successor in (green_successor, green_successor, green_successor, red_successor):
        tokens.append(successor(tokens[-1], vocab, GAMMA))

    score = detect(tokens, vocab, GAMMA)
    # T = 4 scored, 3 green: z = (3 - 0.5 * 4) / sqrt(4 * 0.5 * 0.5) = 1.
    assert (score.scored_tokens, score.green_tokens, score.green_fraction) == (4, 3, 0.75)
    assert score.z_score == pytest.approx(1.0)
    assert score.p_value == pytest.approx(0.158655, abs=1e-6)  # P(Z > 1)


def test_detect_with_gamma_a_quarter():
    vocab = 100
    tokens = [3]
    for _ in range(3):
        tokens.append(green_successor(tokens[-1], vocab, 0.25))
    # T = 3, all green: z = (3 - 0.75) / sqrt(3 * 0.25 * 0.75) = 3.
    assert detect(tokens, vocab, 0.25).z_score == pytest.approx(3.0)


def test_ignoring_repeated_bigrams_scores_each_pair_once():
    vocab = 100
    a = 3
    b = green_successor(a, vocab, GAMMA)
    repetitive = [a, b] * 5  # pairs (a, b) x5 and (b, a) x4
    a_after_b_is_green = a in green_list(b, vocab, GAMMA).tolist()

    every_pair = detect(repetitive, vocab, GAMMA)
    assert every_pair.scored_tokens == 9
    assert every_pair.green_tokens == 5 + 4 * a_after_b_is_green
    once_each = detect(repetitive, vocab, GAMMA, ignore_repeated_bigrams=True)
    assert once_each.scored_tokens == 2
    assert once_each.green_tokens == 1 + a_after_b_is_green


def test_detect_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        detect([5], VOCAB)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def word_tokens(tokenizer) -> torch.Tensor:
    """Ids of whole lowercase words with a leading space: text made of them tokenizes back to the same ids."""
    words = [token_id for token, token_id in tokenizer.get_vocab().items()
             if token.startswith("Ġ") and token[1:].isascii() and token[1:].isalpha() and token[1:].islower()]
    return torch.tensor(sorted(words))


@pytest.fixture(scope="module")
def watermarked_text(tokenizer, word_tokens) -> tuple[str, str]:
    """(prompt, a continuation sampled with the watermark seeded from the prompt's last token)."""
    prompt = "Once upon a time"
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    token_ids = generate(200, 0, WatermarkProcessor(GAMMA, DELTA), word_tokens, first_token=prompt_ids[-1])
    return prompt, tokenizer.decode(token_ids[1:])


def test_detect_text_scores_the_text_seeded_by_the_prompts_last_token(tokenizer, watermarked_text):
    prompt, text = watermarked_text
    with_prompt = detect_text(text, tokenizer, VOCAB, GAMMA, prompt=prompt)
    assert with_prompt.scored_tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert with_prompt.z_score > 4
    without_prompt = detect_text(text, tokenizer, VOCAB, GAMMA)
    assert without_prompt.scored_tokens == with_prompt.scored_tokens - 1


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_prints_the_score_as_one_json_object(tiny_model_dir, tokenizer, watermarked_text, capsys):
    prompt, text = watermarked_text
    code, out, _ = run_cli(["watermark-detect", "--model-id", str(tiny_model_dir), "--prompt", prompt, text], capsys)

    assert code == 0
    result = json.loads(out)
    assert set(result) == {"z_score", "p_value", "green_tokens", "scored_tokens", "green_fraction", "gamma",
                           "watermarked"}
    expected = detect_text(text, tokenizer, VOCAB, GAMMA, prompt=prompt)
    assert result["z_score"] == pytest.approx(expected.z_score)
    assert result["green_tokens"] == expected.green_tokens and result["scored_tokens"] == expected.scored_tokens
    assert result["gamma"] == GAMMA and result["watermarked"] is True


def test_cli_threshold_gamma_and_file(tiny_model_dir, watermarked_text, tmp_path, capsys, monkeypatch):
    _, text = watermarked_text
    (tmp_path / "text.txt").write_text(text)
    monkeypatch.setenv("WATERMARK_GAMMA", "0.25")
    code, out, _ = run_cli(["watermark-detect", "--model-id", str(tiny_model_dir), "--file",
                            str(tmp_path / "text.txt"), "--threshold", "1000"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["gamma"] == 0.25 and result["watermarked"] is False


def test_cli_can_score_each_bigram_once_for_repetitive_text(tiny_model_dir, capsys):
    repetitive = "the cat sat on the mat. " * 20
    code, out, _ = run_cli(["watermark-detect", "--model-id", str(tiny_model_dir), repetitive], capsys)
    every_pair = json.loads(out)
    code_once, out, _ = run_cli(["watermark-detect", "--model-id", str(tiny_model_dir), "--ignore-repeated-bigrams",
                                 repetitive], capsys)
    once_each = json.loads(out)
    assert code == code_once == 0
    assert once_each["scored_tokens"] < 10 < every_pair["scored_tokens"]


def test_cli_reads_stdin_when_given_no_text(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("plain text that nobody watermarked"))
    code, out, _ = run_cli(["watermark-detect", "--model-id", str(tiny_model_dir)], capsys)
    assert code == 0 and json.loads(out)["scored_tokens"] > 0


def test_cli_without_text_exits_2(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, out, err = run_cli(["watermark-detect", "--model-id", str(tiny_model_dir)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "no text" in err


def test_cli_with_an_unknown_model_exits_2(tmp_path, capsys):
    code, _, err = run_cli(["watermark-detect", "--model-id", str(tmp_path / "missing"), "some text"], capsys)
    assert code == 2 and err.count("\n") == 1 and "missing" in err
