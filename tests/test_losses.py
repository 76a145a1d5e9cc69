"""Tests for the chunked log-probs and the PPO-clip + k3 KL policy loss."""

import math

import pytest
import torch
from torch import nn

from vpo_lightning.core.losses import masked_mean, per_token_logprobs, policy_loss

ATOL = 1e-6


class LoRAHead(nn.Module):
    """A linear head plus a low-rank adapter, like a peft LoRA-wrapped lm_head."""

    def __init__(self, h: int, v: int, r: int = 2):
        super().__init__()
        self.base = nn.Linear(h, v, bias=False)
        self.a = nn.Parameter(torch.randn(r, h) * 0.1)
        self.b = nn.Parameter(torch.randn(v, r) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.T @ self.b.T


def _plain(hidden, head, targets, temperature=1.0):
    logits = head(hidden).float() / temperature  # [N, T, V] all at once
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_size, temperature", [(7, 1.0), (1024, 0.7), (1, 1.3)])
def test_chunked_logprobs_match_full_logits_values_and_gradients(chunk_size, temperature):
    torch.manual_seed(0)
    n, t, h, v = 3, 5, 8, 50
    head = LoRAHead(h, v)
    hidden = torch.randn(n, t, h, requires_grad=True)
    targets = torch.randint(0, v, (n, t))
    weights = torch.randn(n, t)  # a random linear functional of both outputs, to compare all gradients

    ref_lp, ref_ent = _plain(hidden, head, targets, temperature)
    ref_grads = torch.autograd.grad((ref_lp * weights).sum() + ref_ent.sum(), [hidden, *head.parameters()])
    lp, ent = per_token_logprobs(hidden, head, targets, chunk_size=chunk_size, temperature=temperature,
                                 return_entropy=True)
    grads = torch.autograd.grad((lp * weights).sum() + ent.sum(), [hidden, *head.parameters()])

    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, ref_grads):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_selective_log_softmax_backward_passes_gradcheck(with_entropy):
    from vpo_lightning.core.losses import _SelectiveLogSoftmax

    logits = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.tensor([0, 5, 2, 2])
    assert torch.autograd.gradcheck(lambda x: _SelectiveLogSoftmax.apply(x, targets, with_entropy), (logits,))


def test_chunked_logprobs_do_not_keep_vocabulary_sized_tensors_for_backward():
    # Measure what autograd keeps for the backward (bytes of saved tensors) with a pack hook.
    torch.manual_seed(0)
    n, t, h, v = 4, 64, 16, 4096
    head, hidden, targets = nn.Linear(h, v), torch.randn(n, t, h, requires_grad=True), torch.randint(0, v, (n, t))

    def saved_bytes(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel() * x.element_size()) or x,
                                                      lambda x: x):
            fn().sum().backward()
        return sum(sizes)

    full_logits = n * t * v * 4  # 4 MiB
    plain = saved_bytes(lambda: _plain(hidden, head, targets)[0])
    chunked = saved_bytes(lambda: per_token_logprobs(hidden, head, targets, chunk_size=32))
    assert plain >= full_logits  # the plain computation keeps at least one [N, T, V] tensor
    assert chunked < full_logits / 50  # chunks keep ~ their [C, H] inputs only (about N*T*H*4 = 16 KiB)


def test_bf16_head_gives_float32_logprobs_of_the_bf16_logits():
    torch.manual_seed(0)
    head = nn.Linear(8, 40).to(torch.bfloat16)
    hidden = torch.randn(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 40, (2, 3))
    lp = per_token_logprobs(hidden, head, targets, chunk_size=4)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, _plain(hidden, head, targets)[0])  # softmax of the bf16 logits in float32
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and hidden.grad.isfinite().all()


def test_logprobs_negative_targets_no_grad_and_empty():
    head = nn.Linear(4, 10)
    hidden = torch.randn(2, 3, 4)
    targets = torch.tensor([[1, 2, -100], [3, -100, -100]])
    with torch.no_grad():
        lp = per_token_logprobs(hidden, head, targets, chunk_size=4)
    assert lp.shape == (2, 3) and (lp[targets < 0] == 0).all() and (lp[targets >= 0] < 0).all()
    assert per_token_logprobs(torch.zeros(0, 3, 4), head, torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden": torch.zeros(2, 4)}, r"hidden .*\[N, T, H\]"),
        ({"targets": torch.zeros(2, 4, dtype=torch.long)}, r"targets .*\[N, T\]"),
        ({"targets": torch.zeros(2, 3)}, "targets must hold integer"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_logprobs_bad_input(kwargs, match):
    args = {"hidden": torch.zeros(2, 3, 4), "lm_head": nn.Linear(4, 5), "targets": torch.zeros(2, 3, dtype=torch.long)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        per_token_logprobs(args.pop("hidden"), args.pop("lm_head"), args.pop("targets"), **args)


# ----------------------------------------------------------------------------------------------- policy loss
def _case():
    # old log-probs 0, so ratio = exp(logp). Sequence 0 has A = +1, sequence 1 has A = -1. clip 0.2 both sides.
    ratios = torch.tensor([[1.5, 0.9], [0.5, 1.1]])
    logp = ratios.log().requires_grad_()
    return logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0])


def test_policy_loss_hand_computed_token_mean():
    logp, old, adv = _case()
    loss, stats = policy_loss(logp, old, adv, torch.ones(2, 2, dtype=torch.bool), beta=0.0)
    # (0,0) A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (upper clip binds)   (0,1) A=+1 r=0.9: -0.9
    # (1,0) A=-1 r=0.5: max(0.5, 0.8) = 0.8 (lower clip binds)      (1,1) A=-1 r=1.1: 1.1
    # token mean: (-1.2 - 0.9 + 0.8 + 1.1) / 4 = -0.05
    assert math.isclose(loss.item(), -0.05, abs_tol=ATOL)
    assert stats["clip_frac_high"].item() == 0.25 and stats["clip_frac_low"].item() == 0.25
    assert stats["clip_frac"].item() == 0.5 and stats["dual_clip_frac"].item() == 0.0
    assert math.isclose(stats["ratio_mean"].item(), 1.0, abs_tol=ATOL)  # (1.5 + .9 + .5 + 1.1) / 4
    assert math.isclose(stats["ratio_min"].item(), 0.5, abs_tol=ATOL)
    assert math.isclose(stats["ratio_max"].item(), 1.5, abs_tol=ATOL)
    assert stats["kl"].item() == 0.0 and not any(s.requires_grad for s in stats.values())
    loss.backward()
    # d/dlogp of -A * r is -A * r on unclipped tokens, 0 on clipped ones; divided by 4 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.9], [0.0, 1.1]]) / 4)


@pytest.mark.parametrize(
    "aggregation, max_length, expected",
    [
        ("token_mean", None, (-1.2 + 0.8 + 1.1) / 3),  # 3 unmasked tokens
        ("sequence_mean", None, (-1.2 + (0.8 + 1.1) / 2) / 2),  # per sequence, then over sequences: -0.125
        ("constant", 4, (-1.2 + 0.8 + 1.1) / (2 * 4)),  # Dr. GRPO: sum / (N * max_length) = 0.0875
        ("constant", None, (-1.2 + 0.8 + 1.1) / (2 * 2)),  # max_length defaults to L = 2
    ],
)
def test_policy_loss_aggregations(aggregation, max_length, expected):
    logp, old, adv = _case()
    mask = torch.tensor([[True, False], [True, True]])
    loss, _ = policy_loss(logp, old, adv, mask, beta=0.0, aggregation=aggregation, max_length=max_length)
    assert math.isclose(loss.item(), expected, abs_tol=ATOL)


def test_policy_loss_dual_clip():
    logp = torch.tensor([[4.0, 2.0]]).log().requires_grad_()  # A = -1, ratios 4 and 2, c = 3
    loss, stats = policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), dual_clip=3.0,
                              beta=0.0)
    # r=4: max(4, 0.8) = 4 -> min(4, 3) = 3 (dual clip binds); r=2: max(2, 0.8) = 2 < 3 -> 2. Mean 2.5
    assert math.isclose(loss.item(), 2.5, abs_tol=ATOL) and stats["dual_clip_frac"].item() == 0.5
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 2]]))  # d(r)/dlogp = r = 2, over 2 tokens


def test_policy_loss_k3_kl_term_and_clamp():
    logp, old = torch.zeros(1, 2), torch.zeros(1, 2)
    ref = torch.tensor([[math.log(2.0), 5.0]])
    loss, stats = policy_loss(logp, old, torch.zeros(1), torch.ones(1, 2), ref, beta=0.1)
    # token 0: exp(ln 2) - ln 2 - 1 = 0.306853; token 1: exp(5) - 5 - 1 = 142.4 -> clamped to 10
    kl = (2 - math.log(2) - 1 + 10) / 2
    assert math.isclose(stats["kl"].item(), kl, rel_tol=1e-5)
    assert math.isclose(loss.item(), 0.1 * kl, rel_tol=1e-5)  # A = 0: only the KL term


def test_masked_tokens_contribute_nothing_even_when_garbage():
    logp = torch.tensor([[-0.1, math.nan], [-0.2, math.inf]], requires_grad=True)
    old = torch.tensor([[-0.1, -math.inf], [-0.3, math.nan]])
    ref = torch.tensor([[-0.1, math.nan], [-0.2, 1e9]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss, stats = policy_loss(logp, old, torch.tensor([1.0, -1.0]), mask, ref)
    clean, _ = policy_loss(logp.detach()[:, :1], old[:, :1], torch.tensor([1.0, -1.0]), mask[:, :1], ref[:, :1])
    assert math.isclose(loss.item(), clean.item(), abs_tol=ATOL)
    assert all(s.isfinite() for s in stats.values())
    loss.backward()
    assert logp.grad.isfinite().all() and (logp.grad[:, 1] == 0).all()


def test_all_masked_batch_gives_zero_loss():
    logp = torch.randn(2, 3, requires_grad=True)
    for aggregation in ("token_mean", "sequence_mean", "constant"):
        loss, stats = policy_loss(logp, torch.randn(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool),
                                  torch.randn(2, 3), aggregation=aggregation)
        assert loss.item() == 0.0 and all(s.isfinite() for s in stats.values())
        loss.backward()
        assert (logp.grad == 0).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"advantages": torch.zeros(3)}, r"advantages .*\[N\]"),
        ({"mask": torch.ones(2, 3)}, r"mask .*\[N, L\]"),
        ({"old_logprobs": torch.zeros(2)}, r"old_logprobs .*\[N, L\]"),
        ({"ref_logprobs": torch.zeros(1, 2)}, r"ref_logprobs .*\[N, L\]"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"max_length": 0}, "max_length"),
    ],
)
def test_policy_loss_bad_input(kwargs, match):
    args = {"logprobs": torch.zeros(2, 2), "old_logprobs": torch.zeros(2, 2), "advantages": torch.zeros(2),
            "mask": torch.ones(2, 2)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss(args.pop("logprobs"), args.pop("old_logprobs"), args.pop("advantages"), args.pop("mask"), **args)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert masked_mean(x, mask).item() == 1.5  # (1 + 2) / 2; the NaN is masked out
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 0.0]))  # empty row -> 0
    with pytest.raises(ValueError, match="mask"):
        masked_mean(x, mask[:, :2])
