"""The format check: a run that cannot learn is told so in its first steps, with the cause and the fixes.

Under a chain estimator (vpo, multi_rlvr) the rewards only ever see answers parsed from the m-answer tags. A model
that never writes them scores 0 on every candidate, every prompt group has zero reward spread, every advantage is 0,
and the run trains on nothing while its loss and progress bar look normal. :class:`FormatCheck` watches the rollouts:

- the first rollout of a run is reported with its parse rate per candidate position (:meth:`first_rollout`);
- when no candidate parses, or no group has reward spread, for :data:`PATIENCE` training steps in a row, one warning
  names the cause and the fixes (:meth:`update`), and :attr:`FormatCheck.note` is a short text for the progress bar
  while the condition lasts.

Plain Python and torch: the rollout callback feeds it and decides where its messages go.
"""

from __future__ import annotations

from torch import Tensor

from vpo_lightning.core.estimators import get_estimator

PATIENCE = 3  # training steps in a row without a parsed answer (or without reward spread) before the warning


def answer_layout(m: int, family: str) -> str:
    """How a chain of ``m`` answers must be written to parse (``<response_1>...</response_1>`` ...)."""
    if family == "fence":
        return f"{m} ```python fenced code blocks separated by lines holding only ---"
    tag = "response" if family == "response" else "route"
    return " ".join(f"<{tag}_{i}>...</{tag}_{i}>" for i in range(1, m + 1))


class FormatCheck:
    """Watches training rollouts for a run that cannot learn (see the module docstring).

    Args:
        estimator: the run's advantage estimator (chain estimators parse m tagged answers per chain).
        m: answers per chain (1 for single-answer estimators).
        tag_family: the chain protocol's tag family (``response``, ``route`` or ``fence``).
        patience: training steps in a row without signal before the warning.
    """

    def __init__(self, estimator: str, m: int, tag_family: str, patience: int = PATIENCE) -> None:
        self.estimator, self.m, self.tag_family, self.patience = estimator, m, tag_family, patience
        self.chained = get_estimator(estimator).chained
        self.unparsed_steps = 0  # training steps in a row in which no candidate parsed
        self.flat_steps = 0  # training steps in a row in which no prompt group had reward spread
        self.warned = False
        self.note: str | None = None  # what the progress bar shows while the run has no signal
        self._reported = False

    def first_rollout(self, mask: Tensor) -> str | None:
        """The parse rate per candidate position of the run's first training rollout (``mask`` ``[N, m]``, True
        where the candidate parsed); None after the first call."""
        if self._reported:
            return None
        self._reported = True
        mask = mask.reshape(-1, mask.shape[-1])  # [N, m]
        chains = mask.shape[0]
        per_position = mask.sum(0).tolist()  # [m] parsed count per position
        total = sum(per_position)
        if self.chained:
            tag = "route" if self.tag_family == "route" else "response"
            names = [f"<{tag}_{i}>" if self.tag_family != "fence" else f"block {i}" for i in range(1, self.m + 1)]
            shown = ", ".join(f"{n} {int(c)}/{chains}" for n, c in zip(names, per_position))
            line = f"first rollout: answers parsed per position: {shown} ({total / max(1, chains * self.m):.0%})"
        else:
            line = f"first rollout: {int(total)}/{chains} answers non-empty"
        if total == 0 and self.chained:
            layout = answer_layout(self.m, self.tag_family)
            line += (f"; none parsed yet: the rewards score only answers written as {layout} (a warning follows if "
                     f"this lasts {self.patience} steps)")
        return line

    def update(self, parse_rate: float, zero_spread_frac: float, mean_reward: float) -> str | None:
        """Count one training step; the warning (once per run) when the run has had no signal for ``patience``
        steps in a row, else None. ``parse_rate``: fraction of candidates that parsed; ``zero_spread_frac``: fraction
        of prompt groups whose chains all got the same advantage (0); ``mean_reward``: over every candidate."""
        self.unparsed_steps = self.unparsed_steps + 1 if parse_rate == 0 else 0
        self.flat_steps = self.flat_steps + 1 if zero_spread_frac >= 1.0 else 0
        if self.unparsed_steps >= self.patience:
            self.note = "no parse"
        elif self.flat_steps >= self.patience:
            self.note = "no spread"
        else:
            self.note = None
            return None
        if self.warned:
            return None
        self.warned = True
        if self.unparsed_steps >= self.patience:
            return self._unparsed_message()
        return self._flat_message(mean_reward)

    def _unparsed_message(self) -> str:
        n = self.patience
        if not self.chained:
            return (f"every answer was empty for {n} steps in a row, so every reward is 0 and nothing is learned: "
                    "check rollout.sampling.max_new_tokens and that the model's chat template lets it answer")
        return (f"no answer parsed in {n} training steps in a row (train/chains/candidate_parse_rate = 0), so nothing "
                f"is learned: under rollout.estimator={self.estimator} the rewards score only answers written as "
                f"{answer_layout(self.m, self.tag_family)}, this model writes none, so every reward is 0 and every "
                "group has zero spread. Fixes: a cold start on demonstrations in that format (`vpo sft`; your own "
                "data in TRL's SFT formats: docs/COMING_FROM_TRL.md; then --model.model.adapter "
                "checkpoints/<sft run>/adapters/last), or "
                "--rollout.estimator grpo, which scores the whole completion with no tags")

    def _flat_message(self, mean_reward: float) -> str:
        n = self.patience
        if mean_reward <= 0.0:
            why = "every answer scored 0 (the rewards never fire on this model's answers)"
        elif mean_reward >= 1.0:
            why = "every answer scored 1 (the task is too easy for the rewards to tell answers apart)"
        else:
            why = f"the chains of each prompt scored alike (mean reward {mean_reward:.3f})"
        return (f"no reward spread in {n} training steps in a row (train/frac_zero_std_groups = 1): {why}, so every "
                "advantage is 0 and nothing is learned. Fixes: check that the rewards vary between answers, start "
                "from a cold start on demonstrations (`vpo sft`, docs/COLD_START.md), raise "
                "rollout.sampling.temperature or rollout.group_size, or set rollout.dynamic_sampling.enabled=true")
