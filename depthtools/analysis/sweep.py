"""The sweep engine: evaluate many depth plans on one fixed token set, reusing cached prefixes.

For each batch of sequences the intact states z_0..z_L are computed once. A plan whose first change
is at depth l (`Plan.first_change`) runs from the cached z_l: `model.run(plan, start=l,
from_state=z_l)`, so a single-skip sweep costs sum_l (L-l) blocks instead of L·L (docs/design.md §3, §7).
The result is bit-identical to a full re-run with the plan (tested for every architecture).

Batching: sequences are processed `batch_size` at a time with every plan evaluated on the batch
before the next one, so memory holds one batch's L+1 states and one plan's logits, never the whole
token set. Metrics compare each plan's next-token distribution with the intact model's on the
scored positions (all but position 0), accumulating sums in float64 per sequence (`SweepResult`'s
per-sequence sums serve `sequence_profile`; within `shared_sweeps()` one sweep serves every probe asking
for the same plans):

    ce             mean next-token cross-entropy under the plan (nats)
    kl             KL(p_intact || p_plan), mean over tokens (nats)
    top1_agree     fraction of tokens whose top-1 prediction is the intact model's top-1
    top1_acc       fraction of tokens whose top-1 prediction is the target
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from depthtools.analysis.headmetrics import (
    Head,
    LogitsBuffer,
    Reference as HeadReference,
    RowMetrics,
    chunked_head as chunked_head_for,
    fused_metrics,
    fused_usable,
    row_metrics,
)
from depthtools.analysis.tokens import FIRST_SCORED, batches, check_tokens, split_inputs, token_fingerprint
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
    # [N, 4] per-sequence sums (METRICS) over the scored positions; not compared: the stats above are the result
    intact_sequences: torch.Tensor | None = field(default=None, compare=False)
    plan_sequences: list[torch.Tensor] | None = field(default=None, compare=False)
    n_positions: int = field(default=0, compare=False)  # scored positions per sequence


# Within `shared_sweeps()`: {key: SweepResult} of the sweeps run so far (one model, one token set).
_SHARED: ContextVar[dict | None] = ContextVar("shared_sweeps", default=None)


@contextmanager
def shared_sweeps() -> Iterator[None]:
    """Within this block, a sweep of the same plans on the same tokens, model and batch size is run once:
    `sequence_profile` and `ablate_skip`'s default rule evaluate the same L skip plans, so the suite
    (`analyze_grid`, which opens this block around one model's analyses) pays for one sweep; and each
    batch's intact states are computed once (`intact_states`, up to SHARED_STATES_BYTES). Only skip/swap
    plans without replacement functions are remembered; the model must not change inside. Nothing is
    recomputed differently: a remembered result is the very tensors the first probe computed."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _sweep_key(model, tokens: torch.Tensor, plans: Sequence[Plan], batch_size: int) -> tuple | None:
    """What makes two sweeps the same (None: not remembered: a plan with replacement functions)."""
    if any(plan.replace for plan in plans):
        return None
    default_rule = model.scheme.skip_rules[0]
    described = tuple((tuple(sorted(p.skip)), (p.skip_rule or default_rule) if p.skip else None, p.order)
                      for p in plans)
    return id(model), token_fingerprint(tokens), tuple(tokens.shape), batch_size, described


METRICS = ("ce", "kl", "agree", "acc")  # the per-token metrics summed per sequence, in this order


@dataclass(frozen=True)
class Reference:
    """The intact log-probs of one batch with their probabilities and top-1 ids, computed once per batch
    rather than once per plan (at a 49k vocabulary each is a pass as costly as the log-softmax; issue 47)."""

    logp: torch.Tensor  # [n, V]
    p: torch.Tensor  # [n, V]
    top1: torch.Tensor  # [n]

    @classmethod
    def of(cls, logp: torch.Tensor) -> "Reference":
        return cls(logp, logp.exp(), logp.argmax(-1))


@dataclass(frozen=True)
class _HeadRef:
    """The chunked head and the intact model's reference for it, on one batch."""

    head: Head
    ref: HeadReference


class _Sums:
    """float64 sums of the per-token metrics of one plan, per sequence ([N, 4] in METRICS order: what
    `sequence_profile` reads; a plan's `PlanStats` is their total over the sequences)."""

    def __init__(self) -> None:
        self.per_seq: list[torch.Tensor] = []  # one [B, 4] float64 block per batch
        self.n_positions = 0  # scored positions per sequence

    def add(self, logp: torch.Tensor, ref: "Reference", targets: torch.Tensor, B: int) -> None:
        """logp: [B·T', V] log-probs on scored positions; ref: the intact ones; targets [B·T'] (B sequences)."""
        ce = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        kl = (ref.p * (ref.logp - logp)).sum(-1)
        top1 = logp.argmax(-1)
        values = torch.stack([ce.double(), kl.double(), (top1 == ref.top1).double(),
                              (top1 == targets).double()], -1)  # [B·T', 4]
        self.per_seq.append(values.view(B, -1, len(METRICS)).sum(1).cpu())
        self.n_positions = values.shape[0] // B

    def add_rows(self, m: RowMetrics, ref: "HeadReference", targets: torch.Tensor, B: int) -> None:
        """The same sums from the chunked head's per-row metrics (`headmetrics.row_metrics`)."""
        top1 = m.top[:, 0]
        values = torch.stack([m.ce, m.kl_ref, (top1 == ref.top[:, 0]).double(), (top1 == targets).double()], -1)
        self.per_seq.append(values.view(B, -1, len(METRICS)).sum(1).cpu())
        self.n_positions = values.shape[0] // B

    def sequences(self) -> torch.Tensor:
        """[N, 4] float64 per-sequence sums."""
        return torch.cat(self.per_seq)

    def stats(self) -> PlanStats:
        sums = self.sequences().sum(0).tolist() if self.per_seq else [0.0] * len(METRICS)
        n_tokens = len(self.sequences()) * self.n_positions if self.per_seq else 0
        n = max(n_tokens, 1)
        return PlanStats(sums[0] / n, sums[1] / n, sums[2] / n, sums[3] / n, n_tokens)


def plan_head_sums(acc: "_Sums", logits: torch.Tensor, ref: Reference, targets: torch.Tensor, B: int,
                   fused: HeadReference | None = None) -> HeadReference | None:
    """Add one plan's metrics from its logits [B, T, V] to `acc`: through the fused row metrics of the scored
    rows where they take them (`headmetrics.fused_metrics`: float32 CPU logits, two passes per row instead of a
    log-softmax and ~5 torch passes over [rows, V]; low-precision logits are widened first), else the full
    log-softmax (`_Sums.add`). `fused`: the intact reference as the fused path reads it (built here on first use
    and returned, so one batch's plans share it). Also what `cost.time_parts` times per plan."""
    scored = logits[:, FIRST_SCORED:]
    if scored.device.type == "cpu" and scored.dtype in (torch.bfloat16, torch.float16):
        scored = scored.float()
    if not fused_usable(scored):
        acc.add(scored_logprobs(logits), ref, targets, B)
        return fused
    if fused is None:
        fused = HeadReference.of(ref.logp, p=ref.p, top=ref.top1.unsqueeze(1), sums=False)
    acc.add_rows(fused_metrics(scored, targets, fused), fused, targets, B)
    return fused


def scored_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[B,T,V] logits -> [B·(T-1), V] float32 (or wider) log-probs of the scored positions."""
    scored = logits[:, FIRST_SCORED:]
    dtype = torch.promote_types(scored.dtype, torch.float32)
    return F.log_softmax(scored.to(dtype), dim=-1).flatten(0, 1)


# Within `shared_sweeps()`, the intact states of each batch are kept while they fit this many bytes in all
# (a 30-layer, 576-wide model's 4 default batches: 0.3 GB), so every probe after the first reads them.
SHARED_STATES_BYTES = 2**30


def _state_bytes(states: list) -> int | None:
    """Bytes of a list of tensor states (None when a state is not a tensor: such states are not kept)."""
    if not all(torch.is_tensor(z) for z in states):
        return None
    return sum(z.numel() * z.element_size() for z in states)


@torch.no_grad()
def intact_states(model, inputs: torch.Tensor) -> list:
    """The intact depth states z_0..z_L of a batch of inputs [B,T]; within `shared_sweeps()` one intact
    forward per batch serves every probe (lens, similarity, causal, the Jacobian, the sweeps' baselines)."""
    shared = _SHARED.get()
    if shared is None:
        return model.run_states(inputs)
    key = ("states", id(model), token_fingerprint(inputs), tuple(inputs.shape))
    if key in shared:
        return shared[key]
    states = model.run_states(inputs)
    size = _state_bytes(states)
    if size is not None:
        _keep(shared, key, states, size)
    return states


def _keep(shared: dict, key: tuple, value, size: int) -> None:
    """Keep `value` (`size` bytes) under `key` while everything kept fits SHARED_STATES_BYTES (one budget for the
    intact states and causal's skip runs)."""
    if shared.get("states_bytes", 0) + size <= SHARED_STATES_BYTES:
        shared[key] = value
        shared["states_bytes"] = shared.get("states_bytes", 0) + size


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


def _remember_key(model, inputs: torch.Tensor, plan: Plan) -> tuple | None:
    """What identifies one single-skip plan's run on one batch (None: not remembered: any other plan)."""
    if plan.replace or plan.order is not None or len(plan.skip) != 1:
        return None
    rule = plan.skip_rule or model.scheme.skip_rules[0]
    return "hidden", id(model), token_fingerprint(inputs), tuple(inputs.shape), next(iter(plan.skip)), rule


def remember_hidden(model, inputs: torch.Tensor, plan: Plan, state) -> torch.Tensor | None:
    """Within `shared_sweeps()`, keep a single-skip plan's final hidden state (`final_hidden` of its final
    depth state `state`, run from the cached intact prefix) for a later sweep of the same plan on the same batch,
    while it fits SHARED_STATES_BYTES with the intact states: causal's skip runs are the skip sweep's plans
    (sequence_profile, ablate_skip), whose blocks then run once in the suite. The very tensor is kept, so the
    sweep decodes what it would have computed, bit for bit. Returns the final hidden state when it computed one
    (kept or over the budget), so a caller that needs it does not compute it again; else None."""
    shared = _SHARED.get()
    key = None if shared is None else _remember_key(model, inputs, plan)
    if key is None or key in shared:
        return None
    hidden = model.scheme.final_hidden(state, model.ln_final)
    _keep(shared, key, hidden, hidden.numel() * hidden.element_size())
    return hidden


def _remembered(model, inputs: torch.Tensor | None, plan: Plan) -> torch.Tensor | None:
    """The final hidden state `remember_hidden` kept for this plan on this batch, or None."""
    shared = _SHARED.get()
    key = None if shared is None or inputs is None else _remember_key(model, inputs, plan)
    return None if key is None else shared.get(key)


def _step(plan: Plan, position: int, default_rule: str) -> tuple:
    """What a plan does at one position: replace (by which function), skip (by which rule) or run a block."""
    if position in plan.replace:
        return "replace", id(plan.replace[position])
    if position in plan.skip:
        return "skip", plan.skip_rule or default_rule
    return "block", plan.block_at(position)


def common_prefix(model, a: Plan, b: Plan) -> int:
    """The first position where plans a and b do different things (n_layer when none): their states agree up
    to that depth, since a position's step reads only the state and the plan's choice at that position."""
    rule = model.scheme.skip_rules[0]
    return next((p for p in range(model.n_layer) if _step(a, p, rule) != _step(b, p, rule)), model.n_layer)


@torch.no_grad()
def plan_hidden(
    model, plans: Sequence[Plan], states: list, inputs: torch.Tensor | None = None, reuse_prefix: bool = True
) -> Iterator[torch.Tensor]:
    """Each plan's final hidden state [B, T, d] (`final_hidden`: what the head unembeds, its logits
    `model.hidden_logits` of it), from its cached prefix state (reuse_prefix=False: a full re-run from
    `inputs`); a plan that changes nothing runs no block.

    Two more prefixes are reused, each the very state a full run computes: a single-skip plan kept by
    `remember_hidden` (within `shared_sweeps`) runs no block; and a plan that does what the previous plan did
    up to a position past its own first change (`common_prefix`: the pruning curve's k+1 blocks removed extend
    its k) starts from the previous run's state at that position, not from the intact prefix."""
    L = model.n_layer
    kept: tuple[int, object] | None = None  # (depth, state) of the previous run that this plan may start from
    for i, plan in enumerate(plans):
        if not reuse_prefix:
            yield model.scheme.final_hidden(model.run_states(inputs, plan=plan)[-1], model.ln_final)
            continue
        hidden = _remembered(model, inputs, plan)
        if hidden is None:
            start, from_state = plan.first_change(L), None
            if kept is not None and kept[0] > start:
                start, from_state = kept
            origin = states[start] if from_state is None else from_state
            run = model.run_states(plan=plan, start=start, from_state=origin)
            kept = _next_prefix(model, plan, plans[i + 1] if i + 1 < len(plans) else None, start, run)
            hidden = None if inputs is None else remember_hidden(model, inputs, plan, run[-1])
            if hidden is None:
                hidden = model.scheme.final_hidden(run[-1], model.ln_final)
        else:
            kept = None
        yield hidden


def _next_prefix(model, plan: Plan, following: Plan | None, start: int, run: list) -> tuple[int, object] | None:
    """(depth, state) of `run` (plan's states from `start`) at which `following` can start: the first position
    where the two plans differ, when it lies past following's first change (else the intact prefix serves)."""
    if following is None:
        return None
    depth = common_prefix(model, plan, following)
    if depth <= following.first_change(model.n_layer) or depth < start:
        return None
    return depth, run[depth - start]


def scored_rows(model, state) -> torch.Tensor:
    """final_hidden(state) at the scored positions, flattened to [B·(T-1), d]."""
    return _scored(model.scheme.final_hidden(state, model.ln_final))


def _scored(hidden: torch.Tensor) -> torch.Tensor:
    """Final hidden states [B, T, d] at the scored positions, flattened to [B·(T-1), d]."""
    return hidden[:, FIRST_SCORED:].flatten(0, 1)


def intact_reference(model, states: list, targets: torch.Tensor, B: int, head: Head | None,
                     intact: "_Sums") -> tuple[Reference, "_HeadRef | None"]:
    """One batch's intact output as a sweep's plans are compared with it: its head, the log-softmax of the scored
    rows with their probabilities and top-1 ids (`Reference`), its own metrics added to `intact`, and the chunked
    `head`'s reference where one is given. Once per sweep and batch, ~3 heads' work at a 49k vocabulary, so
    `cost.reference_seconds` times it rather than the plan charging one head."""
    ref = Reference.of(scored_logprobs(model.head(states[-1])))
    intact.add(ref.logp, ref, targets, B)
    href = None if head is None else _HeadRef(head, HeadReference.of(ref.logp, head=head, p=ref.p,
                                                                      top=ref.top1.unsqueeze(1)))
    return ref, href


def _plan_sums(model, plans, states, inputs, targets, refs, sums, reuse_prefix, tick) -> None:
    """Accumulate every plan's metrics on one batch. refs: (the intact `Reference`, its `headmetrics.Reference`
    or None for whole logit rows per plan). A plan whose final hidden state is the intact one bit for bit (it
    changes nothing, or only blocks that add exactly nothing) has the intact model's output: its sums are the
    intact ones (KL exactly 0), without decoding it again -- the same numbers the full log-softmax gives it."""
    ref, href = refs
    B = inputs.shape[0]
    intact = model.scheme.final_hidden(states[-1], model.ln_final)
    fused, buffer = None, LogitsBuffer()  # each plan's logits are consumed before the next plan's are decoded
    for acc, hidden in zip(sums, plan_hidden(model, plans, states, inputs, reuse_prefix)):
        if torch.equal(hidden, intact):
            acc.add(ref.logp, ref, targets, B)
        elif href is None:
            fused = plan_head_sums(acc, buffer.decode(model, hidden), ref, targets, B, fused)
        else:
            acc.add_rows(row_metrics(href.head, _scored(hidden), targets, href.ref), href.ref, targets, B)
        tick()


@torch.no_grad()
def sweep(
    model,
    tokens: torch.Tensor,
    plans: Sequence[Plan],
    batch_size: int = 8,
    reuse_prefix: bool = True,
    progress: Callable[[float], None] | None = None,
    chunked_head: bool | None = None,
) -> SweepResult:
    """Evaluate every plan on the token set [N, T+1]; returns intact and per-plan `PlanStats`.

    chunked_head: each changed plan's rows decoded by the vocabulary-chunked head (`headmetrics.row_metrics`:
    True) or a full [rows, V] log-softmax per plan (False); None: the full path while its block fits
    `headmetrics.FULL_HEAD_BYTES`.

    `progress(advance)` is called after each plan on each batch with the fraction of one plan done
    (1 / number of batches), so a progress bar over plans reaches len(plans).
    """
    tokens = check_tokens(model, tokens)
    shared = _SHARED.get()
    head = chunked_head_for(model, batch_size * max(tokens.shape[1] - 2, 1), chunked_head)
    key = _sweep_key(model, tokens, plans, batch_size) if shared is not None and reuse_prefix else None
    key = None if key is None else (*key, head is not None)
    if key is not None and key in shared:
        if progress is not None:
            progress(float(len(plans)))
        return shared[key]
    model.eval()
    n_batches = -(-tokens.shape[0] // batch_size)
    intact, sums = _Sums(), [_Sums() for _ in plans]

    def tick() -> None:
        if progress is not None:
            progress(1.0 / n_batches)

    for batch in batches(tokens, batch_size):
        inputs, targets = split_inputs(batch)
        targets = targets.flatten()
        B = inputs.shape[0]
        states = intact_states(model, inputs)
        refs = intact_reference(model, states, targets, B, head, intact)
        _plan_sums(model, plans, states, inputs, targets, refs, sums, reuse_prefix, tick)
        del states
    result = SweepResult(intact.stats(), [s.stats() for s in sums], intact.sequences(),
                         [s.sequences() for s in sums], intact.n_positions)
    if key is not None:
        shared[key] = result
    return result
