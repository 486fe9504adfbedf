"""Per-sequence skip profile: intact CE and every block's skip KL/ΔCE per evaluation sequence.

The effective-depth summary (`depthtools.analysis.summary`) bootstraps over evaluation sequences from
this table; `analyze` saves it as `sequence_profile`.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd
import torch

from depthtools.analysis.sweep import intact_states, plan_logits, scored_logprobs
from depthtools.analysis.tables import model_columns
from depthtools.analysis.tokens import batches, check_tokens, split_inputs, token_fingerprint
from depthtools.arch.model import Plan


@torch.no_grad()
def sequence_profile(model, tokens: torch.Tensor, rule: str | None = None, batch_size: int = 8,
                     progress: Callable[[float], None] | None = None) -> pd.DataFrame:
    """Per sequence: intact CE and, for every block l, KL(p_intact‖p_skip l) and ΔCE (scored positions).

    Long table: model columns, seq, layer (<NA> for ce_intact), metric ∈ {ce_intact, skip_kl,
    skip_dce}, value. Uses the sweep engine's prefix reuse (`plan_logits`).
    """
    tokens = check_tokens(model, tokens)
    model.eval()
    L = model.n_layer
    plans = [Plan.skipping(l, rule=rule) for l in range(L)]
    info = model_columns(model)
    rows: list[dict[str, Any]] = []
    seq0 = 0
    n_batches = -(-tokens.shape[0] // batch_size)
    for batch in batches(tokens, batch_size):
        inputs, targets = split_inputs(batch)
        B = inputs.shape[0]
        states = intact_states(model, inputs)
        ref = scored_logprobs(model.head(states[-1])).view(B, -1, model.config.vocab_size)
        ce = -ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().mean(1)  # [B]
        for b in range(B):
            rows.append({**info, "seq": seq0 + b, "layer": None, "metric": "ce_intact", "value": float(ce[b])})
        for l, logits in enumerate(plan_logits(model, plans, states)):
            lp = scored_logprobs(logits).view(B, -1, model.config.vocab_size)
            kl = (ref.exp() * (ref - lp)).sum(-1).double().mean(1)
            ce_l = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().mean(1)
            for b in range(B):
                rows.append({**info, "seq": seq0 + b, "layer": l, "metric": "skip_kl", "value": float(kl[b])})
                rows.append({**info, "seq": seq0 + b, "layer": l, "metric": "skip_dce", "value": float(ce_l[b] - ce[b])})
        seq0 += B
        if progress is not None:
            progress(1.0 / n_batches)
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    df.attrs["settings"] = {"rule": rule, "batch_size": batch_size, "tokens": token_fingerprint(tokens)}
    return df
