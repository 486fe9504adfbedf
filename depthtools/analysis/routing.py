"""Native depth-routing statistics (docs/reference/metrics.md §4): how each consumer mixes earlier depths.

Only architectures with learned depth routing have these; each extracts its own in the common frame
below (`ResidualScheme.depth_routing`, returning a `DepthRouting`: HC/mHC the unfolded stream
matrix and mHC's Sinkhorn residuals, Full/Block AttnRes the depth-attention maps, DenseFormer the
DWA weights; see each scheme). Others get an empty table with a note. This module knows no
architecture.

Common frame. Depths are counted in sublayers: source depth i = 0 is the embedding, i = j+1 the
output of sublayer j (2b = attention, 2b+1 = MLP of block b); a consumer at depth c reads the
sources available after c sublayers (c = 2L: the final readout). W[c, i] = weight of source i in
consumer c's input, averaged over tokens (positions ≥ exclude_first). Per consumer, with
p = |W[c,·]| / Σ|W[c,·]|:
  mean_source_lag = Σ_i (c − i + 1) p_i   (in sublayers; 1 = the newest source)
  source_entropy  = −Σ p log p            (nats)
  long_range_mass = Σ_{c−i+1 > k} p_i     (k = `long_range_k` sublayers)
  max_weight      = max_i p_i
At HC init every entry of the unfolded matrix is 1 (the Pre-LN pattern); mHC's sinkhorn_row_error /
sinkhorn_col_error rows say how far each finite Sinkhorn result is from doubly stochastic (the
normalisation that runs last, option sinkhorn_order, is exact to rounding).

Mixture-of-experts models (Mixtral, OLMoE, Qwen-MoE) add their expert routing per MoE block — expert load,
router entropy, and the share of tokens whose top-k experts change when an earlier block is skipped
(`depthtools.analysis.experts`).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from depthtools.analysis.experts import expert_routing_rows
from depthtools.analysis.geometry import check_positions, model_inputs, tidy_frame
from depthtools.analysis.tokens import token_fingerprint

F64 = torch.float64
LONG_RANGE_K = 4


# -- statistics ----------------------------------------------------------------------------------

def consumer_stats(c: int, row: torch.Tensor, long_range_k: int = LONG_RANGE_K) -> dict[str, float]:
    """Routing statistics of one consumer at depth c from its weights over source depths (NaN = absent)."""
    present = [(i, float(row[i])) for i in range(c + 1) if not math.isnan(float(row[i]))]
    total = sum(abs(v) for _, v in present)
    if not present or total == 0:
        return {k: math.nan for k in ("mean_source_lag", "source_entropy", "long_range_mass", "max_weight")}
    p = [(i, abs(v) / total) for i, v in present]
    return {
        "mean_source_lag": sum((c - i + 1) * q for i, q in p),
        "source_entropy": -sum(q * math.log(q) for _, q in p if q > 0),
        "long_range_mass": sum(q for i, q in p if c - i + 1 > long_range_k),
        "max_weight": max(q for _, q in p),
    }


def routing_stats(model, tokens: torch.Tensor, exclude_first: int = 1, long_range_k: int = LONG_RANGE_K) -> pd.DataFrame:
    """Native routing matrix and per-consumer statistics; empty table + note without native routing.

    tokens: a token set [N,T+1] (the model reads the first T); dynamic weights are token means.
    Rows (unit "sublayer_depth"): routing_weight with layer = consumer depth c, layer_j = source
    depth i and a `consumer_kind` column (attn / mlp / dwa / final); mean_source_lag,
    source_entropy, long_range_mass, max_weight per consumer; model rows <stat>_mean over consumers.
    mHC adds sinkhorn_row_error / sinkhorn_col_error per sublayer and their _max model rows (see the
    module docstring).
    """
    inputs = model_inputs(model, tokens)
    check_positions(inputs, exclude_first)
    arch = model.config.arch
    settings = dict(exclude_first=exclude_first, long_range_k=long_range_k,
                    n_sequences=int(inputs.shape[0]), seq_len=int(inputs.shape[1]), tokens=token_fingerprint(tokens))
    model.eval()
    experts = expert_routing_rows(model, inputs, exclude_first)  # MoE blocks' expert routing (else none)
    routing = model.scheme.depth_routing(model, inputs, exclude_first)
    if routing is None:
        return tidy_frame(model, experts, settings, [] if experts else [f"{arch} has no native depth routing"])
    consumers, W, notes, extra = routing.consumers, routing.weights, routing.notes, routing.extra
    rows: list[dict[str, Any]] = list(experts)
    per_stat: dict[str, list[float]] = {}
    for c, kind in consumers:
        for i in range(c + 1):
            if not math.isnan(float(W[c, i])):
                rows.append({"metric": "routing_weight", "unit": "sublayer_depth", "layer": c, "layer_j": i,
                             "value": float(W[c, i]), "consumer_kind": kind})
        for name, value in consumer_stats(c, W[c], long_range_k).items():
            rows.append({"metric": name, "unit": "sublayer_depth", "layer": c, "value": value, "consumer_kind": kind})
            per_stat.setdefault(name, []).append(value)
    for name, values in per_stat.items():
        valid = [v for v in values if not math.isnan(v)]
        rows.append({"metric": f"{name}_mean", "value": sum(valid) / len(valid) if valid else math.nan})
    rows.extend(extra)  # architecture-specific rows (mHC: Sinkhorn residuals)
    return tidy_frame(model, rows, settings, notes)


def routing_matrix(df: pd.DataFrame) -> torch.Tensor:
    """The (2L+1)×(2L+1) consumer × source weight matrix from a routing table (NaN where absent)."""
    sub = df[df["metric"] == "routing_weight"]
    L = int(df["n_layer"].iloc[0]) if len(df) else 0
    W = torch.full((2 * L + 1, 2 * L + 1), math.nan, dtype=F64)
    for c, i, v in zip(sub["layer"], sub["layer_j"], sub["value"]):
        W[int(c), int(i)] = v
    return W
