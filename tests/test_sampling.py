"""Sampling and detokenization: each logits rule does what TGI's does."""

from __future__ import annotations

import math

import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.sequence import SamplingParams
from tokenmill.sampling.sampler import SequenceSampler, uses_sampling, warp

LOGITS = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])


def kept(scores: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(scores.tolist()) if math.isfinite(v)]


def test_warpers_imply_sampling_as_in_tgi():
    assert not uses_sampling(SamplingParams())
    assert not uses_sampling(SamplingParams(temperature=1.0))
    assert uses_sampling(SamplingParams(temperature=0.5))
    assert uses_sampling(SamplingParams(top_k=3))
    assert uses_sampling(SamplingParams(do_sample=True))


def test_top_k_keeps_the_k_best():
    assert kept(warp(LOGITS, SamplingParams(top_k=2))) == [0, 1]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)
    assert probs[0] < 0.7 < probs[0] + probs[1]
    assert kept(warp(LOGITS, SamplingParams(top_p=0.7))) == [0, 1]
    assert kept(warp(LOGITS, SamplingParams(top_p=0.01))) == [0]


def test_typical_p_keeps_tokens_closest_to_the_entropy():
    flat = torch.zeros(6)
    assert len(kept(warp(flat, SamplingParams(typical_p=0.4)))) == 3


def test_temperature_sharpens_the_distribution():
    cold = warp(LOGITS, SamplingParams(temperature=0.5)).softmax(-1)
    assert cold[0] > LOGITS.softmax(-1)[0]


def test_extreme_temperatures_leave_a_distribution_to_sample_from():
    """Found by .ci/fuzz: a temperature of 5e-324 (0 in float32) turned the scores into inf and NaN."""
    masked = torch.cat([LOGITS, torch.tensor([-math.inf])])
    for temperature in (5e-324, 1e-40, 1e308):
        probs = warp(masked, SamplingParams(temperature=temperature)).softmax(-1)
        assert not probs.isnan().any() and abs(float(probs.sum()) - 1) < 1e-6 and probs[-1] == 0, temperature
    assert warp(masked, SamplingParams(temperature=5e-324)).softmax(-1)[0] == 1.0  # the limit: greedy
    assert torch.allclose(warp(masked, SamplingParams(temperature=1e308)).softmax(-1)[:-1], torch.full((6,), 1 / 6))


def test_the_smallest_repetition_penalty_keeps_scores_finite():
    sampler = SequenceSampler(SamplingParams(repetition_penalty=5e-324, do_sample=True), 1, [], 0)
    scores = sampler.process([0, 4, 5], LOGITS)  # LOGITS[4] is 0: not 0 / 0
    assert torch.isfinite(scores).all() and int(scores.argmax()) == 0
    assert math.isfinite(sampler.choose([0, 4, 5], LOGITS).logprob)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    sampler = SequenceSampler(SamplingParams(repetition_penalty=2.0), None, [], 0)
    scores = sampler.process([0, 5], LOGITS)
    assert scores[0] == 2.0 and scores[5] == -2.0 and scores[1] == 3.0


def test_frequency_penalty_subtracts_the_share_of_each_token_as_tgi_does():
    sampler = SequenceSampler(SamplingParams(frequency_penalty=0.5), None, [], 0)
    scores = sampler.process([1, 1, 2, 3], LOGITS)
    assert scores[1] == 3.0 - 0.5 * 2 / 4 and scores[2] == 2.0 - 0.5 / 4 and scores[0] == 4.0


def test_openai_penalties_count_only_generated_tokens_presence_once_and_frequency_per_occurrence():
    params = SamplingParams(presence_penalty=0.5, occurrence_penalty=0.25)
    sampler = SequenceSampler(params, None, [], 0, prompt_len=2)
    scores = sampler.process([0, 1, 2, 2, 3], LOGITS)  # prompt [0, 1]; generated [2, 2, 3]
    assert scores[0] == LOGITS[0] and scores[1] == LOGITS[1]
    assert scores[2] == LOGITS[2] - 0.5 - 2 * 0.25 and scores[3] == LOGITS[3] - 0.5 - 0.25


class ForbidZero:
    """A stand-in for a grammar matcher: everything but token 0 is allowed; records what it accepts."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def allowed(self) -> torch.Tensor:
        mask = torch.ones(6, dtype=torch.bool)
        mask[0] = False
        return mask

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)


def test_a_grammar_matcher_masks_the_choice_and_learns_the_chosen_token():
    matcher = ForbidZero()
    choice = SequenceSampler(SamplingParams(), None, [], 0, matcher=matcher).choose([], LOGITS)
    assert choice.token_id == 1 and matcher.accepted == [1]
    assert math.isclose(choice.logprob, float(LOGITS[1:].log_softmax(-1)[0]), rel_tol=1e-6)


def test_greedy_picks_the_argmax_with_its_logprob_and_top_tokens():
    choice = SequenceSampler(SamplingParams(), None, [], 3).choose([], LOGITS)
    assert choice.token_id == 0
    assert math.isclose(choice.logprob, float(LOGITS.log_softmax(-1)[0]), rel_tol=1e-6)
    assert [i for i, _ in choice.top] == [0, 1, 2]


def test_non_finite_logits_fail_the_choice_instead_of_emitting_nan():
    import pytest

    with pytest.raises(FloatingPointError):
        SequenceSampler(SamplingParams(), None, [], 0).choose([], torch.full((6,), float("nan")))


def test_same_seed_same_samples_and_another_seed_differs():
    params = SamplingParams(do_sample=True)

    def draws(seed: int) -> list[int]:
        sampler = SequenceSampler(params, seed, [], 0)
        return [sampler.choose([], torch.zeros(1000)).token_id for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_incremental_detokenizer_never_emits_broken_utf8(tiny_model):
    _, tokenizer = tiny_model
    text = "naïve café 日本語のテキスト 🚀🎉 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.finish())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert any(piece == "" for piece in pieces), "some tokens end inside a character and wait"


def test_min_p_keeps_only_tokens_near_the_best_and_one_keeps_only_the_best():
    # LOGITS' probabilities fall by a factor e per token: 0.3 of the best keeps 0 and 1 (1/e ≈ 0.37).
    assert kept(warp(LOGITS, SamplingParams(min_p=0.3))) == [0, 1]
    assert kept(warp(LOGITS, SamplingParams(min_p=1.0))) == [0]
    tied = torch.tensor([2.0, 2.0, 1.0])
    assert kept(warp(tied, SamplingParams(min_p=1.0))) == [0, 1]
    assert kept(warp(LOGITS, SamplingParams(min_p=0.3, temperature=5.0))) == [0, 1, 2, 3, 4, 5]


def test_min_p_alone_leaves_a_request_greedy():
    assert not uses_sampling(SamplingParams(min_p=0.5))


def test_logit_bias_is_added_before_greedy_and_sampled_choices():
    forced = SamplingParams(logit_bias=((5, 100.0),))
    assert SequenceSampler(forced, None, [], 0).choose([], LOGITS).token_id == 5
    banned = SamplingParams(logit_bias=((0, -100.0),))
    assert SequenceSampler(banned, None, [], 0).choose([], LOGITS).token_id == 1
    sampled = SequenceSampler(SamplingParams(do_sample=True, logit_bias=((4, 100.0),)), 3, [], 0)
    assert {sampled.choose([], LOGITS).token_id for _ in range(50)} == {4}
    logits = LOGITS.clone()
    SequenceSampler(forced, None, [], 0).choose([], logits)
    assert torch.equal(logits, LOGITS)  # the batch's logits are never changed in place


def test_min_tokens_holds_back_the_end_tokens_for_that_many_choices():
    sampler = SequenceSampler(SamplingParams(), None, [], 0, min_tokens=2, end_ids=frozenset({0, 3}))
    assert [sampler.choose([], LOGITS).token_id for _ in range(3)] == [1, 1, 0]
    assert SequenceSampler(SamplingParams(), None, [], 0, end_ids=frozenset({0})).choose([], LOGITS).token_id == 0


def test_min_tokens_yields_when_a_grammar_allows_only_an_end_token():
    class OnlyZero(ForbidZero):
        def allowed(self) -> torch.Tensor:
            return torch.tensor([True] + [False] * 5)

    sampler = SequenceSampler(SamplingParams(), None, [], 0, matcher=OnlyZero(), min_tokens=5,
                              end_ids=frozenset({0}))
    assert sampler.choose([], LOGITS).token_id == 0
