"""Expert routing of mixture-of-experts models (Mixtral, OLMoE, Qwen-MoE): the MoE part of the `routing` view.

`depthtools.analysis.routing` measures how a block mixes earlier *depths*; this module measures how each MoE
block's router spreads tokens over its *experts*, and how removing an earlier block moves that routing. For each
MoE block l (`depthtools.arch.moe`), over the token positions ≥ exclude_first of the token set:

  expert_load[l, e]          share of the token·slot assignments (top-k) that go to expert e (Σ_e = 1; a
                             balanced router gives 1/E each)
  expert_load_max[l]         max_e expert_load · E  (1 = perfectly balanced, E = every token to one expert)
  router_entropy[l]          mean over tokens of the entropy of the router's softmax over the E experts (nats;
                             ln E = uniform)
  routing_change_after_skip[s, l]
                             share of tokens whose top-k expert *set* at block l differs once block s < l is
                             bypassed (the scheme's skip rule, as `ablate --mode skip`); ties in the top-k follow
                             torch.topk, as in the model itself

Model rows: router_entropy_mean, expert_load_max_max, routing_change_after_skip_mean. The router logits are
read from each MoE's `hook_router`; the skipped runs restart from the intact run's state at s (prefix caching),
so block s's own routing and everything before it are not recomputed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from depthtools.arch.model import Plan
from depthtools.arch.moe import MoE, route

F64 = torch.float64


def moe_blocks(model) -> list[int]:
    """Indices of the blocks whose MLP is a mixture of experts."""
    return [i for i, block in enumerate(model.blocks) if isinstance(block.mlp, MoE)]


def _router_logits(model, run) -> dict[int, torch.Tensor]:
    """block index -> router logits [B, T, E] of every MoE block that runs during `run()`."""
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for index in moe_blocks(model):
        def keep(module, args, output, index=index):
            captured[index] = output.detach()
        handles.append(model.blocks[index].mlp.hook_router.register_forward_hook(keep))
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _expert_sets(logits: torch.Tensor, moe: MoE) -> torch.Tensor:
    """[..., E] bool: the experts each token is routed to (its top-k set)."""
    _, chosen = route(logits.reshape(-1, moe.n_experts), moe.top_k, moe.normalise)
    mask = torch.zeros(chosen.shape[0], moe.n_experts, dtype=torch.bool, device=chosen.device)
    mask.scatter_(1, chosen, True)
    return mask.reshape(*logits.shape[:-1], moe.n_experts)


def expert_routing_rows(model, inputs: torch.Tensor, exclude_first: int = 1, batch_size: int = 8,
                        skip_rule: str | None = None) -> list[dict[str, Any]]:
    """The tidy rows of the module docstring for inputs [N, T] (empty without MoE blocks)."""
    blocks = moe_blocks(model)
    if not blocks:
        return []
    L = model.n_layer
    E = {l: model.blocks[l].mlp.n_experts for l in blocks}
    load = {l: torch.zeros(E[l], dtype=F64) for l in blocks}
    entropy = dict.fromkeys(blocks, 0.0)
    changed = {(s, l): 0.0 for s in range(L) for l in blocks if l > s}
    n_tokens = 0
    for start in range(0, inputs.shape[0], batch_size):
        batch = inputs[start: start + batch_size]
        states: list = []
        intact = _router_logits(model, lambda: states.extend(model.run_states(batch)))
        sets = {l: _expert_sets(intact[l], model.blocks[l].mlp)[:, exclude_first:] for l in blocks}
        n = sets[blocks[0]].shape[0] * sets[blocks[0]].shape[1]
        n_tokens += n
        for l in blocks:
            logits = intact[l][:, exclude_first:].double()
            entropy[l] += float(-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).sum())
            load[l] += sets[l].reshape(-1, E[l]).sum(0).double().cpu()
        for s in range(L):
            later = [l for l in blocks if l > s]
            if not later:
                continue
            plan = Plan.skipping(s, rule=skip_rule)
            skipped = _router_logits(model, lambda: model.run_states(plan=plan, start=s, from_state=states[s]))
            for l in later:
                other = _expert_sets(skipped[l], model.blocks[l].mlp)[:, exclude_first:]
                changed[(s, l)] += float((other != sets[l]).any(-1).sum())
    return _rows(blocks, E, load, entropy, changed, n_tokens)


def _rows(blocks, E, load, entropy, changed, n_tokens) -> list[dict[str, Any]]:
    """Tidy rows (unit "block") and the model summaries from the accumulated counts."""
    rows: list[dict[str, Any]] = []
    for l in blocks:
        share = load[l] / load[l].sum()
        rows += [{"metric": "expert_load", "unit": "block", "layer": l, "expert": e, "value": float(share[e])}
                 for e in range(E[l])]
        rows.append({"metric": "expert_load_max", "unit": "block", "layer": l, "value": float(share.max()) * E[l]})
        rows.append({"metric": "router_entropy", "unit": "block", "layer": l, "value": entropy[l] / n_tokens})
    rows += [{"metric": "routing_change_after_skip", "unit": "block", "layer": s, "layer_j": l,
              "value": count / n_tokens} for (s, l), count in changed.items()]
    summaries = {"router_entropy_mean": [entropy[l] / n_tokens for l in blocks],
                 "expert_load_max_max": [float((load[l] / load[l].sum()).max()) * E[l] for l in blocks],
                 "routing_change_after_skip_mean": [c / n_tokens for c in changed.values()]}
    for name, values in summaries.items():
        reduce = max if name.endswith("_max") else (lambda v: sum(v) / len(v))
        rows.append({"metric": name, "value": reduce(values) if values else math.nan})
    return rows
