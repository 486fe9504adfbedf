"""The sweep engine: evaluate many depth plans on one fixed token set, reusing cached prefixes.

For each batch of sequences the intact states z_0..z_L are computed once. A plan whose first change
is at depth l (`Plan.first_change`) runs from the cached z_l: `model.run(plan, start=l,
from_state=z_l)`, so a single-skip sweep costs sum_l (L-l) blocks instead of L·L (docs/design.md §3, §7).
The result is bit-identical to a full re-run with the plan (tested for every architecture).

Batching: sequences are processed `batch_size` at a time with every plan evaluated on the batch
before the next one, so memory holds one batch's L+1 states and one plan's logits, never the whole
token set. Metrics compare each plan's next-token distribution with the intact model's on the
scored positions (all but position 0), accumulating sums in float64:

    ce             mean next-token cross-entropy under the plan (nats)
    kl             KL(p_intact || p_plan), mean over tokens (nats)
    top1_agree     fraction of tokens whose top-1 prediction is the intact model's top-1
    top1_acc       fraction of tokens whose top-1 prediction is the target
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from depthtools.analysis.tokens import FIRST_SCORED, batches, check_tokens, split_inputs
from depthtools.arch.model import Plan


@dataclass(frozen=True)
class PlanStats:
    """Token-averaged comparison of one plan with the intact model (see the module docstring)."""

    ce: float
    kl: float
    top1_agree: float
    top1_acc: float
    n_tokens: int


@dataclass(frozen=True)
class SweepResult:
    intact: PlanStats
    plans: list[PlanStats]


class _Sums:
    """float64 running sums of the per-token metrics of one plan."""

    def __init__(self) -> None:
        self.ce = self.kl = self.agree = self.acc = 0.0
        self.n = 0

    def add(self, logp: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor) -> None:
        """logp, ref_logp: [n,V] log-probs on scored positions; targets [n]."""
        ce = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        top1 = logp.argmax(-1)
        self.ce += float(ce.double().sum())
        self.kl += float(kl.double().sum())
        self.agree += float((top1 == ref_logp.argmax(-1)).double().sum())
        self.acc += float((top1 == targets).double().sum())
        self.n += targets.numel()

    def stats(self) -> PlanStats:
        n = max(self.n, 1)
        return PlanStats(self.ce / n, self.kl / n, self.agree / n, self.acc / n, self.n)


def scored_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[B,T,V] logits -> [B·(T-1), V] float32 (or wider) log-probs of the scored positions."""
    scored = logits[:, FIRST_SCORED:]
    dtype = torch.promote_types(scored.dtype, torch.float32)
    return F.log_softmax(scored.to(dtype), dim=-1).flatten(0, 1)


@torch.no_grad()
def intact_states(model, inputs: torch.Tensor) -> list:
    """The intact depth states z_0..z_L of a batch of inputs [B,T]."""
    return model.run_states(inputs)


@torch.no_grad()
def plan_logits(
    model, plans: Sequence[Plan], states: list, inputs: torch.Tensor | None = None, reuse_prefix: bool = True
) -> Iterator[torch.Tensor]:
    """Logits [B,T,V] of each plan on one batch, from its cached prefix state (or a full re-run).

    `states` are the batch's intact states (`intact_states`); with reuse_prefix=False every plan
    re-runs all L blocks from `inputs` (the naive baseline, for benchmarks and tests).
    """
    L = model.n_layer
    for plan in plans:
        if reuse_prefix:
            start = plan.first_change(L)
            yield model.run(plan=plan, start=start, from_state=states[start])
        else:
            yield model.run(inputs, plan=plan)


@torch.no_grad()
def sweep(
    model,
    tokens: torch.Tensor,
    plans: Sequence[Plan],
    batch_size: int = 8,
    reuse_prefix: bool = True,
    progress: Callable[[float], None] | None = None,
) -> SweepResult:
    """Evaluate every plan on the token set [N, T+1]; returns intact and per-plan `PlanStats`.

    `progress(advance)` is called after each plan on each batch with the fraction of one plan done
    (1 / number of batches), so a progress bar over plans reaches len(plans).
    """
    tokens = check_tokens(model, tokens)
    model.eval()
    n_batches = -(-tokens.shape[0] // batch_size)
    intact, sums = _Sums(), [_Sums() for _ in plans]
    for batch in batches(tokens, batch_size):
        inputs, targets = split_inputs(batch)
        targets = targets.flatten()
        states = intact_states(model, inputs)
        ref = scored_logprobs(model.head(states[-1]))
        intact.add(ref, ref, targets)
        for acc, logits in zip(sums, plan_logits(model, plans, states, inputs, reuse_prefix)):
            acc.add(scored_logprobs(logits), ref, targets)
            if progress is not None:
                progress(1.0 / n_batches)
        del states
    return SweepResult(intact.stats(), [s.stats() for s in sums])
