"""Logit lens and tuned lens at every depth 0..L (docs/reference/metrics.md §1), chunked over tokens and depths.

Logit lens at depth l: p_l = softmax(unembed(final_hidden(z_l))), the model's own head (`model.head`,
docs/design.md §3) on the state at depth l: ln_final(readout(z_l)) for every scheme but HC/mHC with
readout "normed_sum" (DepthBench's head), where it is Σ_s ln_final(H_s) — that head has no single vector
before the final norm. Tuned lens: p_l = softmax(unembed(ln_final(T_l(readout(z_l))))), with T_l a trained
affine translator; it needs readout(z_l), so it refuses "normed_sum" (`check_tuned_lens`). At l = L the
lens is the model's own output, so KL = 0 and agreement = 1 there (tested per architecture).

Per-depth metrics (mean over scored tokens, position 0 excluded; nats):
    ce              next-token cross-entropy of the lens
    kl_final_lens   KL(p_L || p_l): the tuned-lens paper's direction (final output as the reference)
    kl_lens_final   KL(p_l || p_L): the reverse direction, as in Csordás et al.'s logit-lens code
    entropy         entropy of p_l
    top1_agree      1[argmax p_l = argmax p_L]
    top5_overlap    |top5(p_l) ∩ top5(p_L)| / 5
    target_rank     1-based rank of the target token under p_l (1 = top prediction)

Memory: one batch of sequences at a time; within it, rows (tokens) are processed `chunk_tokens` at a
time and depths one after another, so at most two [chunk_tokens, V] log-prob blocks exist at once —
never [depths, tokens, vocab] (benchmarks/bench_lens_memory.py). Where one [chunk_tokens, V] float32 block
exceeds `headmetrics.FULL_HEAD_BYTES` (or with chunked_head=True) the depths below L are decoded over
vocabulary chunks instead (`headmetrics.row_metrics`): only the final output's block (the reference) is whole.
Otherwise each depth's float32 logits on CPU go through the fused row metrics (`headmetrics.fused_metrics`, a C
kernel: two passes per row instead of ~10 torch passes over [rows, V]), elsewhere a full log-softmax
(`depth_step`).

Tuned lens (Belrose et al. 2023): per depth l < L a residual affine translator h + A_l h + b_l
(A, b zero-initialised, so the untrained tuned lens is the logit lens) applied to readout(z_l);
ln_final and unembed stay frozen; trained with AdamW to minimise KL(p_L || p_l), one depth's loss
backpropagated at a time. Saved as `<ckpt>/analysis/tuned_lens.safetensors` + `tuned_lens.json`
(settings) and reused when the settings, the training tokens and the model weights match.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from depthtools.analysis.headmetrics import (
    Head,
    LogitsBuffer,
    Reference,
    RowMetrics,
    chunked_head as chunked_head_for,
    fused_metrics,
    fused_usable,
    row_metrics,
)
from depthtools.analysis.sweep import intact_states
from depthtools.analysis.tables import ANALYSIS_DIR, model_columns, normalise_settings
from depthtools.analysis.tokens import FIRST_SCORED, batches, check_tokens, split_inputs, token_fingerprint
from depthtools.checkpoint import atomic_save_tensors, atomic_write_json
from depthtools.errors import DepthToolsError

TUNED_LENS_FILE = "tuned_lens"
LENS_METRICS = ("ce", "kl_final_lens", "kl_lens_final", "entropy", "top1_agree", "top5_overlap", "target_rank")


# -- translators ---------------------------------------------------------------------------------
class TunedLens(nn.Module):
    """One residual affine translator per depth 0..L-1: h -> h + A_l h + b_l (identity at depth L)."""

    def __init__(self, n_layer: int, d_model: int):
        super().__init__()
        self.n_layer, self.d_model = n_layer, d_model
        self.weight = nn.Parameter(torch.zeros(n_layer, d_model, d_model))  # A_l [d_out, d_in]
        self.bias = nn.Parameter(torch.zeros(n_layer, d_model))

    def forward(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """Translate readouts h [..., d] taken at `depth`; computed in h's dtype."""
        if depth >= self.n_layer:
            return h
        return h + F.linear(h, self.weight[depth].to(h.dtype), self.bias[depth].to(h.dtype))


def check_tuned_lens(model) -> None:
    """Refuse, in one line, a tuned lens on a model whose head has no vector before the final norm (the scheme's
    `no_readout`, e.g. HC/mHC readout "normed_sum"; its translators act on readout(z_l)); the logit lens runs on
    such a model."""
    missing = model.scheme.no_readout()
    if missing is not None:
        what, head = missing
        raise DepthToolsError(
            f"the tuned lens needs one vector before the final norm to translate, but {model_columns(model)['model']} "
            f"({what}) {head}; run the logit lens (lens without --tuned)")


def _lens_logits(model, rows: torch.Tensor, depth: int, translators: TunedLens | None,
                 buffer: LogitsBuffer | None = None) -> torch.Tensor:
    """[n,d] rows at `depth` -> [n,V] logits, float32 at least. Logit lens: rows are final_hidden(z_l),
    unembedded (and soft-capped where the model's logits are), into `buffer` where given (the logits then
    alias it). Tuned lens: rows are readout(z_l), through the translator, ln_final and unembed."""
    if translators is None:
        logits = model.hidden_logits(rows) if buffer is None else buffer.decode(model, rows)
    else:
        logits = model.readout_logits(translators(rows, depth))  # ln_final, unembed (and a final soft-cap)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _lens_logprobs(model, rows: torch.Tensor, depth: int, translators: TunedLens | None) -> torch.Tensor:
    """[n,d] rows at `depth` -> [n,V] float32 (or wider) log-probs (`_lens_logits`, log-softmaxed)."""
    return F.log_softmax(_lens_logits(model, rows, depth, translators), dim=-1)


def _scored_rows(model, states: list, translators: TunedLens | None) -> list[torch.Tensor]:
    """What each depth's lens decodes, at the scored positions flattened to [B·(T-1), d]: the logit lens
    final_hidden(z_l) (what the model's own head unembeds), the tuned lens readout(z_l)."""
    def read(state) -> torch.Tensor:
        return model.scheme.final_hidden(state, model.ln_final) if translators is None else model.readout(state)

    return [read(s)[:, FIRST_SCORED:].flatten(0, 1) for s in states]


# -- the lens pass -------------------------------------------------------------------------------
@dataclass(frozen=True)
class FinalRows:
    """The final output's log-probs on one row chunk with what every depth compares against (its
    probabilities and top-5 ids), computed once per chunk rather than once per depth (issue 47)."""

    logp: torch.Tensor  # [n, V]
    p: torch.Tensor  # [n, V]
    top5: torch.Tensor  # [n, min(5, V)]

    ref: Reference | None = None  # the same, as the chunked head's reference (`headmetrics`)

    @classmethod
    def of(cls, logp: torch.Tensor, head: Head | None = None) -> "FinalRows":
        """The final rows of float32 log-probs; `ref` for the chunked `head`, or for the fused row metrics
        where they take these rows (float32 CPU)."""
        top5 = logp.topk(min(5, logp.shape[-1]), dim=-1).indices
        p = logp.exp()
        fused = head is None and fused_usable(logp, top5.shape[-1])
        ref = Reference.of(logp, head=head, p=p, top=top5, sums=not fused) if head is not None or fused else None
        return cls(logp, p, top5, ref)


class _DepthSums:
    """float64 sums of the per-token lens metrics at every depth."""

    def __init__(self, n_depths: int):
        self.sums = np.zeros((n_depths, len(LENS_METRICS)))
        self.n = 0

    def add(self, depth: int, lp: torch.Tensor, final: "FinalRows", targets: torch.Tensor) -> torch.Tensor:
        """Accumulate one depth from its full [n, V] log-probs on one row chunk; returns the top-1 ids [n].
        (The final depth, and models without the chunked head; the other depths go through `add_rows`.)"""
        p = lp.exp()
        final, p_final, top5_final = final.logp, final.p, final.top5
        target_lp = lp.gather(-1, targets.unsqueeze(-1))
        top5 = lp.topk(top5_final.shape[-1], dim=-1).indices
        top1 = top5[:, 0]
        values = (
            -target_lp.squeeze(-1),
            (p_final * (final - lp)).sum(-1),
            (p * (lp - final)).sum(-1),
            -(p * lp).sum(-1),
            (top1 == top5_final[:, 0]).to(lp.dtype),
            (top5.unsqueeze(-1) == top5_final.unsqueeze(-2)).any(-1).sum(-1).to(lp.dtype) / 5,
            (lp > target_lp).sum(-1).to(lp.dtype) + 1,
        )
        for j, value in enumerate(values):
            self.sums[depth, j] += float(value.double().sum())
        return top1

    def add_rows(self, depth: int, m: RowMetrics, final: "FinalRows") -> torch.Tensor:
        """Accumulate one depth from the chunked head's per-row metrics (`headmetrics.row_metrics`, with the
        final output as the reference); returns the top-1 ids [n]."""
        top5_final = final.top5
        values = (
            m.ce, m.kl_ref, m.kl_rev, m.entropy,
            (m.top[:, 0] == top5_final[:, 0]).double(),
            (m.top.unsqueeze(-1) == top5_final.unsqueeze(-2)).any(-1).sum(-1).double() / 5,
            m.rank.double(),
        )
        for j, value in enumerate(values):
            self.sums[depth, j] += float(value.sum())
        return m.top[:, 0]


def final_step(logits: torch.Tensor, logp: torch.Tensor, reference: FinalRows, targets: torch.Tensor,
               sums: "_DepthSums", L: int) -> torch.Tensor:
    """Add depth L (the model's own output, its own reference) to `sums`; returns its top-1 ids. Where the
    fused row metrics take its logits, CE, entropy and rank come from them and the comparisons with itself
    are exact (KL 0, agreement 1, its top-5 the reference's): no second pass over its [n, V] log-probs."""
    if reference.ref is None or not fused_usable(logits, reference.top5.shape[-1]):
        return sums.add(L, logp, reference, targets)
    m = fused_metrics(logits, targets, k=reference.top5.shape[-1], rank=True)
    zero = torch.zeros_like(m.ce)
    return sums.add_rows(L, RowMetrics(m.lse, m.ce, m.entropy, zero, zero, reference.top5, m.rank), reference)


def final_depth(model, rows: torch.Tensor, translators: TunedLens | None, head: Head | None, targets: torch.Tensor,
                sums: "_DepthSums") -> tuple[FinalRows, torch.Tensor, torch.Tensor]:
    """Depth L on one row chunk [n, d]: the model's own log-probs, the reference every other depth is compared with
    (`FinalRows`) and its metrics added to `sums`; returns (reference, top-1 ids [n], float64 per-token loss [n]).
    Once per chunk, yet ~2 depths' work (the log-softmax, the reference's probabilities and top-5 over V), so
    `cost.lens_seconds` times it beside the depths."""
    L = model.n_layer
    logits = _lens_logits(model, rows, L, translators)
    logp = F.log_softmax(logits, dim=-1)
    reference = FinalRows.of(logp, head)
    top1 = final_step(logits, logp, reference, targets, sums, L)
    return reference, top1, (-logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).double()


def depth_step(model, rows: torch.Tensor, depth: int, translators: TunedLens | None, head: Head | None,
               reference: FinalRows, targets: torch.Tensor, sums: "_DepthSums",
               buffer: LogitsBuffer | None = None) -> torch.Tensor:
    """Decode one depth's rows [n, d] and add its metrics to `sums`; returns the top-1 ids [n]. Three paths, one
    set of numbers: the vocabulary-chunked head (`head`, for blocks above `headmetrics.FULL_HEAD_BYTES`), the
    fused row metrics of whole float32 logit rows on CPU (`headmetrics.fused_metrics`: two passes per row
    instead of ~10 torch passes over [n, V]), else the full log-softmax (`_DepthSums.add`). `buffer`: the
    `headmetrics.LogitsBuffer` the depths are decoded into, one after the other. (Also what
    `cost.lens_seconds` times.)"""
    k = reference.top5.shape[-1]
    if head is not None:
        m = row_metrics(head, _depth_rows(model, rows, depth, translators), targets, reference.ref, k=k, rank=True,
                        reverse=True)
        return sums.add_rows(depth, m, reference)
    logits = _lens_logits(model, rows, depth, translators, buffer)
    if reference.ref is not None and fused_usable(logits, k):
        return sums.add_rows(depth, fused_metrics(logits, targets, reference.ref, k=k, rank=True, reverse=True),
                             reference)
    return sums.add(depth, F.log_softmax(logits, dim=-1), reference, targets)


def _depth_rows(model, rows: torch.Tensor, depth: int, translators: TunedLens | None) -> torch.Tensor:
    """What the unembedding reads at `depth`: the logit lens' final-hidden rows as they are, the tuned
    lens' readouts through the translator and ln_final."""
    return rows if translators is None else model.ln_final(translators(rows, depth))


@dataclass
class LensResult:
    """A lens pass: per-depth metrics, a one-row summary, and per-token prediction depth and loss."""

    depths: pd.DataFrame
    summary: pd.DataFrame
    prediction_depth: np.ndarray  # [n_tokens] int, 0..L
    token_loss: np.ndarray  # [n_tokens] final CE per token
    tokens: pd.DataFrame | None = None  # per token: model columns, lens, token, prediction_depth, loss


def prediction_depths(top1: torch.Tensor) -> torch.Tensor:
    """Per token, the first depth from which the lens top-1 equals the final top-1 at every later depth.

    top1: [L+1, n] lens top-1 ids by depth (row L = the final prediction). Returns [n] in 0..L.
    """
    agrees = (top1 == top1[-1]).to(torch.int64)
    stable_tail = agrees.flip(0).cumprod(0).sum(0)  # length of the all-agreeing suffix (>= 1)
    return top1.shape[0] - stable_tail


@torch.no_grad()
def lens_analysis(
    model,
    tokens: torch.Tensor,
    translators: TunedLens | None = None,
    batch_size: int = 8,
    chunk_tokens: int = 4096,
    progress: Callable[[float], None] | None = None,
    chunked_head: bool | None = None,
) -> LensResult:
    """Logit lens (translators=None) or tuned lens at every depth 0..L on a token set [N, T+1].
    chunked_head: depths 0..L−1 through the vocabulary-chunked head (`headmetrics`: True), or full [rows, V]
    log-probs per depth (False); None: the full path while its block fits `headmetrics.FULL_HEAD_BYTES`."""
    tokens = check_tokens(model, tokens)
    if translators is not None:
        check_tuned_lens(model)
    if chunk_tokens < 1:
        raise DepthToolsError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    model.eval()
    L = model.n_layer
    sums, top1_all, loss_all, buffer = _DepthSums(L + 1), [], [], LogitsBuffer()
    head = chunked_head_for(model, min(chunk_tokens, batch_size * max(tokens.shape[1] - 2, 1)), chunked_head)
    n_batches = -(-tokens.shape[0] // batch_size)
    for batch in batches(tokens, batch_size):
        inputs, targets = split_inputs(batch)
        targets = targets.flatten()
        reads = _scored_rows(model, intact_states(model, inputs), translators)
        for lo in range(0, targets.numel(), chunk_tokens):
            rows, tgt = slice(lo, lo + chunk_tokens), targets[lo:lo + chunk_tokens]
            top1 = torch.empty(L + 1, tgt.numel(), dtype=torch.long, device=tgt.device)
            reference, top1[L], loss = final_depth(model, reads[L][rows], translators, head, tgt, sums)
            for depth in range(L):
                top1[depth] = depth_step(model, reads[depth][rows], depth, translators, head, reference, tgt, sums,
                                         buffer)
            top1_all.append(top1.cpu())
            loss_all.append(loss.cpu())
            sums.n += tgt.numel()
        if progress is not None:
            progress(1.0 / n_batches)
    pd_tokens = prediction_depths(torch.cat(top1_all, dim=1)).numpy()
    token_loss = torch.cat(loss_all).numpy()
    kind = "logit" if translators is None else "tuned"
    depths = _depth_frame(model, kind, sums)
    summary = _summary_frame(model, kind, depths, pd_tokens, token_loss)
    tokens_frame = pd.DataFrame({**model_columns(model), "lens": kind, "token": np.arange(len(pd_tokens)),
                                 "prediction_depth": pd_tokens, "loss": token_loss})
    return LensResult(depths, summary, pd_tokens, token_loss, tokens_frame)


def _depth_frame(model, kind: str, sums: _DepthSums) -> pd.DataFrame:
    L = model.n_layer
    means = sums.sums / max(sums.n, 1)
    rows = [
        {**model_columns(model), "lens": kind, "depth": depth, "rel_depth": depth / L,
         **dict(zip(LENS_METRICS, means[depth])), "n_tokens": sums.n}
        for depth in range(L + 1)
    ]
    return pd.DataFrame(rows)


def lens_progress(ce: np.ndarray) -> tuple[float, float]:
    """(centre of mass / L, effective contributing layers N_lens) of the lens CE decrease (§1.4)."""
    gains = np.clip(ce[:-1] - ce[1:], 0, None)  # g_l = CE_{l-1} - CE_l for l = 1..L
    if gains.sum() <= 0:
        return float("nan"), float("nan")
    pi = gains / gains.sum()
    layers = np.arange(1, len(ce))
    nz = pi[pi > 0]
    return float((layers * pi).sum() / (len(ce) - 1)), float(np.exp(-(nz * np.log(nz)).sum()))


def _summary_frame(model, kind: str, depths: pd.DataFrame, pd_tokens: np.ndarray, loss: np.ndarray) -> pd.DataFrame:
    from scipy.stats import spearmanr  # heavy, one path: scipy (~1.5 s) for the rank correlation only

    L = model.n_layer
    if len(pd_tokens) > 1 and np.ptp(pd_tokens) > 0 and np.ptp(loss) > 0:
        rho = float(spearmanr(pd_tokens, loss).statistic)
    else:
        rho = float("nan")  # undefined for a constant sequence
    com, n_lens = lens_progress(depths["ce"].to_numpy())
    return pd.DataFrame([{
        **model_columns(model), "lens": kind, "pd_mean": float(pd_tokens.mean()),
        "pd_mean_over_L": float(pd_tokens.mean()) / L, "pd_loss_spearman": rho,
        "ce_final": float(depths["ce"].iloc[-1]), "progress_com": com, "n_lens": n_lens,
        "n_lens_over_L": n_lens / L, "n_tokens": len(pd_tokens),
    }])


def logit_lens(model, tokens: torch.Tensor, translators: TunedLens | None = None, **kwargs) -> pd.DataFrame:
    """Per-depth lens table (one row per depth 0..L); see the module docstring for the columns."""
    return lens_analysis(model, tokens, translators, **kwargs).depths


def prediction_depth(model, tokens: torch.Tensor, translators: TunedLens | None = None, **kwargs) -> pd.DataFrame:
    """One-row summary: mean prediction depth (and / L), its Spearman correlation with per-token loss,
    and the lens-progress centre of mass and N_lens."""
    return lens_analysis(model, tokens, translators, **kwargs).summary


# -- training the tuned lens ---------------------------------------------------------------------
@contextmanager
def frozen(model):
    """Temporarily stop gradients into the model's own parameters."""
    flags = [p.requires_grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        yield model
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)


def train_tuned_lens(
    model,
    tokens: torch.Tensor,
    steps: int = 250,
    lr: float = 1e-3,
    batch_size: int = 8,
    weight_decay: float = 1e-3,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
) -> TunedLens:
    """Fit translators on a training token set [N, T+1] to minimise KL(p_L || p_l) at every depth.

    AdamW, linear LR decay to 0, gradient-norm clip 1.0, fp32 translator parameters; each depth's
    loss is backpropagated on its own so only one [rows, V] graph is alive at a time.
    """
    tokens = check_tokens(model, tokens)
    check_tuned_lens(model)
    if steps < 1:
        raise DepthToolsError(f"tuned-lens steps must be >= 1, got {steps}")
    model.eval()
    L = model.n_layer
    device = tokens.device
    lens = TunedLens(L, model.config.d_model).to(device)
    opt = torch.optim.AdamW(lens.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
    gen = torch.Generator().manual_seed(seed)
    with frozen(model):
        for _ in range(steps):
            batch = tokens[torch.randint(tokens.shape[0], (min(batch_size, tokens.shape[0]),), generator=gen)]
            with torch.no_grad():
                reads = _scored_rows(model, intact_states(model, split_inputs(batch)[0]), lens)
                target = _lens_logprobs(model, reads[L], L, lens)  # the identity at depth L: the model's output
            opt.zero_grad(set_to_none=True)
            for depth in range(L):
                lp = _lens_logprobs(model, reads[depth], depth, lens)
                (target.exp() * (target - lp)).sum(-1).mean().backward()
            nn.utils.clip_grad_norm_(lens.parameters(), 1.0)
            opt.step()
            sched.step()
            if progress is not None:
                progress(1.0)
    return lens.eval()


def model_fingerprint(model) -> str:
    """A content hash of the model's weights and config (a retrained checkpoint invalidates its lens)."""
    digest = hashlib.sha256(model.config.to_json().encode())
    streamed = getattr(model, "streamed_weights", None)  # a streamed model: read one tensor at a time, hashed once
    key = (model.config.to_json(), tuple(sorted({str(p.dtype) for p in model.parameters()})))  # per dtype
    if streamed is not None and key in streamed.fingerprints:
        return streamed.fingerprints[key]
    state = streamed or model.state_dict()
    for name in sorted(state):
        tensor = state[name]
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy: the buffer
    if streamed is not None:
        streamed.fingerprints[key] = digest.hexdigest()[:16]
    return digest.hexdigest()[:16]


def tuned_lens_paths(ckpt_dir: str | Path) -> tuple[Path, Path]:
    folder = Path(ckpt_dir) / ANALYSIS_DIR
    return folder / f"{TUNED_LENS_FILE}.safetensors", folder / f"{TUNED_LENS_FILE}.json"


def save_tuned_lens(lens: TunedLens, ckpt_dir: str | Path, settings: dict[str, Any]) -> Path:
    """Write the translators (safetensors) and their settings (JSON) beside the checkpoint."""
    weights, meta = tuned_lens_paths(ckpt_dir)
    atomic_save_tensors(weights, {"weight": lens.weight, "bias": lens.bias})
    atomic_write_json(meta, {"settings": normalise_settings(settings), "n_layer": lens.n_layer,
                             "d_model": lens.d_model})
    return weights


def load_tuned_lens(ckpt_dir: str | Path, settings: dict[str, Any] | None = None) -> TunedLens | None:
    """Saved translators, or None if absent, unreadable, or trained with different settings."""
    weights, meta_path = tuned_lens_paths(ckpt_dir)
    if not (weights.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if settings is not None and meta.get("settings") != normalise_settings(settings):
            return None
        tensors = load_file(str(weights))
        lens = TunedLens(int(meta["n_layer"]), int(meta["d_model"]))
        lens.load_state_dict(tensors)
    except (OSError, ValueError, KeyError, RuntimeError):
        return None
    return lens.eval()


def fit_tuned_lens(
    model,
    tokens: torch.Tensor,
    ckpt_dir: str | Path | None = None,
    steps: int = 250,
    lr: float = 1e-3,
    batch_size: int = 8,
    weight_decay: float = 1e-3,
    seed: int = 0,
    reuse: bool = True,
    progress: Callable[[float], None] | None = None,
) -> TunedLens:
    """A tuned lens for `model`: loaded from `<ckpt>/analysis/` when saved with the same settings
    (steps, lr, batch, decay, seed, training-token hash, weight hash), else trained and saved there."""
    check_tuned_lens(model)
    ckpt_dir = ckpt_dir if ckpt_dir is not None else getattr(model, "checkpoint_dir", None)
    settings = {
        "objective": "kl_final_lens", "form": "h + A h + b", "optimizer": "adamw", "steps": steps, "lr": lr,
        "batch_size": batch_size, "weight_decay": weight_decay, "seed": seed,
        "tokens": token_fingerprint(tokens), "tokens_shape": list(tokens.shape), "model": model_fingerprint(model),
    }
    if ckpt_dir is not None and reuse:
        lens = load_tuned_lens(ckpt_dir, settings)
        if lens is not None:
            return lens.to(next(model.parameters()).device)
    lens = train_tuned_lens(model, tokens, steps, lr, batch_size, weight_decay, seed, progress)
    if ckpt_dir is not None:
        save_tuned_lens(lens, ckpt_dir, settings)
    return lens
