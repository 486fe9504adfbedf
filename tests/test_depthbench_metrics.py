"""DepthBench's metrics (depthtools.analysis.depthbench) against slow references written from its scripts'
formulas: plain loops over the model's blocks, its hooks and tokens, in float64, never depthtools.analysis.

The references read DepthBench's depth states from hooks (block inputs/outputs, AttnRes's mixed branch input
hook_attn_in and the final norm's input), skip a block by calling the scheme's skip with DepthBench's rule
named explicitly, and swap two blocks by exchanging their weights in a copy of the model (DepthBench's
`swap_blocks`), so a wrong rule, state or formula in the module fails here.
"""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from depthtools.analysis import depthbench as db
from depthtools.errors import DepthToolsError

from tiny_models import one_thread, tiny, windows  # noqa: F401  (one_thread: autouse fixture)

N_LAYER = 3
TOL = 1e-6
FAMILY_ARCHS = ("preln", "lns", "hc", "mhc", "attnres", "blockattnres", "moda")  # residual x2, hyper x2, attnres x2, moda
ATTNRES_ARCHS = ("attnres", "blockattnres")  # blockattnres at L=3: S = 2 by default, every attention a boundary
RULE = {"preln": "identity", "lns": "identity", "deepnorm": "identity", "hc": "identity", "mhc": "identity",
        "attnres": "depthbench", "blockattnres": "depthbench", "moda": "zero"}


@pytest.fixture(autouse=True)
def no_autograd():
    """The references are plain loops over the models' weights: no autograd graph, so no scalar read warns."""
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def models():
    return {arch: tiny(arch, n_layer=N_LAYER) for arch in FAMILY_ARCHS}


@pytest.fixture(scope="module")
def ids():
    return windows(3, 7)  # [N, T] windows, targets inside the window (DepthBench's convention)


# -- reference machinery ---------------------------------------------------------------------------
@torch.no_grad()
def manual_run(model, ids, skip=None, replace=None):
    """z_0..z_L by a plain loop over blocks: skip (DepthBench's rule) or replace one position."""
    state = model.embed(ids)
    states = [state]
    for p in range(model.n_layer):
        if p == skip:
            state = model.scheme.skip(p, state, RULE[model.config.arch])
        elif replace is not None and p in replace:
            state = replace[p](state)
        else:
            state = model.block_step(p, state)
        states.append(state)
    return states


def hooked(model, fn, names):
    """Run fn() with forward hooks storing the named hook points' tensors (and the final norm's input)."""
    got = {}

    def store(t, hook):
        got[hook.name] = t.detach().clone()

    def pre(_mod, args):
        got["ln_final_in"] = args[0].detach().clone()

    h = model.ln_final.register_forward_pre_hook(pre)
    try:
        with model.hooks(fwd_hooks=[(n, store) for n in names]):
            out = fn()
    finally:
        h.remove()
    return out, got


def probe_states_ref(model, ids, skip=None):
    """DepthBench's forward_depth_states z_0..z_L: block outputs (HC: streams concatenated to n·d);
    AttnRes: the embedding, block l's mixed attention input (hook_attn_in) and the final norm's input."""
    arch, L = model.config.arch, model.n_layer
    if arch in ATTNRES_ARCHS:
        assert model.scheme.block_size <= 2  # every attention a boundary: z_l = block l's input mix
        names = [f"blocks.{l}.hook_attn_in" for l in range(L)] + ["hook_embed"]
        _, got = hooked(model, lambda: model.head(manual_run(model, ids, skip=skip)[-1]), names)
        z = [got["hook_embed"]] + [got.get(f"blocks.{l}.hook_attn_in") for l in range(1, L)] + [got["ln_final_in"]]
        if skip is not None and skip >= 1:  # the skipped block still forms its own input mix (intact prefix)
            z[skip] = probe_states_ref(model, ids)[skip]
        return z
    states = manual_run(model, ids, skip=skip)
    if arch in ("hc", "mhc"):
        return [s.reshape(*s.shape[:2], -1) for s in states]
    return [s.h if arch == "moda" else s for s in states]


def ce_sum(logits, ids):
    """Summed next-token CE by a loop over positions."""
    total = 0.0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            lp = torch.log_softmax(logits[b, t], -1)
            total -= float(lp[ids[b, t + 1]])
    return total, ids.shape[0] * (ids.shape[1] - 1)


def token_mean_loss(model, ids, **run):
    logits = model.head(manual_run(model, ids, **run)[-1])
    s, n = ce_sum(logits, ids)
    return s / n


def weight_swapped(model, i, j):
    """A copy with blocks i and j's learned weights exchanged (DepthBench's swap_blocks): every same-shaped
    tensor of the two blocks; LNS's position scalar travels; AttnRes: the mixers that consume each block's
    output travel (its own attention-side mixer stays)."""
    twin = copy.deepcopy(model)
    bi, bj = twin.blocks[i], twin.blocks[j]
    si, sj = bi.state_dict(), bj.state_dict()
    with torch.no_grad():
        for name, ti in si.items():
            tj = sj.get(name)
            if tj is not None and tj.shape == ti.shape:
                tmp = ti.clone()
                ti.copy_(tj)
                tj.copy_(tmp)
        if model.config.arch == "lns":
            bi.index, bj.index = bj.index, bi.index
        if model.config.arch in ATTNRES_ARCHS:
            L = model.n_layer
            mixer = lambda b: twin.scheme.final_res if b == L - 1 else twin.scheme.attn_res[b]  # noqa: E731
            for pi, pj in zip(mixer(i).parameters(), mixer(j).parameters()):
                tmp = pi.clone()
                pi.copy_(pj)
                pj.copy_(tmp)
    return twin


# -- angular distance ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_angular_distance(models, ids, arch):
    model = models[arch]
    z = [s.double() for s in probe_states_ref(model, ids)]
    n = len(z)
    ref = np.full((n, n), np.nan)
    for i in range(n):
        for j in range(i + 1, n):
            angles = []
            for b in range(ids.shape[0]):
                for t in range(ids.shape[1]):
                    u, v = z[i][b, t], z[j][b, t]
                    c = float((u @ v / (u.norm() * v.norm())).detach())
                    angles.append(math.acos(max(-1.0, min(1.0, c))) / math.pi)
            ref[i, j] = np.mean(angles)
    got = db.angular_distance(model, ids, micro_batch_size=2)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    assert np.isnan(got[np.tril_indices(n)]).all()


# -- causal score ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_causal_score(models, ids, arch):
    model, L = models[arch], N_LAYER
    base = probe_states_ref(model, ids)
    ref = np.full((L, L), np.nan)
    for s in range(L - 1):
        sk = probe_states_ref(model, ids, skip=s)
        for l in range(s + 1, L):
            ratios = []
            for b in range(ids.shape[0]):
                for t in range(ids.shape[1]):
                    u = base[l + 1][b, t] - base[l][b, t]
                    v = sk[l + 1][b, t] - sk[l][b, t]
                    ratios.append(float((v - u).norm() / max(float(u.norm()), 1e-8)))
            ref[s, l] = np.mean(ratios)
    got = db.causal_score(model, ids, micro_batch_size=2)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    summary = db.causal_summary(got, top_k=2)
    upper = ref[np.triu_indices(L, 1)]
    upper = upper[np.isfinite(upper)]
    assert summary["mean_causal_score"] == pytest.approx(upper.mean(), abs=TOL)
    assert summary["max_causal_score"] == pytest.approx(upper.max(), abs=TOL)
    assert [v for _, _, v in summary["top_causal_scores"]] == pytest.approx(sorted(upper)[::-1][:2], abs=TOL)


def test_attnres_next_output_rule(models, ids):
    """DepthBench's AttnRes skip: the mix after a skipped block is the identity on the newest source
    (block s-1's MLP output; the embedding when s = 0)."""
    model = models["attnres"]
    names = [f"blocks.{l}.hook_mlp_out" for l in range(N_LAYER)] + ["hook_embed"]
    _, intact = hooked(model, lambda: model.run(ids), names)
    for s in range(N_LAYER):
        z = probe_states_ref(model, ids, skip=s)
        newest = intact["hook_embed"] if s == 0 else intact[f"blocks.{s - 1}.hook_mlp_out"]
        torch.testing.assert_close(z[s + 1], newest, atol=1e-12, rtol=0)


# -- permutation score and pruning ----------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_permutation_score_all_pairs(models, ids, arch):
    model, L = models[arch], N_LAYER
    base = token_mean_loss(model, ids)
    ref = {(i, j): abs(token_mean_loss(weight_swapped(model, i, j), ids) - base) / base
           for i in range(L) for j in range(i + 1, L)}
    got_base, got = db.permutation_score(model, ids, micro_batch_size=2)
    assert got_base == pytest.approx(base, abs=TOL)
    assert sorted(got) == sorted(ref)  # all pairs, not adjacent ones
    for pair in ref:
        assert got[pair] == pytest.approx(ref[pair], abs=TOL), pair
    summary = db.permutation_summary(got, L)
    assert summary["mean_permutation_score"] == pytest.approx(np.mean(list(ref.values())), abs=TOL)
    assert summary["layer_mean_permutation_scores"][0] == pytest.approx(np.mean([ref[(0, 1)], ref[(0, 2)]]), abs=TOL)


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_layer_pruning(models, ids, arch):
    model = models[arch]
    base = token_mean_loss(model, ids)
    got_base, deltas = db.layer_pruning(model, ids, micro_batch_size=2)
    assert got_base == pytest.approx(base, abs=TOL)
    for l in range(N_LAYER):
        assert deltas[l] == pytest.approx(token_mean_loss(model, ids, skip=l) - base, abs=TOL)


# -- usefulness -------------------------------------------------------------------------------------
def block_io_hooks(model, ids, l):
    """Block l's input and output from hooks: resid_pre/post (residual) or streams_pre/post (HC)."""
    hc = model.config.arch in ("hc", "mhc")
    pre, post = (f"blocks.{l}.hook_streams_pre", f"blocks.{l}.hook_streams_post") if hc else \
        (f"blocks.{l}.hook_resid_pre", f"blocks.{l}.hook_resid_post")
    _, got = hooked(model, lambda: model.run(ids), [pre, post])
    return got[pre], got[post]


@pytest.mark.parametrize("arch", ["preln", "hc"])
def test_usefulness_score(models, ids, arch):
    model, mb = models[arch], 2
    batches = [ids[i:i + mb] for i in range(0, ids.shape[0], mb)]

    def seq_mean_loss(**run):  # per-micro-batch mean, weighted by sequences (compute_mean_loss)
        total = 0.0
        for batch in batches:
            s, n = ce_sum(model.head(manual_run(model, batch, **run)[-1]), batch)
            total += s / n * batch.shape[0]
        return total / ids.shape[0]

    base = seq_mean_loss()
    res = db.usefulness_score(model, ids, micro_batch_size=mb)
    assert res["baseline_loss"] == pytest.approx(base, abs=TOL)
    sig = 0
    for l in range(N_LAYER):
        xs, ys = zip(*(block_io_hooks(model, batch, l) for batch in batches))
        X = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).numpy()  # one row per (token, stream)
        Y = torch.cat([y.reshape(-1, y.shape[-1]) for y in ys]).numpy()
        P = np.linalg.lstsq(np.hstack([X, np.ones((len(X), 1))]), Y, rcond=None)[0]
        W, b = torch.from_numpy(P[:-1]), torch.from_numpy(P[-1])
        loss = seq_mean_loss(replace={l: lambda s: s @ W + b})
        ratio = loss / base
        sig += ratio > 1.1
        assert res["layer_metrics"][l]["loss_ratio"] == pytest.approx(ratio, abs=TOL)
        assert res["layer_metrics"][l]["significant_increase"] == (ratio > 1.1)
    assert res["global_usefulness_score"] == sig / N_LAYER


def test_usefulness_threshold_counts_layers(models, ids):
    """The 1.1 rule: the global score is the fraction of layers above the threshold (a threshold below every
    ratio counts them all, one above none)."""
    res_lo = db.usefulness_score(models["preln"], ids, threshold=0.0)
    res_hi = db.usefulness_score(models["preln"], ids, threshold=1e9)
    assert (res_lo["global_usefulness_score"], res_hi["global_usefulness_score"]) == (1.0, 0.0)


# -- token collapse -------------------------------------------------------------------------------------
def block_outputs_ref(model, ids):
    """The older scripts' hidden states from hooks: embedding, then each block's returned tensor (HC: each
    stream a sequence of its own; AttnRes: the MLP output the block returns)."""
    arch, L = model.config.arch, model.n_layer
    name = {"hc": "hook_streams_post", "mhc": "hook_streams_post", "attnres": "hook_mlp_out"}.get(arch, "hook_resid_post")
    if arch == "blockattnres":  # S = 2: the running sum a block returns is its attention + MLP outputs
        assert model.scheme.block_size == 2
        attn = [f"blocks.{l}.hook_attn_out" for l in range(L)]
        _, got = hooked(model, lambda: model.run(ids), ["hook_embed", *attn, *(a.replace("attn", "mlp") for a in attn)])
        return [got["hook_embed"]] + [got[a] + got[a.replace("attn", "mlp")] for a in attn]
    names = ["hook_embed"] + [f"blocks.{l}.{name}" for l in range(L)]
    _, got = hooked(model, lambda: model.run(ids), names)
    outs = [got[n] for n in names]
    if arch in ("hc", "mhc"):
        n = model.scheme.n
        outs[0] = outs[0].unsqueeze(-2).expand(*outs[0].shape[:2], n, outs[0].shape[-1])
        outs = [o.movedim(-2, 1).reshape(-1, *o.shape[1:2], o.shape[-1]) for o in outs]
    return outs


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_token_collapse(models, ids, arch):
    model = models[arch]
    got = db.token_collapse(model, ids, micro_batch_size=2)
    for l, out in enumerate(block_outputs_ref(model, ids)):
        per = {"stable_rank": [], "erank": [], "l1_l2_ratio": []}
        for H in out.numpy():
            s = np.linalg.svd(H, compute_uv=False)
            s2 = s ** 2
            p = np.clip(s2 / s2.sum(), 1e-12, None)
            per["stable_rank"].append(s2.sum() / s2.max())
            per["erank"].append(math.exp(-(p * np.log(p)).sum()))
            per["l1_l2_ratio"].append(s.sum() / math.sqrt(s2.sum()))
        for k, v in per.items():
            assert got[k][l] == pytest.approx(np.mean(v), abs=TOL), (k, l)


# -- Jacobian ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["preln", "hc", "attnres", "blockattnres"])
def test_jacobian_norm(models, ids, arch):
    model = models[arch]
    small = ids[:2, :5]
    d = model.config.d_model
    got = db.jacobian_norms(model, small, micro_batch_size=2)
    for l in range(N_LAYER):
        state = manual_run(model, small)[l]
        if arch in ATTNRES_ARCHS:
            # the reference differentiates the plain-autograd path (option fused=False, same weights): the
            # fused bank's gradients are wrong on a second backward through a retained graph
            plain = tiny(arch, n_layer=N_LAYER, fused=False)
            plain.load_state_dict(model.state_dict())
            state = manual_run(plain, small)[l]
            x0 = state.partial if state.partial is not None else state.sources[-1]

            def f(x, state=state, l=l):
                s = dataclasses.replace(state, partial=x, bank=None, handle=None) if state.partial is not None \
                    else dataclasses.replace(state, sources=(x,), bank=None, handle=None)
                return plain.block_step(l, s).partial
        else:
            x0 = state

            def f(x, l=l):
                return model.block_step(l, x)
        J = torch.autograd.functional.jacobian(f, x0.detach())  # [*out, *in]
        out_shape = x0.shape
        J = J.reshape(-1, d, *out_shape)  # [(out positions), k, *in]
        J = J.sum(0)  # Σ over output positions (and streams): [k, *in]
        J = J.reshape(d, -1, d).mean(1)  # mean over input positions (and streams): [k, i]
        ref = float(torch.linalg.matrix_norm(J.T - torch.eye(d, dtype=J.dtype)) / math.sqrt(d))
        assert got[l] == pytest.approx(ref, abs=TOL), l


# -- logit lens -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_logit_lens(models, ids, arch):
    model = models[arch]
    states = manual_run(model, ids)
    final = model.head(states[-1])
    rows = []
    for z in states:
        logits = model.head(z)
        ce = kl = ov = 0.0
        for b in range(ids.shape[0]):
            for t in range(ids.shape[1] - 1):
                lp, flp = torch.log_softmax(logits[b, t], -1), torch.log_softmax(final[b, t], -1)
                ce -= float(lp[ids[b, t + 1]])
                kl += float((flp.exp() * (flp - lp)).sum())
                ov += len(set(lp.topk(5).indices.tolist()) & set(flp.topk(5).indices.tolist())) / 5
        n = ids.shape[0] * (ids.shape[1] - 1)
        rows.append((ce / n, kl / n, ov / n))
    final_loss, got = db.logit_lens(model, ids, micro_batch_size=2)
    assert final_loss == pytest.approx(rows[-1][0], abs=TOL)
    for r, g in zip(rows, got):
        assert (g["early_exit_ce"], g["kl_to_final"], g["top5_overlap"]) == pytest.approx(r, abs=TOL)
    assert got[-1]["kl_to_final"] == pytest.approx(0.0, abs=1e-9) and got[-1]["top5_overlap"] == 1.0


def test_block_attnres_states_inside_a_block_are_the_running_sum():
    """Block AttnRes with S = 4 (boundaries at blocks 0 and 2): z_1 is not a boundary, so DepthBench's probe
    state is the block's returned running sum (attention + MLP outputs of block 0); z_2 is block 2's input mix."""
    model = tiny("blockattnres", n_layer=3, attnres_block_size=4)
    ids = windows(2, 6)
    names = ["blocks.0.hook_attn_out", "blocks.0.hook_mlp_out", "blocks.2.hook_attn_in"]
    _, got = hooked(model, lambda: model.run(ids), names)
    z = db.probe_states(model, ids)
    torch.testing.assert_close(z[1], got["blocks.0.hook_attn_out"] + got["blocks.0.hook_mlp_out"], atol=1e-12, rtol=0)
    torch.testing.assert_close(z[2], got["blocks.2.hook_attn_in"], atol=1e-12, rtol=0)


def test_attnres_lens_reads_the_next_mix(models, ids):
    """DepthBench's AttnRes lens decodes the next consumer's mix: z_l's logits = final norm + head of block l's
    hook_attn_in."""
    model = models["attnres"]
    _, got = hooked(model, lambda: model.run(ids), [f"blocks.{l}.hook_attn_in" for l in range(N_LAYER)])
    for l, z in enumerate(manual_run(model, ids)[:N_LAYER]):
        torch.testing.assert_close(model.head(z), model.unembed(model.ln_final(got[f"blocks.{l}.hook_attn_in"])))


# -- undefined combinations and the tidy table -----------------------------------------------------
@pytest.mark.parametrize("arch,metric,words", [
    ("attnres", "usefulness_score", "attnres"), ("moda", "usefulness_score", "moda"), ("moda", "jacobian", "moda"),
    ("denseformer", "causal_score", "denseformer"), ("blockattnres", "usefulness_score", "blockattnres")])
def test_undefined_is_one_line_error(arch, metric, words):
    model = tiny(arch, n_layer=2)
    with pytest.raises(DepthToolsError) as err:
        db.check_defined(model, metric)
    message = str(err.value)
    assert "\n" not in message and words in message and ("depthbench" in message.lower() or metric in message)
    if arch in ("attnres", "blockattnres", "moda"):
        assert metric in message


def test_table_names_and_defaults(models, ids):
    df = db.depthbench_metrics(models["attnres"], ids, micro_batch_size=2)
    assert set(df.protocol) == {"depthbench"}
    names = set(df.metric)
    assert {"mean_causal_score", "max_causal_score", "top_causal_score_1", "mean_permutation_score",
            "layer_pruning_delta", "erank", "jacobian_norm", "kl_to_final"} <= names
    assert "global_usefulness_score" not in names  # undefined for AttnRes: left out by default
    assert (df.metric == "permutation_score").sum() == N_LAYER * (N_LAYER - 1) // 2


# -- the CLI: --protocol depthbench -----------------------------------------------------------------
def _cell(tmp_path, data_dir, arch):
    from depthtools import checkpoint as ck
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    model = DepthModel(ModelConfig(arch=arch, vocab_size=256, d_model=16, n_layer=2, n_heads=2, max_seq_len=24), seed=0)
    directory = tmp_path / "grid" / f"{arch}_L2"
    ck.save(model, directory, extra={"data": {"path": str(data_dir)}})
    return directory


def test_cli_protocol_depthbench(tmp_path, data_dir):
    from typer.testing import CliRunner

    from cli.main import app
    from depthtools.analysis.tables import load_table

    runner = CliRunner()
    cell = _cell(tmp_path, data_dir, "attnres")
    args = ["--ckpt", str(cell), "--n-tokens", "48", "--batch-size", "2"]
    res = runner.invoke(app, ["analyze", "--protocol", "depthbench", "--only", "causal_score,layer_pruning", *args])
    assert res.exit_code == 0, res.output
    df = load_table(cell, "depthbench")
    assert set(df.metric) >= {"causal_score", "mean_causal_score", "layer_pruning_delta"} and df.seq_len.iloc[0] == 24
    # a metric DepthBench does not define for the architecture: one line naming both, exit 2
    res = runner.invoke(app, ["depthbench", "--metrics", "usefulness_score", *args])
    assert res.exit_code == 2 and "usefulness_score" in res.output and "attnres" in res.output
    dense = _cell(tmp_path, data_dir, "denseformer")
    res = runner.invoke(app, ["analyze", "--protocol", "depthbench", "--ckpt", str(dense), "--n-tokens", "48"])
    assert res.exit_code == 2 and "denseformer" in res.output and "depthbench" in res.output


@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_logit_lens_of_a_normed_sum_head_decodes_the_norm_of_the_stream_sum(ids, arch):
    """Issue 43: under readout "normed_sum" (the depthbench profile's HC head: the final norm on every
    stream, then the sum) DepthBench's lens still decodes Norm(Σ_s H_s), so its last-depth KL to the
    model's output is not 0. Reference: the streams from the hooks, ln_final and unembed by hand."""
    model = tiny(arch, n_layer=N_LAYER, readout="normed_sum")
    final = model(ids)  # the model's own output: Σ_s ln_final(H_s), unembedded
    names = ["hook_embed"] + [f"blocks.{l}.hook_streams_post" for l in range(N_LAYER)]
    _, cache = model.run_with_cache(ids, names_filter=lambda name: name in names)
    n = model.scheme.opts.n_streams
    streams = [cache["hook_embed"].unsqueeze(-2).expand(*ids.shape, n, -1)] + [
        cache[f"blocks.{l}.hook_streams_post"] for l in range(N_LAYER)]
    flp = torch.log_softmax(final[:, :-1].double(), -1)
    _, got = db.logit_lens(model, ids, micro_batch_size=2)
    for l, h in enumerate(streams):
        lp = torch.log_softmax(model.unembed(model.ln_final(h.sum(-2)))[:, :-1].double(), -1)
        kl = float((flp.exp() * (flp - lp)).sum(-1).mean())
        assert got[l]["kl_to_final"] == pytest.approx(kl, abs=TOL), l
    assert got[-1]["kl_to_final"] > 1e-6  # the last depth is not the model's output under this head


def test_usefulness_fit_is_repeatable_where_block_0_is_rank_deficient():
    """Issue 43: block 0's inputs are the embeddings of a few distinct tokens (rank 8 < d + 1 = 33), where
    float32 lstsq gave another W, and another loss ratio, from call to call. The fit is now the float64
    minimum-norm solution: the same every call, and equal to pinv([x, 1]) y computed independently."""
    model = tiny("preln", n_layer=2, vocab=64).float()
    few = windows(8, 24, vocab=8)
    x, y = db.layer_io(model, few, 0)
    a = torch.cat([x, x.new_ones(x.shape[0], 1)], 1).double()
    assert int(torch.linalg.matrix_rank(a)) == 8
    ref = torch.linalg.pinv(a) @ y.double()
    fits = [db.fit_affine(*db.layer_io(model, few, 0)) for _ in range(3)]
    for W, b in fits:
        assert torch.equal(W, fits[0][0]) and torch.equal(b, fits[0][1])
        assert torch.allclose(W.double(), ref[:-1], atol=1e-5) and torch.allclose(b.double(), ref[-1], atol=1e-5)
    ratios = {db.usefulness_score(model, few)["layer_metrics"][0]["loss_ratio"] for _ in range(5)}
    assert len(ratios) == 1, ratios
