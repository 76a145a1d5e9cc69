"""Tests for the evaluation metrics (VPO-SPEC section 6)."""

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo_lightning.core.metrics import (
    best_at_k_curve,
    best_pick_correct_at_k,
    chain_pass_at_k_curve,
    expected_best_weighted,
    pairwise_l1_diversity,
    pareto_fraction,
    pass_at_k,
    pass_at_k_curve,
    reward_means,
    solved,
    within_chain_diversity,
)


def test_best_at_k_curve_expectation_and_shape():
    # f = mean over D: [[.2, .2], [1, 0], [.9, .9]] -> f = [.2, .5, .9]
    pool = torch.tensor([[[0.2, 0.2], [1.0, 0.0], [0.9, 0.9]]])
    curve = best_at_k_curve(pool, seed=0, num_seeds=4000)
    # k=1: mean f = 1.6 / 3; k=2: pairs' maxima .5, .9, .9 -> 2.3 / 3; k=3: .9
    torch.testing.assert_close(curve, torch.tensor([1.6 / 3, 2.3 / 3, 0.9]), atol=0.02, rtol=0)
    one = best_at_k_curve(pool, seed=5)
    assert torch.equal(one, best_at_k_curve(pool, seed=5))  # seeded
    assert one[-1].item() == pytest.approx(0.9) and (one.diff() >= 0).all()
    assert all(min(abs(x - f) for f in (0.2, 0.5, 0.9)) < 1e-6 for x in one.tolist())  # maxima of real samples


def test_best_at_k_curve_averages_prompts_and_truncates_ragged_lists():
    pools = [torch.tensor([[0.0], [1.0]]), torch.tensor([[0.5], [0.5], [0.5]])]
    curve = best_at_k_curve(pools, seed=0)
    assert curve.shape == (2,)  # stops at the smallest pool
    assert curve[1].item() == pytest.approx((1.0 + 0.5) / 2)  # prompt 0's best of 2 is 1, prompt 1's is .5


def test_pass_at_k_hand_computed():
    # n=5, c=2, k=2: 1 - (1 - 2/4)(1 - 2/5) = 1 - .5 * .6 = .7 = 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every pair holds a solver
    assert pass_at_k(5, 0, 3) == 0.0
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=1, max_size=3))
def test_pass_at_k_equals_exhaustive_enumeration(rows):
    n = len(rows[0])
    enumerated = []
    for k in range(1, n + 1):
        per_prompt = []
        for row in rows:
            subsets = list(itertools.combinations(row, k))
            per_prompt.append(sum(any(s) for s in subsets) / len(subsets))  # fraction of k-subsets with a solver
            assert pass_at_k(n, sum(row), k) == pytest.approx(per_prompt[-1])
        enumerated.append(sum(per_prompt) / len(per_prompt))
    torch.testing.assert_close(pass_at_k_curve(torch.tensor(rows)), torch.tensor(enumerated))


def test_chain_pass_at_k_and_ragged_pass_at_k():
    chains = torch.tensor([[[False, True], [False, False], [False, False]]])  # chain solved: [T, F, F]
    # k=1: 1/3; k=2: 1 - C(2,2)/C(3,2) = 2/3; k=3: 1
    torch.testing.assert_close(chain_pass_at_k_curve(chains), torch.tensor([1 / 3, 2 / 3, 1.0]))
    ragged = pass_at_k_curve([torch.tensor([True, False]), torch.tensor([False, False, False])])
    torch.testing.assert_close(ragged, torch.tensor([0.25, 0.5]))  # prompt 0: [.5, 1]; prompt 1: [0, 0]


def test_solved_needs_every_component_at_one():
    pool = torch.tensor([[[1.0, 1.0], [1.0, 0.99], [1.0, 1.0]]])
    assert solved(pool).tolist() == [[True, False, True]]
    assert solved(pool, torch.tensor([[True, True, False]])).tolist() == [[True, False, False]]


def test_pairwise_l1_diversity_hand_computed():
    pool = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]],  # pairs: 1, 2, 1 -> 4/3
                         [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]])  # identical -> 0
    assert pairwise_l1_diversity(pool) == pytest.approx((4 / 3 + 0) / 2)
    # mask out candidate 2 of prompt 0 -> one pair, distance 1; prompt 1 keeps one candidate only -> skipped
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert pairwise_l1_diversity(pool, mask) == pytest.approx(1.0)
    assert pairwise_l1_diversity([torch.tensor([[0.0, 0.0], [1.0, 1.0]]), torch.tensor([[0.2, 0.2]])]) == 2.0
    # within-chain: chain 0 [0, 1] -> 1, chain 1 [.5, .5] -> 0
    assert within_chain_diversity(torch.tensor([[[[0.0], [1.0]], [[0.5], [0.5]]]])) == pytest.approx(0.5)


def test_expected_best_weighted():
    g = torch.Generator().manual_seed(0)
    assert expected_best_weighted(torch.ones(2, 3, 4), generator=g) == pytest.approx(1.0)  # w sums to 1
    # pool {e1, e2} in D=2: E[max(w1, 1 - w1)] with w1 ~ U(0, 1) = 3/4
    two = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    assert expected_best_weighted(two, num_weights=20_000, generator=g) == pytest.approx(0.75, abs=0.01)
    # masking e2 leaves E[w1] = 1/2
    masked = expected_best_weighted(two, num_weights=20_000, generator=g, mask=torch.tensor([[True, False]]))
    assert masked == pytest.approx(0.5, abs=0.01)


def test_pareto_fraction_ties_do_not_dominate():
    pool = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [0.4, 0.4], [1.0, 0.0]]])
    # [.4, .4] is dominated by [.5, .5]; the two equal [1, 0] do not dominate each other -> 4 / 5
    assert pareto_fraction(pool) == pytest.approx(0.8)
    assert pareto_fraction(pool, torch.tensor([[True, True, False, True, False]])) == pytest.approx(1.0)
    assert math.isclose(pareto_fraction([torch.tensor([[0.0], [1.0]]), torch.tensor([[0.3]])]), (0.5 + 1.0) / 2)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: best_at_k_curve(torch.zeros(3, 2)), r"pool .*\[P, n, D\]"),
        (lambda: best_at_k_curve([torch.zeros(2, 2), torch.zeros(2, 3)]), r"pool .*\[n_p, D\]"),
        (lambda: pairwise_l1_diversity(torch.zeros(1, 2, 2), torch.ones(1, 3)), r"mask .*\[P, n\]"),
        (lambda: pareto_fraction(torch.full((1, 2, 2), math.nan)), "finite"),
        (lambda: pass_at_k_curve(torch.zeros(3)), r"solved .*\[P, n\]"),
        (lambda: chain_pass_at_k_curve(torch.zeros(2, 3)), r"solved .*\[P, chains, m\]"),
        (lambda: within_chain_diversity(torch.zeros(2, 3, 2)), r"rewards .*\[P, C, m, D\]"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_reward_means_say_what_they_average():
    """Two chains of m=2 candidates, D=2: only 2 of the 4 slots parsed (the garbage in absent slots is ignored)."""
    rewards = torch.tensor([[[1.0, 0.5], [9.0, 9.0]],
                            [[0.0, 1.0], [9.0, 9.0]]])  # [chains=2, m=2, D=2]
    mask = torch.tensor([[True, False], [True, False]])  # [2, 2]
    out = reward_means(rewards, mask, ["a", "b"])
    assert out == {
        "reward/a": 0.5, "reward/all/a": 0.25,  # (1 + 0) / 2 parsed; / 4 slots
        "reward/b": 0.75, "reward/all/b": 0.375,  # (0.5 + 1) / 2; / 4
        "reward/parsed/mean": 0.625, "reward/all/mean": 0.3125,  # (0.75 + 0.5) / 2; / 4
        "chains/candidate_parse_rate": 0.5,
    }
    none = reward_means(torch.zeros(1, 3, 2), torch.zeros(1, 3, dtype=torch.bool), ["a", "b"])
    assert none["reward/all/mean"] == none["reward/parsed/mean"] == none["chains/candidate_parse_rate"] == 0.0
    with pytest.raises(ValueError, match="must be"):
        reward_means(torch.zeros(2, 3, 2), torch.ones(2, 2, dtype=torch.bool), ["a", "b"])


def test_best_at_k_with_f_weights():
    """f_weights make f a weighted mean (MuSiQue's (1, 1, 1, 1, 3) / 7); equal weights give the plain mean exactly."""
    pool = torch.tensor([[[1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]])  # [P=1, n=2, D=5]
    weighted = best_at_k_curve(pool, seed=0, num_seeds=50, f_weights=[1, 1, 1, 1, 3])
    assert float(weighted[-1]) == pytest.approx(4 / 7)  # f = 4/7 and 3/7
    assert torch.equal(best_at_k_curve(pool, seed=3, f_weights=[2.0] * 5), best_at_k_curve(pool, seed=3))
    with pytest.raises(ValueError, match="non-negative"):
        best_at_k_curve(pool, f_weights=[1, 1, 1, 1, -1])


def test_best_pick_correct_at_k_exact_values() -> None:
    """Scores .5 (wrong), 1 (right), 1 (wrong), 0 (right): k = 1 is the share of right answers; k = 4 keeps one of the
    two tied 1s at random (1/2); k = 2: of the 6 pairs, the 5 holding a 1 keep a 1 (right half the time on the pair
    {1, 1}, where either is kept), {.5, 0} keeps .5, wrong -> (2 * 1 + 2 * 0 + 1 / 2 + 0) / 6."""
    scores, correct = [0.5, 1.0, 1.0, 0.0], [False, True, False, True]
    assert best_pick_correct_at_k(scores, correct, 1) == pytest.approx(0.5)
    assert best_pick_correct_at_k(scores, correct, 2) == pytest.approx(2.5 / 6)
    assert best_pick_correct_at_k(scores, correct, 4) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        best_pick_correct_at_k(scores, correct, 5)
    with pytest.raises(ValueError, match="differ in length"):
        best_pick_correct_at_k(scores, correct[:3], 1)


def test_best_pick_correct_at_k_matches_enumerating_every_subset() -> None:
    """Against the definition: every k-subset, the kept answer uniform among the subset's tied maxima."""
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 7)
        scores = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(n)]
        correct = [rng.random() < 0.5 for _ in range(n)]
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            want = 0.0
            for sub in subsets:
                top = max(scores[i] for i in sub)
                tied = [i for i in sub if scores[i] == top]
                want += sum(correct[i] for i in tied) / len(tied)
            assert best_pick_correct_at_k(scores, correct, k) == pytest.approx(want / len(subsets))
