"""DepthBench's own metrics, computed as its scripts compute them (`protocol="depthbench"`).

DepthBench (keyu-wang-2002/DepthBench, `analysis/`) defines its metrics over *depth states* z_0..z_L
and two interventions, skip and swap, per architecture family (`analysis/depth_probes.py`). This module
reproduces those numbers on depthtools models through the depth-state contract (`run_states`, `Plan`);
depthtools' own metrics (lens.py, ablate.py, causal.py, similarity.py, contrib.py) keep their names and
definitions. Where the two differ and why: docs/depthbench.md.

Conventions that follow DepthBench and differ from depthtools' defaults:
  * token windows are `input_ids` [N, T] and every position counts: geometry metrics use all N·T
    positions (position 0 included), losses all N·(T-1) next-token targets inside the window;
  * skip rule per family: residual blocks are the identity, MoDA's skipped slots stay zero ("zero"),
    Full and Block AttnRes use "depthbench" (DepthBench's skip_block: the block passes its input on, the
    next boundary mix becomes the identity on the newest source; depthtools.arch.attnres);
  * swap exchanges the two blocks' weights (depthtools' `Plan.swapping` follows the same rule);
  * states per script: `depth_probes.forward_depth_states` (angular distance, causal score: HC streams
    concatenated to n·d, AttnRes the next-consumer mix) or the block outputs of the older scripts
    (usefulness, Jacobian, token collapse: HC streams folded into the batch as n separate sequences,
    AttnRes the block's returned running sum).
Every function takes an optional `micro_batch_size` (DepthBench's micro-batching; results depend on it
only where DepthBench's do: usefulness averages per-micro-batch mean losses).

A metric DepthBench does not define for an architecture raises a one-line DepthToolsError naming both.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from depthtools.analysis.suite import eval_tokens, table_settings
from depthtools.analysis.tables import model_columns, save_table
from depthtools.analysis.tokens import config_limits
from depthtools.arch.model import Plan
from depthtools.checkpoint import load
from depthtools.errors import DepthToolsError

PROTOCOLS = ("depthtools", "depthbench")
METRICS = ("angular_distance", "causal_score", "permutation_score", "layer_pruning", "usefulness_score",
           "token_collapse", "jacobian", "logit_lens")
SEQ_LEN = 512  # DepthBench's window length (every script's default but causal/permutation/pruning: 256)
TOP_K = 10  # DepthBench's top causal-score pairs


def family(model) -> str:
    """DepthBench's family of `model` (its scheme's `depthbench_family`: residual, moda, hyper-connections or
    attnres); a one-line error for an architecture DepthBench's probes do not cover (or that depthtools does
    not reproduce). Every per-architecture step of the protocol is a `ResidualScheme.depthbench_*` hook."""
    fam = model.scheme.depthbench_family
    if fam is None:
        raise DepthToolsError(f"--protocol depthbench is undefined for {model.config.arch}: DepthBench's depth "
                              "probes cover the residual family, MoDA, HC/mHC and AttnRes only; use --protocol "
                              "depthtools")
    return fam


def undefined(model) -> Mapping[str, str]:
    """{metric: why DepthBench does not define it (or depthtools does not reproduce it)} for `model`'s family."""
    family(model)
    return model.scheme.depthbench_undefined


def check_defined(model, metric: str) -> str:
    """The model's family if DepthBench defines `metric` for it, else a one-line DepthToolsError."""
    if metric not in METRICS:
        raise DepthToolsError(f"unknown DepthBench metric {metric!r}; valid: {', '.join(METRICS)}")
    fam = family(model)
    why = undefined(model).get(metric)
    if why is not None:
        raise DepthToolsError(f"DepthBench's {metric} is undefined for {model.config.arch}: {why}")
    return fam


def skip_rule(model) -> str:
    """DepthBench's skip rule in depthtools' names (the scheme's `depthbench_skip_rule`): identity (residual,
    HC), zero (MoDA), depthbench (Full and Block AttnRes: `depth_probes.skip_block`, see depthtools.arch.attnres)."""
    family(model)
    return model.scheme.depthbench_skip_rule


def skip_plan(model, position: int) -> Plan:
    return Plan.skipping(position, rule=skip_rule(model))


def micro_batches(input_ids: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    if size < 1:
        raise DepthToolsError(f"micro_batch_size must be >= 1, got {size}")
    for start in range(0, input_ids.shape[0], size):
        yield input_ids[start:start + size]


def _check_ids(model, input_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise DepthToolsError("DepthBench metrics take input_ids [N, T] with T >= 2 (targets inside the window)")
    return input_ids.to(model.tok_embed.weight.device).long()  # the embedding: resident also when streamed


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32, or the tensor's own dtype if wider (DepthBench casts to float32; float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# -- depth states -----------------------------------------------------------------------------
def probe_state(model, state) -> torch.Tensor:
    """[B,T,k]: `depth_probes.forward_depth_states`' z_l (HC: the n streams concatenated, n·d; AttnRes:
    the raw mix the next consumer computes at a true boundary — every depth for Full AttnRes; Block AttnRes:
    depth 0, L and l whose attention closes a block, 2l mod S = 0 — else the running sum the block returns;
    residual/MoDA: the block output); the scheme's `depthbench_state`."""
    family(model)
    return model.scheme.depthbench_state(state)


def block_output(model, state) -> torch.Tensor:
    """[B',T,d]: the block output the older scripts hook (output[0]); HC streams folded into the batch
    (b-major, as `_flatten_from_streams`), AttnRes the running sum the block returns (the embedding at 0);
    the scheme's `depthbench_block_output`."""
    family(model)
    return model.scheme.depthbench_block_output(state)


def probe_states(model, ids: torch.Tensor, plan: Plan | None = None) -> list[torch.Tensor]:
    return [probe_state(model, z) for z in model.run_states(ids, plan=plan)]


# -- losses -----------------------------------------------------------------------------------
def next_token_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token CE over all positions of the windows, and the number of targets."""
    targets = ids[:, 1:]
    loss = F.cross_entropy(_wide(logits[:, :-1]).reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return float(loss), targets.numel()


@torch.no_grad()
def mean_lm_loss(model, input_ids, plan: Plan | None = None, micro_batch_size: int = 4) -> float:
    """`depth_probes.mean_lm_loss`: token mean of next-token CE over every micro-batch."""
    ids = _check_ids(model, input_ids)
    total, count = 0.0, 0
    for batch in micro_batches(ids, micro_batch_size):
        s, n = next_token_loss_sum(model.run(batch, plan=plan), batch)
        total, count = total + s, count + n
    return total / count


@torch.no_grad()
def mean_loss_per_sequence(model, input_ids, plan: Plan | None = None, micro_batch_size: int = 2) -> float:
    """`layer_score_utils.compute_mean_loss` (usefulness): each micro-batch's mean loss weighted by its number
    of sequences (equal to the token mean unless the last micro-batch is short)."""
    ids = _check_ids(model, input_ids)
    total = 0.0
    for batch in micro_batches(ids, micro_batch_size):
        s, n = next_token_loss_sum(model.run(batch, plan=plan), batch)
        total += s / n * batch.shape[0]
    return total / ids.shape[0]


# -- angular distance -------------------------------------------------------------------------
@torch.no_grad()
def angular_distance(model, input_ids, micro_batch_size: int = 4, include_embeddings: bool = True) -> np.ndarray:
    """`compute_angular_distance.py`: d(i,j) = mean_tokens arccos(cos(z_i, z_j))/π for i < j (NaN elsewhere)."""
    check_defined(model, "angular_distance")
    ids = _check_ids(model, input_ids)
    sums, n_tok = None, 0
    for batch in micro_batches(ids, micro_batch_size):
        states = probe_states(model, batch)[0 if include_embeddings else 1:]
        units = torch.stack([F.normalize(_wide(z).reshape(-1, z.shape[-1]), dim=-1) for z in states])
        if sums is None:
            sums = torch.zeros(len(states), len(states), dtype=torch.float64)
        for i in range(len(states) - 1):
            cos = (units[i + 1:] * units[i]).sum(-1).clamp(-1.0, 1.0)
            sums[i, i + 1:] += torch.acos(cos).sum(-1).double().cpu()
        n_tok += units.shape[1]
    matrix = (sums / (n_tok * math.pi)).numpy()
    matrix[np.tril_indices_from(matrix)] = np.nan
    return matrix


# -- causal score -----------------------------------------------------------------------------
def _updates(states: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.stack([_wide(z).reshape(-1, z.shape[-1]) for z in states])
    return flat[1:] - flat[:-1]


@torch.no_grad()
def causal_score(model, input_ids, micro_batch_size: int = 4, eps: float = 1e-8) -> np.ndarray:
    """`compute_causal_score.py`: C(s,l) = mean_tokens ‖u_l^{skip s} − u_l‖ / max(‖u_l‖, eps) for l > s,
    u_l = z_{l+1} − z_l, with DepthBench's skip rule; [L,L] with NaN on and below the diagonal."""
    check_defined(model, "causal_score")
    ids = _check_ids(model, input_ids)
    L = model.n_layer
    sums, n_tok = torch.zeros(L, L, dtype=torch.float64), 0
    for batch in micro_batches(ids, micro_batch_size):
        intact = model.run_states(batch)
        base = _updates([probe_state(model, z) for z in intact])
        base_norm = base.norm(dim=-1).clamp_min(eps)
        for s in range(L - 1):
            tail = model.run_states(from_state=intact[s], start=s, plan=skip_plan(model, s))
            states = [probe_state(model, z) for z in intact[:s]] + [probe_state(model, z) for z in tail]
            down = slice(s + 1, L)
            change = (_updates(states)[down] - base[down]).norm(dim=-1)
            sums[s, down] += (change / base_norm[down]).sum(-1).double().cpu()
        n_tok += base.shape[1]
    matrix = (sums / n_tok).numpy()
    matrix[np.tril_indices_from(matrix)] = np.nan
    return matrix


def upper_triangle(matrix: np.ndarray) -> list[tuple[int, int, float]]:
    return [(i, j, float(matrix[i, j])) for i in range(matrix.shape[0]) for j in range(i + 1, matrix.shape[1])
            if np.isfinite(matrix[i, j])]


def causal_summary(matrix: np.ndarray, top_k: int = TOP_K) -> dict:
    """DepthBench's results.json: mean and max over the upper triangle and the top_k (skipped, observed) pairs."""
    entries = upper_triangle(matrix)
    values = np.asarray([v for _, _, v in entries])
    top = sorted(entries, key=lambda e: e[2], reverse=True)[:top_k]
    return {"mean_causal_score": float(values.mean()) if values.size else math.nan,
            "max_causal_score": float(values.max()) if values.size else math.nan,
            "top_causal_scores": [(i, j, v) for i, j, v in top]}


# -- permutation score and single-layer pruning -----------------------------------------------
def all_pairs(n_layer: int, anchors: list[int] | None = None) -> list[tuple[int, int]]:
    """`build_layer_pairs`: all i < j, or the pairs containing an anchor layer."""
    if not anchors:
        return [(i, j) for i in range(n_layer) for j in range(i + 1, n_layer)]
    return sorted({tuple(sorted((a, o))) for a in anchors for o in range(n_layer) if o != a})


def permutation_score(model, input_ids, pairs: list[tuple[int, int]] | None = None,
                      micro_batch_size: int = 4) -> tuple[float, dict[tuple[int, int], float]]:
    """`compute_permutation_score.py`: (L, {(i,j): |L_swap(i,j) − L| / L}) over all pairs by default."""
    check_defined(model, "permutation_score")
    L = model.n_layer
    base = mean_lm_loss(model, input_ids, micro_batch_size=micro_batch_size)
    scores = {}
    for i, j in pairs if pairs is not None else all_pairs(L):
        swapped = mean_lm_loss(model, input_ids, Plan.swapping(i, j, L), micro_batch_size)
        scores[(i, j)] = abs(swapped - base) / base
    return base, scores


def permutation_summary(scores: dict[tuple[int, int], float], n_layer: int) -> dict:
    """mean_permutation_score and layer_mean_permutation_scores (mean over the pairs containing the layer)."""
    per_layer = [[s for pair, s in scores.items() if layer in pair] for layer in range(n_layer)]
    return {"mean_permutation_score": float(np.mean(list(scores.values()))) if scores else math.nan,
            "layer_mean_permutation_scores": [float(np.mean(v)) if v else math.nan for v in per_layer]}


def layer_pruning(model, input_ids, layers: list[int] | None = None,
                  micro_batch_size: int = 4) -> tuple[float, dict[int, float]]:
    """`compute_layer_pruning.py` (LM-loss signal): (L, {l: L_pruned(l) − L}) with DepthBench's skip rule."""
    check_defined(model, "layer_pruning")
    base = mean_lm_loss(model, input_ids, micro_batch_size=micro_batch_size)
    layers = list(range(model.n_layer)) if layers is None else layers
    return base, {l: mean_lm_loss(model, input_ids, skip_plan(model, l), micro_batch_size) - base for l in layers}


# -- usefulness (linear replacement) ----------------------------------------------------------
@torch.no_grad()
def layer_io(model, input_ids, layer: int, micro_batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, outputs) rows [N', d] of block `layer` in the intact model (HC: one row per stream)."""
    ids = _check_ids(model, input_ids)
    xs, ys = [], []
    for batch in micro_batches(ids, micro_batch_size):
        states = model.run_states(batch, stop=layer + 1)
        xs.append(_wide(block_output(model, states[layer])).flatten(0, 1))
        ys.append(_wide(block_output(model, states[layer + 1])).flatten(0, 1))
    return torch.cat(xs), torch.cat(ys)


def fit_affine(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fit_linear_mapping`: least squares [x, 1] @ [W; b] ≈ y; (W [d,d], b [d]) in x's dtype.

    Solved in float64 on the CPU with the SVD driver (gelsd: the minimum-norm solution), where
    DepthBench calls float32 `lstsq`: block 0's inputs are embeddings, as many distinct rows as distinct
    tokens, so the system is often rank-deficient, and float32's solution then changed from call to call
    (a loss ratio by ~4e-4 in the issue's runs). The float64 minimum-norm fit gives the same W every call."""
    a = torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1).to("cpu", torch.float64)
    params = torch.linalg.lstsq(a, y.to("cpu", torch.float64), driver="gelsd").solution.to(x.device, x.dtype)
    return params[:-1], params[-1]


def affine_block(model, W: torch.Tensor, b: torch.Tensor) -> Callable:
    """The replacement State -> State: x @ W + b on the block input (HC: on every stream alike)."""
    def apply(state):
        return (state.to(W.dtype) @ W + b).to(state.dtype)
    return apply


def usefulness_score(model, input_ids, micro_batch_size: int = 2, threshold: float = 1.1) -> dict:
    """`compute_usefulness_score.py`: replace block l by the affine map fitted from its inputs to its
    outputs; loss_ratio = L_linear / L; a layer is significant if loss_ratio > threshold (1.1);
    global_usefulness_score = significant fraction. HC: one d×d map shared by the folded streams."""
    check_defined(model, "usefulness_score")
    L = model.n_layer
    base = mean_loss_per_sequence(model, input_ids, micro_batch_size=micro_batch_size)
    layers = {}
    for layer in range(L):
        W, b = fit_affine(*layer_io(model, input_ids, layer, micro_batch_size))
        plan = Plan(replace={layer: affine_block(model, W, b)})
        loss = mean_loss_per_sequence(model, input_ids, plan, micro_batch_size)
        ratio = loss / base if base > 0 else math.inf
        layers[layer] = {"loss_increase": loss - base, "loss_ratio": ratio, "linear_loss": loss,
                         "significant_increase": bool(ratio > threshold)}
    n_sig = sum(v["significant_increase"] for v in layers.values())
    return {"baseline_loss": base, "layer_metrics": layers, "global_usefulness_score": n_sig / L,
            "num_significant_layers": n_sig,
            "mean_loss_increase": float(np.mean([v["loss_increase"] for v in layers.values()])),
            "mean_loss_ratio": float(np.mean([v["loss_ratio"] for v in layers.values()]))}


# -- token collapse ---------------------------------------------------------------------------
def sval_metrics(H: torch.Tensor) -> dict[str, float]:
    """`compute_sval_metrics`: stable rank, entropy effective rank and ‖s‖₁/‖s‖₂ of an uncentred H [T,D]."""
    s = torch.linalg.svdvals(_wide(H))
    s2 = s ** 2
    total = s2.sum()
    if total < 1e-12:
        return {"stable_rank": 1.0, "erank": 1.0, "l1_l2_ratio": 1.0}
    p = (s2 / total).clamp(min=1e-12)
    return {"stable_rank": float(total / s2[0]), "erank": float(torch.exp(-(p * p.log()).sum())),
            "l1_l2_ratio": float(s.sum() / total.sqrt())}


@torch.no_grad()
def token_collapse(model, input_ids, micro_batch_size: int = 4) -> dict[str, np.ndarray]:
    """`compute_token_collapse.py`: per depth state (z_0..z_L, block outputs), the mean over sequences of
    each sequence's T×D token matrix metrics (HC: each stream of each sequence is one matrix)."""
    check_defined(model, "token_collapse")
    ids = _check_ids(model, input_ids)
    per_layer: list[dict[str, list[float]]] | None = None
    for batch in micro_batches(ids, micro_batch_size):
        outs = [block_output(model, z) for z in model.run_states(batch)]
        per_layer = per_layer or [{k: [] for k in ("stable_rank", "erank", "l1_l2_ratio")} for _ in outs]
        for acc, out in zip(per_layer, outs):
            for H in out:
                if H.shape[0] < 2:
                    continue
                for k, v in sval_metrics(H).items():
                    acc[k].append(v)
    return {k: np.array([np.mean(acc[k]) if acc[k] else math.nan for acc in per_layer])
            for k in ("stable_rank", "erank", "l1_l2_ratio")}


# -- Jacobian ---------------------------------------------------------------------------------
def _with_input(model, state, x: torch.Tensor):
    """`state` with the block's first input (what DepthBench differentiates) replaced by x (HC: the folded
    streams unfolded; AttnRes: its running sum or newest source); the scheme's `depthbench_with_input`."""
    family(model)
    return model.scheme.depthbench_with_input(state, x)


def mean_block_jacobian(model, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, int]:
    """(Σ over positions of the position-mean Jacobian, positions) for one micro-batch: column k is the mean
    over input positions of the gradient of Σ_positions y[..., k] (cross-position terms included, as the
    all-positions cotangent of `compute_mean_layer_jacobian` gives). One forward, d backward passes over
    its retained graph."""
    with torch.no_grad():
        state = model.run_states(ids, stop=layer)[layer]
    x0 = block_output(model, state).detach()
    d, cols, x, y = x0.shape[-1], [], None, None
    with torch.enable_grad():
        for k in range(d):
            if y is None:
                x = x0.clone().requires_grad_(True)
                y = block_output(model, model.block_step(layer, _with_input(model, state, x)))
            cot = torch.zeros_like(y)
            cot[..., k] = 1.0
            (g,) = torch.autograd.grad(y, x, cot, retain_graph=k < d - 1)
            cols.append(_wide(g).mean(dim=(0, 1)).detach().cpu())
    n = x0.shape[0] * x0.shape[1]
    return torch.stack(cols, dim=1) * n, n


def jacobian_norms(model, input_ids, micro_batch_size: int = 2) -> list[float]:
    """`compute_jacobian.py` / `compute_jacobian_fast.py`: per block ‖mean_t J − I‖_F / √d."""
    check_defined(model, "jacobian")
    ids = _check_ids(model, input_ids)
    norms = []
    for layer in range(model.n_layer):
        total, count = None, 0
        for batch in micro_batches(ids, micro_batch_size):
            s, n = mean_block_jacobian(model, batch, layer)
            total, count = (s if total is None else total + s), count + n
        J = total / count
        norms.append(float(torch.linalg.matrix_norm(J - torch.eye(J.shape[0], dtype=J.dtype)) / math.sqrt(J.shape[0])))
    return norms


# -- logit lens -------------------------------------------------------------------------------
def lens_logits(model, state) -> torch.Tensor:
    """[B,T,V] `compute_logit_lens.py` decodes at a depth: head(Norm(r_l)), the model's head on the state.
    HC/mHC whose head norms every stream before the sum (readout "normed_sum", the depthbench profile's
    HC head) are the exception: the lens still decodes Norm(Σ_s H_s), so at l = L it is not the model's
    output (kl_to_final > 0 there, as in DepthBench). The scheme's `depthbench_lens_logits`."""
    family(model)
    return model.scheme.depthbench_lens_logits(model, state)


@torch.no_grad()
def logit_lens(model, input_ids, micro_batch_size: int = 4, top_k: int = 5) -> tuple[float, list[dict]]:
    """`compute_logit_lens.py`: per depth state, early_exit_ce, kl_to_final = KL(p_final ‖ p_l) and
    top5_overlap = |top5(p_l) ∩ top5(p_final)|/5, averaged over all next-token positions."""
    check_defined(model, "logit_lens")
    ids = _check_ids(model, input_ids)
    L = model.n_layer
    sums, final_sum, n_tok = np.zeros((L + 1, 3)), 0.0, 0
    for batch in micro_batches(ids, micro_batch_size):
        states = model.run_states(batch)
        final = model.head(states[-1])
        s, n = next_token_loss_sum(final, batch)
        final_sum, n_tok = final_sum + s, n_tok + n
        targets = batch[:, 1:].reshape(-1)
        flp = F.log_softmax(_wide(final[:, :-1]), dim=-1).flatten(0, 1)
        ftop = flp.topk(top_k, dim=-1).indices
        for l, z in enumerate(states):
            lp = F.log_softmax(_wide(lens_logits(model, z)[:, :-1]), dim=-1).flatten(0, 1)
            top = lp.topk(top_k, dim=-1).indices
            sums[l, 0] += F.nll_loss(lp, targets, reduction="sum").item()
            sums[l, 1] += (flp.exp() * (flp - lp)).sum().item()
            sums[l, 2] += ((top.unsqueeze(-1) == ftop.unsqueeze(-2)).any(-1).double().sum(-1) / top_k).sum().item()
    means = sums / n_tok
    rows = [{"layer": l, "early_exit_ce": m[0], "kl_to_final": m[1], "top5_overlap": m[2]} for l, m in enumerate(means)]
    return final_sum / n_tok, rows


# -- the whole set as one tidy table ----------------------------------------------------------
# (C901 exempt: one pass per DepthBench script, in its order; docs/depthbench.md)
def depthbench_metrics(model, input_ids, metrics: tuple[str, ...] | list[str] | None = None,  # noqa: C901
                       micro_batch_size: int = 4) -> pd.DataFrame:
    """Tidy table (metric, layer, layer_j, value, protocol="depthbench") of DepthBench's metrics, under
    DepthBench's result names. `metrics` None = every metric DepthBench defines for this architecture;
    naming an undefined one is a one-line error."""
    if metrics is None:
        metrics = [m for m in METRICS if m not in undefined(model)]
    for m in metrics:
        check_defined(model, m)
    L, rows = model.n_layer, []

    def add(metric, value, layer=None, layer_j=None):
        rows.append({"metric": metric, "layer": layer, "layer_j": layer_j, "value": float(value)})

    if "angular_distance" in metrics:
        for i, j, v in upper_triangle(angular_distance(model, input_ids, micro_batch_size)):
            add("angular_distance", v, i, j)
    if "causal_score" in metrics:
        C = causal_score(model, input_ids, micro_batch_size)
        for i, j, v in upper_triangle(C):
            add("causal_score", v, i, j)
        summ = causal_summary(C)
        add("mean_causal_score", summ["mean_causal_score"])
        add("max_causal_score", summ["max_causal_score"])
        for rank, (i, j, v) in enumerate(summ["top_causal_scores"]):
            add(f"top_causal_score_{rank + 1}", v, i, j)
    if "permutation_score" in metrics:
        base, scores = permutation_score(model, input_ids, micro_batch_size=micro_batch_size)
        for (i, j), v in scores.items():
            add("permutation_score", v, i, j)
        summ = permutation_summary(scores, L)
        add("mean_permutation_score", summ["mean_permutation_score"])
        for l, v in enumerate(summ["layer_mean_permutation_scores"]):
            add("layer_mean_permutation_score", v, l)
    if "layer_pruning" in metrics:
        base, deltas = layer_pruning(model, input_ids, micro_batch_size=micro_batch_size)
        add("lm_loss", base)
        for l, v in deltas.items():
            add("layer_pruning_delta", v, l)
    if "usefulness_score" in metrics:
        res = usefulness_score(model, input_ids, micro_batch_size=min(2, micro_batch_size))
        for l, m in res["layer_metrics"].items():
            add("usefulness_loss_ratio", m["loss_ratio"], l)
        add("global_usefulness_score", res["global_usefulness_score"])
    if "token_collapse" in metrics:
        for k, values in token_collapse(model, input_ids, micro_batch_size).items():
            for l, v in enumerate(values):
                add(k, v, l)
    if "jacobian" in metrics:
        for l, v in enumerate(jacobian_norms(model, input_ids, min(2, micro_batch_size))):
            add("jacobian_norm", v, l)
    if "logit_lens" in metrics:
        final, lens_rows = logit_lens(model, input_ids, micro_batch_size)
        add("final_loss", final)
        for r in lens_rows:
            for k in ("early_exit_ce", "kl_to_final", "top5_overlap"):
                add(k, r[k], r["layer"])
    df = pd.DataFrame(rows, columns=["metric", "layer", "layer_j", "value"])
    df["protocol"] = "depthbench"
    df["arch"], df["n_layer"], df["d_model"] = model.config.arch, L, model.config.d_model
    df["seq_len"], df["n_sequences"] = int(input_ids.shape[1]), int(input_ids.shape[0])
    return df


# -- checkpoints: DepthBench's windows, saved beside the checkpoint ---------------------------
def parse_metrics(metrics: str | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """'a,b' or a list -> validated metric names (None = every metric DepthBench defines for the model)."""
    if metrics is None or metrics == "":
        return None
    names = [m.strip() for m in metrics.split(",")] if isinstance(metrics, str) else list(metrics)
    bad = [m for m in names if m not in METRICS]
    if bad:
        raise DepthToolsError(f"unknown DepthBench metric {bad[0]!r}; valid: {', '.join(METRICS)}")
    return names


def depthbench_checkpoint(ckpt_dir, data=None, n_tokens: int = 16 * SEQ_LEN, seq_len: int | None = None,
                          split: str = "val", seed: int = 0, metrics=None, micro_batch_size: int = 4,
                          device: str = "cpu", save: bool = True, model=None) -> pd.DataFrame:
    """DepthBench's metrics for one checkpoint on ceil(n_tokens/seq_len) seeded windows of `seq_len` tokens
    (default: DepthBench's 512, or the model's context if shorter), every position scored. Saved as
    `analysis/depthbench.parquet` with its settings. A family or metric DepthBench does not define is a
    one-line DepthToolsError."""
    names = parse_metrics(metrics)
    # The windows (data folder, tokenizer, split length, context, vocabulary) are checked against config.json
    # before the weights are read: a refusal that needs no model never waits for one to load.
    context, vocab, label = config_limits(ckpt_dir)
    seq_len = min(SEQ_LEN, context) if seq_len is None else seq_len
    if not 2 <= seq_len <= context:
        raise DepthToolsError(f"--seq-len for --protocol depthbench must lie in 2..{context} (the model's context), "
                              f"got {seq_len}")
    ids = eval_tokens(ckpt_dir, data, n_tokens, seq_len - 1, split, seed)  # [N, seq_len]: targets inside
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:  # the vocabulary check of tokens.check_token_set
        raise DepthToolsError(f"token ids {int(ids.min())}..{int(ids.max())} do not fit the vocabulary 0..{vocab - 1} "
                              f"of {label} (wrong tokenizer or data dir?)")
    model = model if model is not None else load(ckpt_dir, device=device)
    for m in names or []:
        check_defined(model, m)
    family(model)
    df = depthbench_metrics(model, ids, names, micro_batch_size)
    for key, value in model_columns(model).items():
        df[key] = value
    df.attrs["notes"] = ([] if seq_len == SEQ_LEN else [
        f"windows of {seq_len} tokens (DepthBench: {SEQ_LEN}; the model's context is {context})"]) + list(
        getattr(ids, "notes", []))  # a split shorter than the tokens asked: resampled, said (tokens.split_note)
    if save:
        args = {"protocol": "depthbench", "metrics": names, "micro_batch_size": micro_batch_size, "seq_len": seq_len}
        save_table(df, ckpt_dir, "depthbench", table_settings("depthbench", args, model, ids))
    return df
