"""What a probe costs before it runs: block calls, head evaluations, forward-pass equivalents and an ETA.

A real model (30 layers, a 49k vocabulary) makes the suite's cost matter: the skip sweep, the
all-pairs swaps and the lens are each many forward passes. Every analysis is counted here in the
two units that dominate it, per batch of `batch_size` sequences:

    block calls      `model.block_step` calls (each one block over the whole batch)
    head evaluations `head`/`readout_logits`/`hidden_logits` over the whole batch (unembedding to V logits)

and converted to forward-pass equivalents: one plain forward is L block calls + 1 head, and a head
costs h blocks — measured before a run (`time_parts`: the vocabulary-chunked head with its CE, KL and
top-1, `headmetrics.row_metrics`, as the sweeps and the lens run it), or V·d / (non-embedding parameters / L)
without timing (`head_ratio`, the ratio of their matmul sizes) — so

    forward equivalents = (block calls + h · heads) / (L + h)

Per batch (L layers, prefix reuse of the sweep engine, docs/design.md §7):

    lens_logit          L blocks, L + 1 heads (one per depth); each depth's head and metrics, and the final depth's
                        (its reference), are timed as the lens runs them (`lens_seconds`), more than a sweep's h
    ablate_skip         per rule: L + Σ_l (L − l − 1) blocks, 1 + L heads
    ablate_swap         L + Σ_(i,j) (L − i) blocks over the chosen pairs, 1 + pairs heads
    ablate_mean/linear  2L + Σ_l (L − l − 1) blocks (statistics pass + sweep), 1 + L heads
    ablate_prune        at most, per rule: the removal curve + Gromov 2L + Σ_n (L − n) blocks, where the curve is
                        single-skip order L + Σ_k (L − k) (+ the skip sweep unless ablate_skip is saved or
                        planned), or with prune="greedy" Σ_k [L + (L − k)(L − k)]
    causal              L + Σ_s (L − s − 1)(1 + F) blocks, F the cuts' runs (future=True only; a cut's run reuses
                        the cached intact output of block s): F = cuts where each cut runs whole sequences, and
                        F = 1 + Σ_(c < c*) (T − c)/T block-equivalents in rows where the scheme has a suffix step
                        (`causal.suffix_support`: the largest cut c* runs whole, each smaller one its rows ≥ c;
                        those row runs cost more than their share, timed before a run: `suffix_excess`)
    sequence_profile    as one skip rule; within the suite it and ablate_skip's default rule are one sweep
                        (`sweep.shared_sweeps`): whichever runs second pays for one rule less; and after causal,
                        whichever runs first decodes causal's skip runs (`sweep.remember_hidden`): Σ_l (L − l − 1)
                        blocks fewer (`suite.causal_skips`, while they fit the shared byte budget)
    similarity          L blocks + its statistics (angular distances, spectra, token collapse, CKA), timed
                        before the run on 2 sequences and scaled (`similarity_seconds`), in block-equivalents
    routing             L blocks where the scheme has native depth routing (0 on the normalisation family), + the
                        expert routing of a mixture-of-experts model: L + Σ_(s < last MoE block) (L − s − 1)
    contrib             L blocks + its per-block statistics (timed on 2 sequences and scaled: `contrib_seconds`),
                        + L + j · probes · L block-equivalents with the Jacobian (one probe's share of a JVP
                        of the batched probes costs j blocks: 3 without timing, timed on the first 3 blocks
                        before a run: `jvp_seconds`)
    lens_tuned          steps · (L + (L + 1) h + 2 L h) for the fit + the logit-lens cost to evaluate

The counts of block calls are exact for lens, skip, swap, mean, causal and sequence_profile (tested
against a counter on `block_step`); prune is an upper bound (its greedy curve stops when ΔCE passes
tau; a plan that extends the one before it starts from that plan's state: `sweep.common_prefix`). Each
sweep's "1 +" head is its intact reference (`sweep.intact_reference`: the head, a log-softmax, probabilities and
top-1 over V, the intact metrics), which costs ~3 heads at a 49k vocabulary: when timed, the plan charges it
as `reference_seconds` measures it, once per sweep and batch (`sweep_references`). Within `analyze` (`sweep.shared_sweeps`) one intact forward per batch serves every probe while the
states fit `sweep.SHARED_STATES_BYTES`: the plan then drops the other intact passes (`sharing_states`).
Attention's T² term is in the timed block; the ETA scales the timed block and head of one
batch, so it is an estimate, not a promise.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from depthtools.analysis.ablate import chosen_pairs
from depthtools.analysis.causal import default_cuts, suffix_support
from depthtools.analysis.contrib import _capture_split, _Mean, block_deviation, block_statistics
from depthtools.analysis.geometry import CKA_VARIANTS, SimilarityStats, geometry_states, spectral_stats
from depthtools.analysis.headmetrics import LogitsBuffer, Reference, chunked_head, row_metrics
from depthtools.analysis.sweep import (
    SHARED_STATES_BYTES,
    Reference as SweepReference,
    _state_bytes,
    _Sums,
    intact_reference,
    plan_head_sums,
    scored_logprobs,
    scored_rows,
)
from depthtools.analysis.tables import model_columns
from depthtools.analysis.tokens import split_inputs

FULL_JVP_BLOCKS = 3  # a forward-mode JVP through a block ≈ 3 block forwards


@dataclass(frozen=True)
class Cost:
    """One analysis' cost on the whole token set."""

    name: str
    blocks: float     # block calls (each over one batch)
    heads: float      # head evaluations (each over one batch)
    forwards: float   # forward-pass equivalents
    upper_bound: bool = False


def head_ratio(model) -> float:
    """h: the cost of one head evaluation in blocks (V·d over the parameters of one block)."""
    counts = model.param_counts()
    per_block = max(counts["non_embedding"] / max(model.n_layer, 1), 1.0)
    return model.config.vocab_size * model.config.d_model / per_block


def _skip_blocks(L: int) -> int:
    return L + sum(L - l - 1 for l in range(L))


def _n_rules(model, args: dict[str, Any]) -> int:
    rules = args.get("rules")
    return len(rules) if rules else len(model.scheme.skip_rules)


def _routes_natively(model) -> bool:
    """Whether `routing` reads the scheme's native depth routing through a forward (HC, mHC, AttnRes hook it;
    DenseFormer's static weights are counted too, an over-count of L blocks); the normalisation family has
    none, so routing runs nothing there unless the model has experts (measured: 0.1 of a planned 0.7
    forwards at L = 12)."""
    from depthtools.arch.scheme import ResidualScheme  # lazy: arch is heavy only on first use

    return type(model.scheme).depth_routing is not ResidualScheme.depth_routing


def _cut_runs(model, args: dict[str, Any], seq_len: int) -> float:
    """The future effect's runs per skipped block, in whole-sequence runs: one per cut, or with a suffix step
    (`causal.suffix_support`) the largest cut whole and each other cut c its rows ≥ c, (T − c)/T of a run."""
    if not args.get("future", True):
        return 0.0
    cuts = list(default_cuts(seq_len) if args.get("cuts") is None else args["cuts"])
    if not cuts or suffix_support(model) is not None:
        return float(len(cuts))
    top = max(cuts)
    return 1.0 + sum((seq_len - c) / seq_len for c in cuts if c != top)


def _skip_sweeps(name: str, model, args: dict[str, Any], shared: bool) -> int:
    """Single-skip sweeps per batch of ablate_skip (one per rule) or sequence_profile (one), less the default
    rule's when an earlier analysis ran it (`shared`: `sweep.shared_sweeps`)."""
    return (_n_rules(model, args) if name == "ablate_skip" else 1) - (1 if shared else 0)


def _prune_steps(L: int, args: dict[str, Any]) -> int:
    """Removal steps of one pruning curve: L, or `max_prune_steps` when smaller."""
    return L if args.get("max_prune_steps") is None else min(L, args["max_prune_steps"])


def _prune_curve_sweeps(L: int, args: dict[str, Any], skip_measured: bool) -> int:
    """Sweeps of one rule's removal curve per batch: one per step for the greedy curve; for the single-skip order,
    the curve's, plus the single-skip sweep unless `skip_measured`."""
    return _prune_steps(L, args) if args.get("prune", "order") == "greedy" else 1 + (0 if skip_measured else 1)


def _prune_per_rule(L: int, args: dict[str, Any], skip_measured: bool) -> tuple[int, int]:
    """(block calls, heads) of one skip rule's pruning curves on one batch, at most: the removal curve
    (greedy: Σ_k [L + (L−k)²]; single-skip order: L + Σ_k (L−k), plus the single-skip sweep unless
    `skip_measured`) and Gromov's 2L + Σ_n (L−n)."""
    steps = _prune_steps(L, args)
    if args.get("prune", "order") == "greedy":
        blocks, heads = sum(L + (L - k) * (L - k) for k in range(steps)), sum(1 + L - k for k in range(steps))
    else:
        blocks, heads = L + sum(L - k for k in range(1, steps + 1)), 1 + steps
        if not skip_measured:
            blocks, heads = blocks + _skip_blocks(L), heads + 1 + L
    return blocks + 2 * L + sum(L - n for n in range(1, L)), heads + L


def per_batch(name: str, model, args: dict[str, Any], seq_len: int,
              skip_measured: bool = False, shared: bool = False, skips_run: bool = False) -> tuple[float, float, bool]:
    """(block calls, head evaluations, upper_bound) of analysis `name` on one batch of windows of
    `seq_len` model inputs (fits and fixed passes that do not repeat per batch are in `extra`).
    `skip_measured`: the single-skip sweep is already saved or planned (the order prune reuses it);
    `shared`: this analysis' default-rule skip sweep was run by an earlier one (`sweep.shared_sweeps`);
    `skips_run`: its default-rule skip plans were run by causal before it (`sweep.remember_hidden`): decoded, not
    run again."""
    L = model.n_layer
    if name == "lens_logit":
        return L, L + 1, False
    if name in ("ablate_skip", "sequence_profile"):
        rules = _skip_sweeps(name, model, args, shared)
        read = sum(L - l - 1 for l in range(L)) if skips_run and rules > 0 else 0
        return rules * _skip_blocks(L) - read, rules * (1 + L), False
    if name in ("ablate_swap", "ablate_swap_adjacent"):
        pairs = chosen_pairs(L, args.get("pairs", "adjacent"), args.get("swap_pairs_max"))
        return L + sum(L - i for i, _ in pairs), 1 + len(pairs), False
    if name in ("ablate_mean", "ablate_linear"):
        return L + _skip_blocks(L), 1 + L, False
    if name == "ablate_prune":
        blocks, heads = _prune_per_rule(L, args, skip_measured)
        rules = _n_rules(model, args)
        return rules * blocks, rules * heads, True
    if name == "causal":
        runs = _cut_runs(model, args, seq_len)
        return L + sum((L - s - 1) * (1 + runs) for s in range(L)), 0, False
    if name == "contrib":
        jac = L + FULL_JVP_BLOCKS * args.get("probes", 2) * L if args.get("jacobian", True) else 0
        return L + jac, 0, False
    if name == "routing":  # a mixture-of-experts model's intact and skip runs; a forward for native routing
        bb = getattr(model, "backbone", None)
        moe = [l for l in range(L) if bb is not None and bb.is_moe(l)]
        experts = L + sum(L - s - 1 for s in range(max(moe))) if moe else 0
        return experts + (L if _routes_natively(model) else 0), 0, False
    if name == "similarity":
        return L, 0, False
    if name == "lens_tuned":
        return L, L + 1, False
    return L, 1, True  # an analysis not modelled here: at least one forward


def extra(name: str, model, args: dict[str, Any]) -> tuple[float, float]:
    """(block calls, heads) done once, not per evaluation batch: the tuned lens' fit steps, and the
    first-sequence probe of the mean/linear statistics."""
    L = model.n_layer
    if name == "lens_tuned":
        steps = args.get("lens_steps", 250)
        return steps * L, steps * (L + 1 + 2 * L)
    if name in ("ablate_mean", "ablate_linear"):
        return L, 0
    return 0, 0


def analysis_cost(name: str, model, args: dict[str, Any], n_seqs: int, seq_len: int, batch_size: int,
                  h: float | None = None, skip_measured: bool = False, shared: bool = False,
                  skips_run: bool = False) -> Cost:
    """The cost of analysis `name` with arguments `args` on n_seqs windows of seq_len model inputs;
    `h`: a head evaluation in blocks (default `head_ratio`; `time_parts` measures it)."""
    n_batches = math.ceil(n_seqs / batch_size)
    blocks, heads, bound = per_batch(name, model, args, seq_len, skip_measured, shared, skips_run)
    once_blocks, once_heads = extra(name, model, args)
    blocks, heads = n_batches * blocks + once_blocks, n_batches * heads + once_heads
    h, L = head_ratio(model) if h is None else h, model.n_layer
    return Cost(name, blocks, heads, (blocks + h * heads) / (L + h), bound)


def intact_passes(name: str, model, args: dict[str, Any], skip_measured: bool = False, shared: bool = False) -> int:
    """Intact forwards per batch that go through `sweep.intact_states` (so within `shared_sweeps` all but
    the suite's first are read, not run): one per sweep, lens, similarity, causal, the Jacobian pass,
    Gromov's angle pass and the mean/linear statistics; at most, for the greedy prune."""
    if name in ("similarity", "causal", "lens_logit", "lens_tuned", "ablate_swap", "ablate_swap_adjacent"):
        return 1
    if name == "contrib":
        return 1 if args.get("jacobian", True) else 0
    if name in ("sequence_profile", "ablate_skip"):
        return _skip_sweeps(name, model, args, shared)
    if name in ("ablate_mean", "ablate_linear"):
        return 2
    if name == "ablate_prune":  # the curves' sweeps, Gromov's angle pass and its sweep
        return _n_rules(model, args) * (_prune_curve_sweeps(model.n_layer, args, skip_measured) + 2)
    return 0


def sweep_references(name: str, model, args: dict[str, Any], skip_measured: bool = False, shared: bool = False) -> int:
    """Sweeps per batch that compute the intact reference (`sweep.intact_reference`, one per sweep run): the skip
    sweep per rule (none for a default-rule sweep an earlier analysis ran: `shared`), swap's and mean/linear's
    sweep, and the pruning curves' (the removal curve's, the single-skip sweep unless `skip_measured`, Gromov's;
    the greedy curve: one per step). `per_batch` charges each one head; it costs ~3 (`reference_seconds`)."""
    if name in ("ablate_skip", "sequence_profile"):
        return _skip_sweeps(name, model, args, shared)
    if name in ("ablate_swap", "ablate_swap_adjacent", "ablate_mean", "ablate_linear"):
        return 1
    if name == "ablate_prune":  # the curves' sweeps and Gromov's
        return _n_rules(model, args) * (_prune_curve_sweeps(model.n_layer, args, skip_measured) + 1)
    return 0


def sharing_states(costs: list[Cost], passes: dict[str, int], L: int, n_batches: int, h: float) -> list[Cost]:
    """The costs when one intact forward per batch serves the whole run (`sweep.shared_sweeps` with the
    states in its budget): the first analysis with an intact pass keeps one, every other pass is read."""
    out, seen = [], False
    for cost in costs:
        n = passes.get(cost.name, 0)
        saved = n - (0 if seen or n == 0 else 1)
        seen = seen or n > 0
        out.append(with_blocks(cost, -saved * L * n_batches, h, L) if saved else cost)
    return out


def with_blocks(cost: Cost, blocks: float, h: float | None, L: int) -> Cost:
    """`cost` with `blocks` more block-equivalents of work (timed statistics), forwards recomputed."""
    h = 0.0 if h is None else h
    total = cost.blocks + blocks
    return Cost(cost.name, total, cost.heads, (total + h * cost.heads) / (L + h), cost.upper_bound)


def plan_cost(model, analyses: dict[str, dict[str, Any]], n_seqs: int, seq_len: int, batch_size: int,
              h: float | None = None, skip_measured: bool = False, shared: str | None = None,
              skips_from: str | None = None) -> list[Cost]:
    """Each analysis' cost with its arguments ({name: args}, as `suite.analysis_args` gives them);
    `shared`: the analysis whose default-rule skip sweep an earlier one runs (`suite.shared_sweep`);
    `skips_from`: the analysis whose default-rule skip plans causal's runs give (`suite.causal_skips`)."""
    return [analysis_cost(name, model, args, n_seqs, seq_len, batch_size, h, skip_measured, name == shared,
                          name == skips_from) for name, args in analyses.items()]


@torch.no_grad()
def time_parts(model, tokens: torch.Tensor, batch_size: int, repeats: int = 2) -> tuple[float, float]:
    """(seconds of one block call, seconds of one head evaluation with its metrics) on one batch.

    The head is timed as every sweep plan runs it on this batch (the lens times its own depths:
    `lens_seconds`): the path `headmetrics.chunked_head` picks for these rows -- while one [rows, V] block
    is small, whole logit rows with the sweep's own per-plan sums (`sweep.plan_head_sums`: CE, KL against the
    reference computed once per batch, top-1 agreement and accuracy; fused or a full log-softmax), else the
    vocabulary-chunked head (`headmetrics.row_metrics`). At a 49k vocabulary the head with its metrics costs ~9
    blocks (benchmarks/RESULTS.md, issues 38, 45 and 47), so a parameter ratio alone underestimates the sweeps.
    """
    inputs, targets = split_inputs(tokens[:batch_size])
    targets = targets.flatten()
    model.eval()
    sync = torch.cuda.synchronize if inputs.device.type == "cuda" else (lambda: None)
    head = chunked_head(model, targets.numel())  # the path the sweep takes on these rows
    t_states = t_head = math.inf
    ref = fused = None
    buffer = LogitsBuffer()  # the block a sweep decodes its plans into (the first repeat pages it in)
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        states = model.run_states(inputs)
        if ref is None:  # the reference and its probabilities: once per batch in a sweep, not per plan
            logits = model.head(states[-1])
            logp = scored_logprobs(logits).roll(1, 0)
            ref = SweepReference.of(logp) if head is None else Reference.of(logp, head=head)
            if head is None:  # the fused path's reference, also once per batch (an untimed first call)
                fused = plan_head_sums(_Sums(), logits, ref, targets, inputs.shape[0])
        sync()
        t1 = time.perf_counter()
        if head is not None:
            row_metrics(head, scored_rows(model, states[-1]), targets, ref)
        else:
            hidden = model.scheme.final_hidden(states[-1], model.ln_final)  # as `sweep.plan_hidden` yields it
            plan_head_sums(_Sums(), buffer.decode(model, hidden), ref, targets, inputs.shape[0], fused)
        sync()
        t_states, t_head = min(t_states, t1 - t0), min(t_head, time.perf_counter() - t1)
    return t_states / max(model.n_layer, 1), t_head


@torch.no_grad()
def similarity_seconds(model, tokens: torch.Tensor, batch_size: int, args: dict[str, Any],
                       sample: int = 2, repeats: int = 2) -> float:
    """Seconds of similarity's statistics (angular distances, moments, token collapse, CKA; not its
    forward passes) on the whole token set, timed on `sample` sequences and scaled: all but CKA grow
    with the sequences; CKA with its minibatches of `cka_batch` rows, each costing ∝ rows² (its Gram
    and HSIC products), counted per batch as `depth_similarity` cuts them; plus, once, the L+1
    spectra (an eigendecomposition each, twice: of the k×k covariance, or, when the whole run has no more
    rows than the width k, of the rows' n×n Gram, ∝ n²k: `geometry._Moments`; timed in the form the run takes)."""
    exclude, cka_batch = args.get("exclude_first", 1), args.get("cka_batch", 256)
    inputs = split_inputs(tokens[:sample])[0]
    states = [g[:, exclude:] for g in geometry_states(model, inputs)]
    n_sample, T = states[0].shape[0], states[0].shape[1]
    keep_rows = None if tokens.shape[0] * T <= states[0].shape[-1] else False  # the run's form (None: the default)

    stats = SimilarityStats(model.n_layer, max(n_sample * T, 8), (), args.get("seed", 0), keep_rows)

    def timed(variants) -> float:
        """Best of `repeats` (the CKA part is a difference of two timings: one slow single timing on a busy
        machine planned similarity at 7x the measured time)."""
        nonlocal stats
        best = math.inf
        for _ in range(repeats):
            stats = SimilarityStats(model.n_layer, max(n_sample * T, 8), variants, args.get("seed", 0), keep_rows)
            t0 = time.perf_counter()
            stats.add(states)
            best = min(best, time.perf_counter() - t0)
        return best

    rest = timed(())
    t0 = time.perf_counter()  # once per run: each depth's spectrum, with and without its outlier dims
    spectral_stats(stats.moments[0].spectrum())
    spectral_stats(stats.moments[0].spectrum(drop_top=max(args.get("outlier_k", 1), 1)))
    spectra = (time.perf_counter() - t0) * (model.n_layer + 1)
    if stats.moments[0].rows is not None:  # timed the sample's Gram, n_sample·T rows; the run's has N·T
        spectra *= (tokens.shape[0] / n_sample) ** 2
    chunk = max(timed(tuple(CKA_VARIANTS)) - rest, 0.0)
    n_seqs = tokens.shape[0]
    chunks = 0.0
    for lo in range(0, n_seqs, batch_size):
        rows = min(batch_size, n_seqs - lo) * T
        full, last = divmod(rows, cka_batch)
        chunks += full * (cka_batch / (n_sample * T)) ** 2 + (last >= 8) * (last / (n_sample * T)) ** 2
    return rest * n_seqs / n_sample + chunk * chunks + spectra


@torch.no_grad()
def lens_seconds(model, tokens: torch.Tensor, batch_size: int, depths: int = 4) -> tuple[float, float]:
    """(seconds of the lens' final depth, seconds of one other depth) on one batch, in the lens' chunks of rows: the
    lens' own steps (`lens.final_depth`: the final log-probs and the reference every depth is compared with;
    `lens.depth_step`: one depth's head and metrics) on its own head path. The final depth is timed once after a
    warm-up, the others (after one untimed) as a mean over depths 0..`depths`-1 (one depth's call varies ~10 %
    and the lens pays the mean). Their metrics (probabilities, top-5, two KLs, an entropy, a rank count over V) cost more than the
    sweep's that `time_parts` times with the head, and the final depth about two depths (its log-softmax and the
    reference's probabilities and top-5: ~1.7 heads in float32, ~3 in bfloat16, where the head's product is
    cheaper), so the lens is planned with these instead of h per depth."""
    from depthtools.analysis.lens import _DepthSums, _scored_rows, depth_step, final_depth  # lazy: lens imports sweep

    inputs, targets = split_inputs(tokens[:batch_size])
    targets, L, chunk = targets.flatten(), model.n_layer, 4096
    head = chunked_head(model, min(chunk, len(targets)))  # the path the lens takes on these rows
    depths = max(1, min(depths, L))
    states = model.run_states(inputs, stop=depths)  # z_depths stands in for z_L: decoding it takes the same time
    reads = _scored_rows(model, states, None)
    chunks = [(slice(lo, lo + chunk), targets[lo:lo + chunk]) for lo in range(0, len(targets), chunk)]
    finals = [final_depth(model, reads[-1][rows], None, head, tgt, _DepthSums(L + 1))[0] for rows, tgt in chunks]
    t0 = time.perf_counter()
    for rows, tgt in chunks:
        final_depth(model, reads[-1][rows], None, head, tgt, _DepthSums(L + 1))
    t_final, buffer, sums = time.perf_counter() - t0, LogitsBuffer(), _DepthSums(L + 1)
    for (rows, tgt), reference in zip(chunks, finals):  # pages the logits buffer in, as the lens' first depth does
        depth_step(model, reads[0][rows], 0, None, head, reference, tgt, sums, buffer)
    t0 = time.perf_counter()
    for depth in range(depths):
        for (rows, tgt), reference in zip(chunks, finals):
            depth_step(model, reads[depth][rows], depth, None, head, reference, tgt, sums, buffer)
    return t_final, (time.perf_counter() - t0) / depths


@torch.no_grad()
def suffix_excess(model, tokens: torch.Tensor, batch_size: int, args: dict[str, Any], blocks: int = 6,
                  repeats: int = 2) -> float:
    """Block-equivalents per skipped block and batch that causal's row runs cost beyond their share of rows: each
    cut c below the largest runs rows ≥ c, counted (T − c)/T of a block (`_cut_runs`), but each of its blocks
    still attends over all T keys and pays a fixed part, so it takes ~1.2× its share at c = 48 and ~1.4× at
    c = 80 of T = 128. Timed as causal runs them (`causal._rows_run` through the last `blocks` blocks, reading
    the largest cut's keys and values), interleaved with the same blocks on all rows, so that the ratio carries
    neither the machine's drift nor a single block's jitter; 0 where the future effect runs whole sequences or
    is off."""
    from depthtools.analysis.causal import _rows_run  # lazy: a private helper, needed only here

    if not args.get("future", True) or suffix_support(model) is not None:
        return 0.0
    inputs = split_inputs(tokens[:batch_size])[0]
    T, L = inputs.shape[1], model.n_layer
    cuts = list(default_cuts(T) if args.get("cuts") is None else args["cuts"])
    partial = [c for c in cuts if c != max(cuts, default=0)]  # the largest cut runs whole: counted exactly
    s = max(L - 1 - blocks, 0)  # the timed runs go through blocks s+1..L−1
    if not partial or L - s - 1 < 1:
        return 0.0
    first = model.run_states(inputs, stop=0)[0]  # the embeddings stand in for z_{s+1}: the time is the same
    _, caches = _rows_run(model, s, first, 0, None)  # the largest cut's run keeps every block's k, v
    pasts = {cut: [(k[:, :cut], v[:, :cut]) for k, v in caches] for cut in partial}
    whole, rows = 0.0, dict.fromkeys(partial, 0.0)
    for _ in range(repeats):
        t0 = time.perf_counter()
        _rows_run(model, s, first, 0, None)
        whole += time.perf_counter() - t0
        for cut in partial:
            t0 = time.perf_counter()
            _rows_run(model, s, first[:, cut:], cut, pasts[cut])
            rows[cut] += time.perf_counter() - t0
    return sum(rows[cut] / whole - (T - cut) / T for cut in partial) if whole > 0 else 0.0


@torch.no_grad()
def reference_seconds(model, tokens: torch.Tensor, batch_size: int) -> float:
    """Seconds of one sweep's intact reference on one batch (`sweep.intact_reference`: the head, the scored
    rows' log-softmax, probabilities and top-1, the intact metrics), timed once, as each sweep computes it once
    per batch (each time into fresh memory)."""
    inputs, targets = split_inputs(tokens[:batch_size])
    targets = targets.flatten()
    states = model.run_states(inputs, stop=0)  # the embeddings stand in for z_L: decoding them takes the same time
    head = chunked_head(model, targets.numel())  # the path the sweep takes on these rows
    t0 = time.perf_counter()
    intact_reference(model, states, targets, inputs.shape[0], head, _Sums())
    return time.perf_counter() - t0


@torch.no_grad()
def contrib_seconds(model, tokens: torch.Tensor, args: dict[str, Any], sample: int = 2, repeats: int = 2) -> float:
    """Seconds of contrib's per-block statistics (norms, cosines, the additivity check and the attention/MLP
    split: `contrib.block_statistics`, not its forward passes) on the whole token set, timed on `sample`
    sequences (best of `repeats`) and scaled by the sequences: L × ~10 passes over [B, T, d] per batch, about
    a fifth of a forward at the SmolLM-135M shape, which the block count alone left out (issue 47)."""
    inputs = split_inputs(tokens[:sample])[0]
    states, split = _capture_split(model, inputs)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        block_statistics(model, states, split, _Mean(), [True] * model.n_layer, args.get("exclude_first", 1),
                         args.get("additive_tol", 1e-4))
        best = min(best, time.perf_counter() - t0)
    return best * tokens.shape[0] / inputs.shape[0]


def jvp_seconds(model, tokens: torch.Tensor, batch_size: int, probes: int = 2, blocks: int = 3) -> float | None:
    """Seconds of one probe's share of contrib's Jacobian work per block on one batch: the probes drawn, pushed
    through the block by forward-mode AD (batched: the primal once) and reduced, as `contrib.block_deviation` runs
    them, on the first `blocks` blocks after a warm-up, the mean divided by `probes`. The plan's default
    FULL_JVP_BLOCKS = 3 is low where forward-mode AD takes the explicit attention path. A mean over several
    blocks, not the best of repeats on one: one call varies by ±20 % at the SmolLM-135M shape (175-264 ms) and
    contrib pays the mean (a best-of-2 left its ETA ~7 % low). None when the state is not one `contrib.block_map`
    handles (contrib then runs no JVP)."""
    inputs = split_inputs(tokens[:batch_size])[0]
    blocks = max(1, min(blocks, model.n_layer))
    with torch.no_grad():
        states = model.run_states(inputs, stop=blocks)
    gen, probes = torch.Generator().manual_seed(0), max(probes, 1)
    if block_deviation(model, 0, states[0], gen, 1, probes) is None:  # also the warm-up: forward AD registers
        return None  # its decompositions on first use
    t0 = time.perf_counter()
    for position in range(blocks):
        block_deviation(model, position, states[position], gen, 1, probes)
    return (time.perf_counter() - t0) / blocks / probes


def duration(seconds: float) -> str:
    """3 s, 4 min 10 s, 2 h 05 min."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def plan_line(model, costs: list[Cost], n_batches: int, forward_s: float) -> str:
    """ONE line: what runs, its forward-pass equivalents, and the ETA from a timed forward pass
    (`forward_s`: one forward of one batch, L blocks + a head with its metrics)."""
    parts = [f"{c.name} {'≤' if c.upper_bound else ''}{c.forwards:.0f}" for c in costs]
    total = sum(c.forwards for c in costs)
    eta = total * forward_s  # forward equivalents are counted in forwards of one batch
    bound = "≤" if any(c.upper_bound for c in costs) else "~"

    return (f"plan {model_columns(model)['model']} (L={model.n_layer}, {n_batches} batch(es)): "
            f"{', '.join(parts)} forward-pass equivalents; total {total:.0f}, ETA {bound}{duration(eta)} "
            f"({forward_s * 1000:.0f} ms per forward of one batch)")


def describe(model, analyses: dict[str, dict[str, Any]], tokens: torch.Tensor,
             batch_size: int, skip_measured: bool = False, shared: str | None = None) -> tuple[str, list[Cost]]:
    """The plan line of running `analyses` ({name: args}) on `tokens` [N, T+1] (times one forward pass)."""
    line, costs, _ = describe_timed(model, analyses, tokens, batch_size, skip_measured, shared)
    return line, costs


def forward_seconds(model, tokens: torch.Tensor, batch_size: int) -> float:
    """One forward of one batch as the plan counts it: L timed blocks + the timed head with its metrics."""
    t_block, t_head = time_parts(model, tokens, batch_size)
    return model.n_layer * t_block + t_head


def retime_note(model, tokens: torch.Tensor, batch_size: int, name: str, seconds: float, planned: float,
                forward_s: float, remaining: float, drift: float = 0.2) -> str | None:
    """After the first analysis of a run: None when it took within `drift` of its plan (`planned` forward
    equivalents × `forward_s`); else one batch is re-timed and one line gives the corrected ETA of the
    `remaining` forward equivalents (a machine that got busier or idler since the plan was timed)."""
    expected = planned * forward_s
    if expected <= 0 or abs(seconds / expected - 1) <= drift:
        return None
    now = forward_seconds(model, tokens, batch_size)
    return (f"re-timed after {name}: it took {duration(seconds)} against {duration(expected)} planned "
            f"({seconds / expected:.2f}x); one forward of one batch now {now * 1000:.0f} ms (plan: "
            f"{forward_s * 1000:.0f} ms); corrected ETA of the rest ~{duration(remaining * now)}")


def states_fit(model, tokens: torch.Tensor, skips: bool = False) -> bool:
    """Whether the intact states of the whole token set fit `sweep.SHARED_STATES_BYTES` (measured on one
    window: tensor states only), so that `shared_sweeps` keeps every batch's; with `skips`, also the final
    hidden states of causal's L skip runs per window (`sweep.remember_hidden`), which share that budget."""
    states = model.run_states(split_inputs(tokens[:1])[0])
    size = _state_bytes(states)
    if size is not None and skips:
        hidden = model.scheme.final_hidden(states[-1], model.ln_final)
        size += model.n_layer * hidden.numel() * hidden.element_size()
    return size is not None and size * tokens.shape[0] <= SHARED_STATES_BYTES


def timed_extra(model, analyses: dict[str, dict[str, Any]], tokens: torch.Tensor, batch_size: int, t_block: float,
                t_head: float, skip_measured: bool = False, shared: str | None = None) -> dict[str, float]:
    """{analysis: block-equivalents to add to its counted cost} from what is timed before a run, where the
    counts of blocks and heads leave work out: similarity's and contrib's statistics, contrib's JVPs beyond
    FULL_JVP_BLOCKS, the lens' depths and final depth beyond a head each, causal's row runs beyond their share
    of rows, and each sweep's intact reference beyond a head."""
    L, n_batches, extra = model.n_layer, math.ceil(tokens.shape[0] / batch_size), {}
    if "similarity" in analyses:
        extra["similarity"] = similarity_seconds(model, tokens, batch_size, analyses["similarity"]) / t_block
    if "contrib" in analyses:
        extra["contrib"] = contrib_seconds(model, tokens, analyses["contrib"]) / t_block
        if analyses["contrib"].get("jacobian", True):
            probes = analyses["contrib"].get("probes", 2)
            jvp_s = jvp_seconds(model, tokens, batch_size, probes=probes)
            extra["contrib"] += 0.0 if jvp_s is None else (jvp_s / t_block - FULL_JVP_BLOCKS) * probes * L * n_batches
    if "lens_logit" in analyses:
        t_final, per_depth = lens_seconds(model, tokens, batch_size)
        extra["lens_logit"] = (t_final - t_head + (per_depth - t_head) * L) / t_block * n_batches
    if "causal" in analyses:
        excess = suffix_excess(model, tokens, batch_size, analyses["causal"])
        extra["causal"] = excess * sum(L - s - 1 for s in range(L)) * n_batches
    refs = {name: sweep_references(name, model, args, skip_measured, name == shared) for name, args in analyses.items()}
    if any(refs.values()):
        per_ref = (reference_seconds(model, tokens, batch_size) - t_head) / t_block * n_batches
        extra.update({name: per_ref * n for name, n in refs.items() if n})
    return extra


def describe_timed(model, analyses: dict[str, dict[str, Any]], tokens: torch.Tensor, batch_size: int,
                   skip_measured: bool = False, shared: str | None = None,
                   shared_states: bool = False, skips_from: str | None = None) -> tuple[str, list[Cost], float]:
    """`describe`, and the timed seconds of one forward of one batch (the unit of the ETA).
    `shared_states`: the run shares each batch's intact states (`sharing_states`) when they fit; `skips_from`:
    the analysis that decodes causal's skip runs (`suite.causal_skips`), when they fit with the states."""
    n_seqs, seq_len = tokens.shape[0], tokens.shape[1] - 1
    t_block, t_head = time_parts(model, tokens, batch_size)
    h = t_head / t_block if t_block > 0 else None
    if skips_from is not None and not (shared_states and states_fit(model, tokens, skips=True)):
        skips_from = None
    costs = plan_cost(model, analyses, n_seqs, seq_len, batch_size, h=h, skip_measured=skip_measured, shared=shared,
                      skips_from=skips_from)
    if t_block > 0:
        extra = timed_extra(model, analyses, tokens, batch_size, t_block, t_head, skip_measured, shared)
        costs = [with_blocks(c, extra[c.name], h, model.n_layer) if extra.get(c.name) else c for c in costs]
    if shared_states and h is not None and states_fit(model, tokens):
        passes = {name: intact_passes(name, model, args, skip_measured, name == shared)
                  for name, args in analyses.items()}
        costs = sharing_states(costs, passes, model.n_layer, math.ceil(n_seqs / batch_size), h)
    forward_s = model.n_layer * t_block + t_head
    return plan_line(model, costs, math.ceil(n_seqs / batch_size), forward_s), costs, forward_s
