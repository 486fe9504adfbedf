"""Native depth-routing statistics (metrics.md §4): how each consumer mixes earlier depths.

Only architectures with learned depth routing have these; extraction is architecture-native and
lives behind one small dispatch on the architecture (`EXTRACTORS`) — the only place in the
analyses that knows architectures. Others get an empty table with a note.

Common frame. Depths are counted in sublayers: source depth i = 0 is the embedding, i = j+1 the
output of sublayer j (2b = attention, 2b+1 = MLP of block b); a consumer at depth c reads the
sources available after c sublayers (c = 2L: the final readout). W[c, i] = weight of source i in
consumer c's input, averaged over tokens (positions ≥ exclude_first). Per consumer, with
p = |W[c,·]| / Σ|W[c,·]|:
  mean_source_lag = Σ_i (c − i + 1) p_i   (in sublayers; 1 = the newest source)
  source_entropy  = −Σ p log p            (nats)
  long_range_mass = Σ_{c−i+1 > k} p_i     (k = `long_range_k` sublayers)
  max_weight      = max_i p_i

* HC / mHC: the unfolded layer-to-layer matrix (HC paper; AttnRes paper §6.2). With per-sublayer
  connector weights w_j (branch input), R_j (new streams = R_j @ streams) and β_j (output weights)
  from the hooks `blocks.{b}.{attn,mlp}_hc.hook_{width,res,depth}_weights`, the streams before
  consumer c are H = P_{0→c}(1 ⊗ x_0) + Σ_{j<c} P_{j+1→c} β_j y_j with P_{a→c} = R_{c−1}⋯R_a, so
  W[c, j+1] = w_cᵀ P_{j+1→c} β_j and W[c, 0] = w_cᵀ P_{0→c} 1, per token, then averaged. The final
  consumer reads the readout collapse (Σ_s H_s, or the head mixer's p) normalised to sum 1
  (ln_final is scale invariant). At HC init every entry is 1: the Pre-LN pattern.
  mHC also reports how far each finite Sinkhorn result R_j is from doubly stochastic, over every
  token (position 0 included): sinkhorn_row_error = max |Σ_i R_j[o,i] − 1|, sinkhorn_col_error =
  max |Σ_o R_j[o,i] − 1| (layer = the consumer depth j of that connector; model rows: the max over
  sublayers). The normalisation that runs last (option sinkhorn_order: rows for the paper's default
  "rows_last") is exact to rounding; the other shows how far 20 rounds are from convergence.
* Full / Block AttnRes: the depth-attention maps (`blocks.{b}.hook_attnres_weights_{attn,mlp}`,
  `scheme.hook_attnres_weights_final`); Block AttnRes sources are block sums, placed at the depth
  of their newest sublayer.
* DenseFormer: the static DWA weights `scheme.dwa.{b}` (consumer = the input of block b+1, sources
  the retained block outputs X_j at depth 2j).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pandas as pd
import torch

from depthtools.analysis.geometry import check_positions, model_inputs, tidy_frame
from depthtools.analysis.tokens import token_fingerprint

F64 = torch.float64
LONG_RANGE_K = 4


# -- HC / mHC ------------------------------------------------------------------------------------

def _hyper_routing(model, tokens: torch.Tensor, exclude_first: int):
    """(consumers [(c, kind)], W [2L+1, 2L+1] token-mean unfolded weights, notes)."""
    L = model.n_layer
    S = 2 * L
    names = {}
    for b in range(L):
        for j, side in ((2 * b, "attn"), (2 * b + 1, "mlp")):
            for part in ("width", "res", "depth"):
                names[f"blocks.{b}.{side}_hc.hook_{part}_weights"] = (j, part)
    cache: dict[tuple[int, str], torch.Tensor] = {}
    residuals: dict[int, tuple[float, float]] = {}  # sublayer -> (row, column) Sinkhorn error, all tokens

    def store(tensor, hook):
        key = names[hook.name]
        if key[1] == "res" and model.config.arch == "mhc":
            from depthtools.arch.hyper import sinkhorn_residuals

            residuals[key[0]] = sinkhorn_residuals(tensor.detach().to(F64))  # exact sums of the stored entries
        cache[key] = tensor.detach()[:, exclude_first:].to(F64).flatten(0, 1)  # [N, ...]

    with torch.no_grad(), model.hooks(fwd_hooks=[(name, store) for name in names]):
        states = model.run_states(tokens)
    w = [cache[(j, "width")] for j in range(S)]  # [N, n]
    R = [cache[(j, "res")] for j in range(S)]  # [N, n, n]
    beta = [cache[(j, "depth")] for j in range(S)]  # [N, n]
    final = _hyper_readout_weights(model, states[-1])[:, exclude_first:].to(F64).flatten(0, 1)  # [N, n]
    final = final / final.sum(-1, keepdim=True)
    W = torch.full((S + 1, S + 1), math.nan, dtype=F64)
    for c in range(S + 1):
        a = w[c] if c < S else final  # [N, n]
        for j in range(c - 1, -1, -1):
            W[c, j + 1] = (a * beta[j]).sum(-1).mean()
            a = torch.einsum("noi,no->ni", R[j], a)  # a <- R_jᵀ a
        W[c, 0] = a.sum(-1).mean()
    consumers = [(c, "attn" if c % 2 == 0 else "mlp") for c in range(S)] + [(S, "final")]
    extra = []
    for j, (row, col) in sorted(residuals.items()):
        kind = "attn" if j % 2 == 0 else "mlp"
        extra += [{"metric": "sinkhorn_row_error", "unit": "sublayer_depth", "layer": j, "value": row, "consumer_kind": kind},
                  {"metric": "sinkhorn_col_error", "unit": "sublayer_depth", "layer": j, "value": col, "consumer_kind": kind}]
    if residuals:
        extra += [{"metric": "sinkhorn_row_error_max", "value": max(r for r, _ in residuals.values())},
                  {"metric": "sinkhorn_col_error_max", "value": max(c for _, c in residuals.values())}]
    return consumers, W, [], extra


def _hyper_readout_weights(model, state: torch.Tensor) -> torch.Tensor:
    """[B,T,n] stream weights of the readout collapse: ones, or the DeepSeek-style head mixer's p."""
    scheme = model.scheme
    n = state.shape[-2]
    if getattr(scheme, "head_fn", None) is None:
        return torch.ones(*state.shape[:-2], n, dtype=state.dtype)
    from depthtools.arch.hyper import HEAD_EPS

    with torch.no_grad():
        x = state.flatten(-2).float()
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + scheme.opts["connector_norm_eps"])
        logits = scheme.head_scale.float() * ((x @ scheme.head_fn.float().T) * inv) + scheme.head_base.float()
        return torch.sigmoid(logits) + HEAD_EPS


# -- AttnRes -------------------------------------------------------------------------------------

def _attnres_source_depths(c: int, block_size: int) -> list[int]:
    """Depths of the sources a consumer at depth c sees: embedding, closed block sums, partial."""
    return [0] + [m * block_size for m in range(1, c // block_size + 1)] + ([c] if c % block_size else [])


def _attnres_routing(model, tokens: torch.Tensor, exclude_first: int):
    L = model.n_layer
    S = 2 * L
    names = {f"blocks.{b}.hook_attnres_weights_{side}": 2 * b + k for b in range(L) for k, side in enumerate(("attn", "mlp"))}
    names["scheme.hook_attnres_weights_final"] = S
    cache: dict[int, torch.Tensor] = {}

    def store(tensor, hook):
        cache[names[hook.name]] = tensor.detach()[:, exclude_first:].to(F64).flatten(0, 1).mean(0)  # [n_src]

    with torch.no_grad(), model.hooks(fwd_hooks=[(name, store) for name in names]):
        model.readout(model.run_states(tokens)[-1])
    block_size = int(getattr(model.scheme, "block_size", 1))
    W = torch.full((S + 1, S + 1), math.nan, dtype=F64)
    notes = []
    for c in range(S + 1):
        weights = cache[c]
        depths = _attnres_source_depths(c, block_size)
        if len(depths) != len(weights):
            notes.append(f"consumer {c}: {len(weights)} sources, expected {len(depths)}; placed newest-last")
            depths = list(range(c + 1 - len(weights), c + 1))
        for d, value in zip(depths, weights.tolist()):
            W[c, d] = value
    consumers = [(c, "attn" if c % 2 == 0 else "mlp") for c in range(S)] + [(S, "final")]
    return consumers, W, notes, []


# -- DenseFormer ---------------------------------------------------------------------------------

def _denseformer_routing(model, tokens: torch.Tensor, exclude_first: int):
    L = model.n_layer
    S = 2 * L
    scheme = model.scheme
    W = torch.full((S + 1, S + 1), math.nan, dtype=F64)
    consumers = []
    for key, weights in scheme.dwa.items():
        b = int(key)
        retained = list(range(b + 2))  # X_0..X_{b+1}
        group = retained[(b + 1) % scheme.dilation :: scheme.dilation]
        c = 2 * (b + 1)
        for j, value in zip(group, weights.detach().to(F64).tolist()):
            W[c, 2 * j] = value
        consumers.append((c, "final" if b == L - 1 else "dwa"))
    return sorted(consumers), W, [], []


EXTRACTORS: dict[str, Callable] = {
    "hc": _hyper_routing,
    "mhc": _hyper_routing,
    "attnres": _attnres_routing,
    "blockattnres": _attnres_routing,
    "denseformer": _denseformer_routing,
}


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
    extractor = EXTRACTORS.get(arch)
    if extractor is None:
        return tidy_frame(model, [], settings, [f"{arch} has no native depth routing"])
    model.eval()
    consumers, W, notes, extra = extractor(model, inputs, exclude_first)
    rows: list[dict[str, Any]] = []
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
