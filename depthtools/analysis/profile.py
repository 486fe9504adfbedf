"""Per-sequence skip profile: intact CE and every block's skip KL/ΔCE per evaluation sequence.

The effective-depth summary (`depthtools.analysis.summary`) bootstraps over evaluation sequences from
this table; `analyze` saves it as `sequence_profile`.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd
import torch

from depthtools.analysis.sweep import sweep
from depthtools.analysis.tables import model_columns
from depthtools.analysis.tokens import check_tokens, token_fingerprint
from depthtools.arch.model import Plan


def _interleave(intact: list[dict], by_seq: list[list[dict]], batch_size: int) -> list[dict]:
    """Rows in the table's order since issue 29: per batch, its sequences' ce_intact rows, then per block
    each sequence's skip_kl and skip_dce rows (so a saved table compares row by row with older ones)."""
    rows: list[dict] = []
    for lo in range(0, len(intact), batch_size):
        seqs = range(lo, min(lo + batch_size, len(intact)))
        rows += [intact[b] for b in seqs]
        n_layers = len(by_seq[lo]) // 2 if by_seq else 0
        for l in range(n_layers):
            for b in seqs:
                rows += by_seq[b][2 * l:2 * l + 2]
    return rows


@torch.no_grad()
def sequence_profile(model, tokens: torch.Tensor, rule: str | None = None, batch_size: int = 8,
                     progress: Callable[[float], None] | None = None) -> pd.DataFrame:
    """Per sequence: intact CE and, for every block l, KL(p_intact‖p_skip l) and ΔCE (scored positions).

    Long table: model columns, seq, layer (<NA> for ce_intact), metric ∈ {ce_intact, skip_kl,
    skip_dce}, value. One skip sweep (`sweep`: prefix reuse, per-sequence sums), which within the suite's
    `shared_sweeps()` is the same sweep as `ablate_skip`'s default rule, run once.
    """
    tokens = check_tokens(model, tokens)
    L = model.n_layer
    result = sweep(model, tokens, [Plan.skipping(l, rule=rule) for l in range(L)], batch_size=batch_size,
                   progress=None if progress is None else (lambda advance: progress(advance / L)))
    n = result.n_positions
    ce = (result.intact_sequences[:, 0] / n).tolist()  # per sequence: mean CE of the scored positions
    info = model_columns(model)
    rows: list[dict[str, Any]] = [{**info, "seq": b, "layer": None, "metric": "ce_intact", "value": ce[b]}
                                  for b in range(len(ce))]
    by_seq: list[list[dict[str, Any]]] = [[] for _ in ce]
    for l, sums in enumerate(result.plan_sequences):
        ce_l, kl = (sums[:, 0] / n).tolist(), (sums[:, 1] / n).tolist()
        for b in range(len(ce)):
            by_seq[b].append({**info, "seq": b, "layer": l, "metric": "skip_kl", "value": kl[b]})
            by_seq[b].append({**info, "seq": b, "layer": l, "metric": "skip_dce", "value": ce_l[b] - ce[b]})
    rows = _interleave(rows, by_seq, batch_size)
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    df.attrs["settings"] = {"rule": rule, "batch_size": batch_size, "tokens": token_fingerprint(tokens)}
    return df
