"""Tests for the VPO set reward / advantage (VPO-SPEC section 3) and the baselines of section 4."""

import inspect
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo_lightning.core.advantages import (
    gdpo,
    group_normalize,
    grpo,
    max_at_k,
    max_at_k_contributions,
    multi_rlvr,
    random_weight_grpo,
    restrict_weights,
    sample_weights,
    set_rewards,
    vpo_advantages,
)
from vpo_lightning.core.estimators import CHAIN_ESTIMATORS, ESTIMATORS, WEIGHTED_ESTIMATORS

ATOL = 1e-4  # eps = 1e-6 in the denominators shifts hand-computed advantages by ~1e-6


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def reward_tensors(draw, max_b=3, max_g=5, max_m=4, max_d=4, m=None):
    """[B, G, m, D] tensors in [0, 1]; values from a small grid so that ties and duplicates happen."""
    b, g = draw(st.integers(1, max_b)), draw(st.integers(1, max_g))
    m = m or draw(st.integers(1, max_m))
    d = draw(st.integers(1, max_d))
    values = draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.8, 1.0]), min_size=b * g * m * d,
                           max_size=b * g * m * d))
    return torch.tensor(values).view(b, g, m, d)


# ----------------------------------------------------------------------------------------------- hand-worked
def test_vpo_hand_computed():
    weights = torch.tensor([[1.0, 0.0], [0.5, 0.5]])  # K = 2 shared weights
    rewards = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]],  # chain 0: w1 -> max(1, 0) = 1; w2 -> max(.5, .5) = .5
                             [[0.5, 0.5], [0.5, 0.5]]]])  # chain 1: w1 -> .5; w2 -> .5
    # R = [(1 + .5) / 2, (.5 + .5) / 2] = [0.75, 0.5]
    torch.testing.assert_close(set_rewards(rewards, weights), torch.tensor([[0.75, 0.5]]))
    # mean .625, population std .125 -> A = (+.125, -.125) / .125 = (+1, -1)
    torch.testing.assert_close(vpo_advantages(rewards, weights=weights), torch.tensor([[1.0, -1.0]]),
                               atol=ATOL, rtol=0)
    # chain 0 without its first candidate: only [0, 1] left -> w1: 0, w2: .5 -> R = .25
    mask = torch.tensor([[[False, True], [True, True]]])
    torch.testing.assert_close(set_rewards(rewards, weights, mask), torch.tensor([[0.25, 0.5]]))
    # an all-missing chain scores 0
    torch.testing.assert_close(set_rewards(rewards, weights, torch.zeros(1, 2, 2, dtype=torch.bool)),
                               torch.zeros(1, 2))


def test_per_group_weights_are_used_per_group():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2).repeat(2, 1, 1, 1)  # [2, 2, 1, 2]
    weights = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # [B=2, K=1, D=2]
    # group 0 values dimension 0 -> R = [1, 0]; group 1 values dimension 1 -> R = [0, 1]
    torch.testing.assert_close(set_rewards(rewards, weights), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))


def test_group_normalize_hand_computed():
    # mean 2.5, population std sqrt(((1.5)^2 + (.5)^2) * 2 / 4) = sqrt(1.25) = 1.118034
    expected = torch.tensor([[-1.5, -0.5, 0.5, 1.5]]) / math.sqrt(1.25)
    torch.testing.assert_close(group_normalize(torch.tensor([[1.0, 2.0, 3.0, 4.0]])), expected, atol=ATOL, rtol=0)
    assert torch.equal(group_normalize(torch.tensor([[3.0, 3.0], [1.0, 1.0 + 1e-8]])), torch.zeros(2, 2))


def test_multi_rlvr_sums_every_present_row_with_the_sample_std():
    """The reference's Multi-RLVR: the sum of f over the chain's present answers (repeats were dropped upstream by
    the answer itself), GRPO-normalised with the sample std. Equal reward vectors are not duplicates."""
    row = [1.0, 0.0, 0.0, 1.0]  # f = .5
    rewards = torch.tensor([[[row, row, row],  # three different answers sharing a vector: 1.5 (not .5)
                             [row, row, row],  # the same rows, two of them absent (repeats or unparsed): .5
                             [[0.0] * 4] * 3]])  # nothing: 0
    mask = torch.tensor([[[True, True, True], [True, False, False], [True, True, True]]])
    # sums [1.5, .5, 0], mean 2/3, deviations [5/6, -1/6, -2/3], sample variance (25 + 1 + 16) / 36 / 2 = 7/12
    expected = torch.tensor([[5 / 6, -1 / 6, -2 / 3]]) / math.sqrt(7 / 12)
    torch.testing.assert_close(multi_rlvr(rewards, mask), expected, atol=ATOL, rtol=0)
    # two chains: ddof 1 gives +-1/sqrt(2) (ddof 0 would give +-1)
    two = torch.tensor([[[row, row], [row, [0.0] * 4]]])
    torch.testing.assert_close(multi_rlvr(two), torch.tensor([[1.0, -1.0]]) / math.sqrt(2), atol=ATOL, rtol=0)
    # tool use / MuSiQue (the reference's dedup_by_vector): an answer whose vector repeats an earlier present
    # answer's counts 0, so chain 0 sums .5 like chain 1; chain 2 [row, other, row] sums .5 + .25
    other = [1.0, 0.0, 0.0, 0.0]
    three = torch.tensor([[[row, row, row], [row, row, row], [row, other, row]]])
    # sums [.5, .5, .75]: mean 7/12, deviations [-1/12, -1/12, 1/6], sample variance (1 + 1 + 4) / 144 / 2 = 1/48
    expected = torch.tensor([[-1 / 12, -1 / 12, 1 / 6]]) / math.sqrt(1 / 48)
    torch.testing.assert_close(multi_rlvr(three, mask, vector_repeats=True), expected, atol=ATOL, rtol=0)


def test_random_weight_grpo_hand_computed_and_sampling():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    weights = torch.tensor([[[0.25, 0.75]]])  # [B=1, K=1, D=2]
    # w.s = [.25, .75]: mean .5, std .25 -> [-1, +1]
    torch.testing.assert_close(random_weight_grpo(rewards, weights=weights), torch.tensor([[-1.0, 1.0]]),
                               atol=ATOL, rtol=0)
    # Without weights it draws one vector per group with the generator, exactly like sample_weights(1, ...).
    rewards = torch.rand(3, 4, 1, 5, generator=_gen(1))
    drawn = sample_weights(1, 5, num_groups=3, generator=_gen(7))
    for name in WEIGHTED_ESTIMATORS:
        torch.testing.assert_close(ESTIMATORS[name](rewards, generator=_gen(7)),
                                   ESTIMATORS[name](rewards, weights=drawn))


def test_max_at_k_hand_computed():
    scores = torch.tensor([[0.1, 0.4, 0.2, 0.8]])
    # k = 2: the 6 pairs and their maxima: {.1,.2}:.2 {.1,.4}:.4 {.1,.8}:.8 {.2,.4}:.4 {.2,.8}:.8 {.4,.8}:.8
    # sum of maxima over the pairs holding each sample: .1 -> .2+.4+.8 = 1.4; .4 -> .4+.4+.8 = 1.6;
    # .2 -> .2+.4+.8 = 1.4; .8 -> 3 * .8 = 2.4; divided by C(4, 2) = 6
    expected = torch.tensor([[1.4, 1.6, 1.4, 2.4]]) / 6
    torch.testing.assert_close(max_at_k_contributions(scores, 2), expected)
    # the contributions sum to k * max@k = 2 * (.2 + .4 + .8 + .4 + .8 + .8) / 6 = 2 * 3.4 / 6
    assert math.isclose(float(expected.sum()), 2 * 3.4 / 6, rel_tol=1e-6)
    # advantage: [1.4, 1.6, 1.4, 2.4] / 6 has mean 1.7 / 6, deviations [-.3, -.1, -.3, .7] / 6, and the sample
    # std (ddof 1, as the reference's torch.std) sqrt((.09 + .01 + .09 + .49) / 3) / 6 = sqrt(.68 / 3) / 6
    rewards = scores.view(1, 4, 1, 1)  # G = 4 -> default k = max(2, 4 // 2) = 2
    torch.testing.assert_close(max_at_k(rewards), torch.tensor([[-0.3, -0.1, -0.3, 0.7]]) / math.sqrt(0.68 / 3),
                               atol=ATOL, rtol=0)


def test_gdpo_hand_computed():
    rewards = torch.tensor([[[1.0, 0.0], [0.0, 0.0]],  # group 0: dim 0 -> a * [+1, -1]; dim 1 flat -> [0, 0]
                            [[1.0, 1.0], [0.0, 0.0]]]).unsqueeze(2)  # group 1: both dims a * [+1, -1]
    # per dimension, [1, 0] has mean .5 and sample std sqrt(.5) -> a = .5 / sqrt(.5) = sqrt(.5)
    # summed: a * [[1, -1], [2, -2]]; one weight per rollout: batch mean 0, Bessel variance a^2 * 10 / 3
    expected = torch.tensor([[1.0, -1.0], [2.0, -2.0]]) / math.sqrt(10 / 3)
    torch.testing.assert_close(gdpo(rewards), expected, atol=ATOL, rtol=0)


def test_gdpo_whitens_token_weighted_as_the_reference():
    rewards = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]]).unsqueeze(2)
    counts = torch.tensor([[3.0, 1.0], [2.0, 2.0]])  # generated tokens per rollout, T = 8
    # summed a * [[1, -1], [2, -2]] (above); token mean a * (3 - 1 + 4 - 4) / 8 = a / 4; deviations
    # a * [[3, -5], [7, -9]] / 4; variance a^2 * (3 * 9 + 1 * 25 + 2 * 49 + 2 * 81) / 16 / (8 - 1) = a^2 * 312 / 112
    expected = torch.tensor([[3.0, -5.0], [7.0, -9.0]]) / 4 / math.sqrt(312 / 112)
    torch.testing.assert_close(gdpo(rewards, token_counts=counts), expected, atol=ATOL, rtol=0)
    # 5 tokens each: token mean 0, variance 5 * a^2 * 10 / (20 - 1) = 25 / 19 (Bessel over tokens, not rollouts)
    expected = math.sqrt(0.5) * torch.tensor([[1.0, -1.0], [2.0, -2.0]]) / math.sqrt(25 / 19)
    torch.testing.assert_close(gdpo(rewards, token_counts=torch.full((2, 2), 5.0)), expected, atol=ATOL, rtol=0)


def test_grpo_uses_the_sample_std_like_the_reference():
    rewards = torch.tensor([0.25, 0.5, 0.75, 1.0]).view(1, 4, 1, 1)
    # mean .625, deviations [-.375, -.125, .125, .375], sample variance (2 * .140625 + 2 * .015625) / 3 = .3125 / 3
    expected = torch.tensor([[-0.375, -0.125, 0.125, 0.375]]) / math.sqrt(0.3125 / 3)
    torch.testing.assert_close(grpo(rewards), expected, atol=ATOL, rtol=0)
    # VPO keeps the population std (VPO-SPEC section 3): sqrt(.3125 / 4), so its values are sqrt(4 / 3) larger
    torch.testing.assert_close(vpo_advantages(rewards), expected * math.sqrt(4 / 3), atol=ATOL, rtol=0)


def test_max_at_k_rejects_k_at_or_above_the_group_size_and_takes_a_set_k():
    with pytest.raises(ValueError, match=r"k < G .* k=2, G=2"):
        max_at_k(torch.rand(3, 2, 1, 1, generator=_gen(0)))  # default k = max(2, 2 // 2) = 2 = G
    with pytest.raises(ValueError, match=r"k=4, G=4"):
        max_at_k(torch.rand(1, 4, 1, 1, generator=_gen(0)), k=4)
    scores = torch.tensor([[0.1, 0.4, 0.2, 0.8]])
    # k = 3: the 4 triples and their maxima {.1,.4,.2}:.4, {.1,.4,.8}:.8, {.1,.2,.8}:.8, {.4,.2,.8}:.8; each sample
    # sums the maxima of the 3 triples holding it: .1 -> 2.0, .4 -> 2.0, .2 -> 2.0, .8 -> 2.4 (all / C(4, 3) = 4)
    # -> mean 2.1 / 4, deviations [-.1, -.1, -.1, .3] / 4, sample std sqrt(.12 / 3) / 4
    expected = torch.tensor([[-0.1, -0.1, -0.1, 0.3]]) / math.sqrt(0.12 / 3)
    torch.testing.assert_close(max_at_k(scores.view(1, 4, 1, 1), k=3), expected, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------- per-row D
def test_f_baselines_average_over_the_real_dimensions_only():
    # group 0 has 3 real dimensions of 5, group 1 all 5; padding holds garbage that must not count
    rewards = torch.tensor([[[1.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0, 0.0]],
                            [[1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]]).unsqueeze(2)  # [2, 2, 1, 5]
    dim_mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    # f: group 0 [2/3, 1/3] (not [4/5, 1/5]); group 1 [4/5, 0]; two rollouts, ddof 1 -> (+-d/2) / (|d| / sqrt 2)
    expected = torch.tensor([[1.0, -1.0], [1.0, -1.0]]) / math.sqrt(2)
    torch.testing.assert_close(grpo(rewards, dim_mask=dim_mask), expected, atol=ATOL, rtol=0)
    # max@k with G = 3, k = 2: f of group 0 = [2/3, 1/3, 0] with the padding ignored
    three = torch.cat([rewards[:1], torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]).view(1, 1, 1, 5)], dim=1)
    f = torch.tensor([[2 / 3, 1 / 3, 0.0]])
    torch.testing.assert_close(max_at_k(three, dim_mask=dim_mask[:1]), max_at_k(f.view(1, 3, 1, 1)))
    # multi-RLVR: the garbage in padding dimension 3 counts nowhere
    chain = torch.tensor([[[[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]], [[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]])
    # real dims 0..2: chain 0 = 1/3 + 1/3, chain 1 = 2/3 + 0: no spread (over all 4: .5 + .25 against .5)
    assert torch.equal(multi_rlvr(chain, dim_mask=torch.tensor([[True, True, True, False]])), torch.zeros(1, 2))
    assert multi_rlvr(chain).abs().sum() > 0  # with dimension 3 real, the chains differ


def test_weights_live_on_the_real_dimensions_only():
    weights = torch.tensor([[[0.5, 0.25, 0.25]]])  # [B=1, K=1, D=3]
    dim_mask = torch.tensor([[True, True, False]])
    # restricted and renormalised: [.5, .25] / .75 = [2/3, 1/3, 0]
    torch.testing.assert_close(restrict_weights(weights, dim_mask), torch.tensor([[[2 / 3, 1 / 3, 0.0]]]))
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]).view(1, 2, 1, 3)
    # w.s = [2/3, 1/3] (the padding's 1.0 in rollout 0 counts nothing): mean .5, population std 1/6 -> [+1, -1]
    for name in ("vpo", "random_weight_grpo", "goal_conditioned_grpo"):
        got = ESTIMATORS[name](rewards, weights=weights, dim_mask=dim_mask)
        torch.testing.assert_close(got, torch.tensor([[1.0, -1.0]]), atol=ATOL, rtol=0)
    # drawn weights: Dirichlet(1) over the 3 real dimensions of 5 -> mean 1/3, variance (1/3)(2/3) / 4 = 1/18
    w = restrict_weights(sample_weights(20_000, 5, num_groups=1, generator=_gen(0)),
                         torch.tensor([[True, False, True, True, False]]))[0]
    assert torch.equal(w[:, [1, 4]], torch.zeros(20_000, 2))
    torch.testing.assert_close(w[:, [0, 2, 3]].mean(0), torch.full((3,), 1 / 3), atol=0.01, rtol=0)
    torch.testing.assert_close(w[:, [0, 2, 3]].var(0), torch.full((3,), 1 / 18), atol=0, rtol=0.06)


def test_vpo_with_a_dim_mask_equals_vpo_on_the_real_dimensions():
    rewards = torch.rand(2, 4, 3, 5, generator=_gen(1))
    dim_mask = torch.tensor([[True, True, True, False, False], [True, False, True, True, True]])
    weights = sample_weights(30, 5, num_groups=2, generator=_gen(2))
    got = ESTIMATORS["vpo"](rewards, weights=weights, dim_mask=dim_mask)
    for b in range(2):
        real = dim_mask[b]
        w = weights[b][:, real] / weights[b][:, real].sum(-1, keepdim=True)
        torch.testing.assert_close(got[b : b + 1], vpo_advantages(rewards[b : b + 1, ..., real], weights=w))
    # without weights it draws with the generator exactly as vpo_advantages does, then restricts
    torch.testing.assert_close(ESTIMATORS["vpo"](rewards, num_weights=30, generator=_gen(2), dim_mask=dim_mask), got)
    with pytest.raises(ValueError, match="at least one real dimension"):
        grpo(rewards[:, :, :1], dim_mask=torch.tensor([[True] * 5, [False] * 5]))


# ----------------------------------------------------------------------------------------------- properties
def _brute_max_at_k(scores: list[float], k: int) -> list[float]:
    subsets = list(itertools.combinations(range(len(scores)), k))
    return [sum(max(scores[j] for j in s) for s in subsets if i in s) / len(subsets) for i in range(len(scores))]


@settings(max_examples=60, deadline=None)
@given(scores=st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.9, 1.0]), min_size=1, max_size=7), data=st.data())
def test_max_at_k_equals_brute_force_enumeration(scores, data):
    k = data.draw(st.integers(1, len(scores)))
    got = max_at_k_contributions(torch.tensor([scores], dtype=torch.float64), k)
    torch.testing.assert_close(got, torch.tensor([_brute_max_at_k(scores, k)], dtype=torch.float64))


def test_max_at_k_default_k_is_half_the_group():
    scores = torch.rand(2, 8, generator=_gen(3))
    brute = torch.tensor([_brute_max_at_k(row.tolist(), 4) for row in scores])  # k = max(2, 8 // 2) = 4
    expected = (brute - brute.mean(1, keepdim=True)) / (brute.std(1, keepdim=True) + 1e-6)  # sample std
    torch.testing.assert_close(max_at_k(scores.view(2, 8, 1, 1)), expected, atol=1e-5, rtol=0)


@settings(max_examples=40, deadline=None)
@given(rewards=reward_tensors(), data=st.data())
def test_set_reward_invariant_to_permuting_and_duplicating_candidates(rewards, data):
    b, g, m, d = rewards.shape
    weights = sample_weights(16, d, num_groups=b, generator=_gen(0))
    base = set_rewards(rewards, weights)
    perm = torch.tensor(data.draw(st.permutations(range(m))))
    dup = torch.tensor(data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=3)))
    torch.testing.assert_close(set_rewards(rewards[:, :, perm], weights), base)
    torch.testing.assert_close(set_rewards(torch.cat([rewards, rewards[:, :, dup]], dim=2), weights), base)


@settings(max_examples=30, deadline=None)
@given(row=reward_tensors(max_g=1, m=1), g=st.integers(1, 6), name=st.sampled_from(sorted(ESTIMATORS)))
def test_constant_group_gets_zero_advantage(row, g, name):
    g = max(g, 3) if name == "max_at_k" else g  # max@k needs G > k = max(2, G // 2)
    rewards = row.expand(-1, g, -1, -1)  # every rollout of each group identical
    assert torch.equal(ESTIMATORS[name](rewards, generator=_gen(0)), torch.zeros(rewards.shape[:2]))


@settings(max_examples=30, deadline=None)
@given(rewards=reward_tensors(m=1, max_d=1))
def test_vpo_with_one_answer_and_one_dimension_is_grpo(rewards):
    expected = group_normalize(rewards[:, :, 0, 0])  # every weight on the 1-simplex is [1]
    torch.testing.assert_close(vpo_advantages(rewards, generator=_gen(0)), expected)
    g = rewards.shape[1]  # GRPO divides by the sample std, sqrt(G / (G - 1)) times the population std
    grpo_expected = expected * math.sqrt((g - 1) / g) if g > 1 else torch.zeros_like(expected)
    torch.testing.assert_close(grpo(rewards), grpo_expected, atol=1e-5, rtol=1e-4)


def test_sample_weights_simplex_moments_and_reproducibility():
    assert sample_weights(5, 3).shape == (5, 3) and sample_weights(5, 3, num_groups=2).shape == (2, 5, 3)
    assert torch.equal(sample_weights(4, 3, 0.5, generator=_gen(2)), sample_weights(4, 3, 0.5, generator=_gen(2)))
    for alpha in (0.2, 1.0, 4.0):
        w = sample_weights(20_000, 4, alpha, generator=_gen(0))
        assert (w >= 0).all() and torch.allclose(w.sum(-1), torch.ones(20_000), atol=1e-5)
        # Dirichlet(alpha * 1_4): mean 1/4, variance (1/4)(3/4) / (4 alpha + 1)
        torch.testing.assert_close(w.mean(0), torch.full((4,), 0.25), atol=0.01, rtol=0)
        torch.testing.assert_close(w.var(0), torch.full((4,), 0.1875 / (4 * alpha + 1)), atol=0, rtol=0.06)


def test_vpo_sampled_weights_are_reproducible_and_shared_by_the_group():
    rewards = torch.rand(4, 6, 3, 5, generator=_gen(1))
    a = vpo_advantages(rewards, num_weights=50, generator=_gen(9))
    b = vpo_advantages(rewards, weights=sample_weights(50, 5, num_groups=4, generator=_gen(9)))
    torch.testing.assert_close(a, b)


def test_estimator_table_shares_one_signature():
    assert set(ESTIMATORS) == {"vpo", "grpo", "multi_rlvr", "random_weight_grpo", "goal_conditioned_grpo",
                               "max_at_k", "gdpo"}
    assert set(ESTIMATORS) >= CHAIN_ESTIMATORS and set(ESTIMATORS) >= WEIGHTED_ESTIMATORS
    shared = ["rewards", "mask", "weights", "num_weights", "alpha", "eps", "generator"]
    rewards = torch.rand(2, 4, 3, 2, generator=_gen(0))
    for name, fn in ESTIMATORS.items():
        assert list(inspect.signature(fn).parameters)[:7] == shared, name
        r = rewards if name in CHAIN_ESTIMATORS else rewards[:, :, :1]
        mask = torch.ones(r.shape[:3], dtype=torch.bool)
        out = fn(r, mask, num_weights=10, alpha=1.0, eps=1e-6, generator=_gen(0))
        assert out.shape == (2, 4) and out.isfinite().all(), name
        torch.testing.assert_close(out.mean(dim=1), torch.zeros(2), atol=1e-5, rtol=0)  # centred per group


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: vpo_advantages(torch.full((1, 2, 1, 1), 1.5)), r"rewards must lie in \[0, 1\]"),
        (lambda: vpo_advantages(torch.full((1, 2, 1, 1), -0.1)), r"rewards must lie in \[0, 1\]"),
        (lambda: vpo_advantages(torch.full((1, 2, 1, 1), math.nan)), "rewards .*NaN"),
        (lambda: vpo_advantages(torch.zeros(2, 1, 1)), r"rewards .*\[B, G, m, D\]"),
        (lambda: vpo_advantages(torch.zeros(1, 2, 3, 2), torch.ones(1, 2, 2, dtype=torch.bool)), r"mask .*\[B, G, m\]"),
        (lambda: set_rewards(torch.zeros(1, 2, 1, 2), torch.ones(3, 3)), r"weights .*\[K, D\]"),
        (lambda: set_rewards(torch.zeros(2, 2, 1, 2), torch.ones(3, 1, 2)), r"weights .*\[B, K, D\]"),
        (lambda: set_rewards(torch.zeros(1, 2, 1, 2), -torch.ones(1, 2)), "weights must be finite and non-negative"),
        (lambda: grpo(torch.zeros(1, 2, 3, 2)), r"rewards .*\[B, G, 1, D\]"),
        (lambda: max_at_k(torch.zeros(1, 2, 1, 1), k=0), "k must"),
        (lambda: group_normalize(torch.zeros(3)), r"scores .*\[B, G\]"),
        (lambda: sample_weights(0, 3), "num_weights"),
        (lambda: sample_weights(3, 3, alpha=0.0), "alpha"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
