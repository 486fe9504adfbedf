"""Full / Block AttnRes: init equivalence, paper-equation references, skip and swap rules."""

import copy

import pytest
import torch

from depthtools.arch import DepthModel, Plan, get_arch
from depthtools.arch.attnres import default_block_size
from depthtools.arch.bankops import bank_logits, inv_rms, weighted_sum
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

VOCAB = 53


def config(arch: str, n_layer: int = 4, eps: float = 1e-5, **options) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=VOCAB, d_model=32, n_layer=n_layer, n_heads=4,
                       max_seq_len=16, norm_eps=eps, options=options)


def perturb(model, scale=0.3, only=None, seed=1):
    """Move parameters (optionally only those whose name contains `only`) off their init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or only in name:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def build(arch, n_layer=4, eps=1e-5, seed=0, **options) -> DepthModel:
    return DepthModel(config(arch, n_layer, eps, **options), seed=seed).double().eval()


def tokens(batch=2, length=10, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def rope(model):
    return model.rope_cos, model.rope_sin


# -- the slow references, written from the paper's equations -----------------------------------
def depth_attention(query, gamma, eps, values):
    """h = Σ_i softmax_i(w · RMSNorm_gamma(v_i)) v_i, one source at a time (no 1/sqrt(d))."""
    logits = []
    for v in values:
        key = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * gamma
        logits.append((key * query).sum(-1))
    alpha = torch.softmax(torch.stack(logits, -1), -1)
    return sum(alpha[..., i : i + 1] * v for i, v in enumerate(values))


def sublayers(model):
    """(sublayer index, block, 'attn'|'mlp', mixer or None) in depth order (intact model)."""
    scheme = model.scheme
    for b, block in enumerate(model.blocks):
        yield 2 * b, block, "attn", (None if b == 0 else scheme.attn_res[b - 1])
        yield 2 * b + 1, block, "mlp", block.mlp_res


def run_sublayer(model, block, name, h):
    if name == "attn":
        return block.attn(block.attn_norm(h), *rope(model))
    return block.mlp(block.mlp_norm(h))


def mix(model, mixer, values):
    if mixer is None:
        assert len(values) == 1
        return values[0]
    return depth_attention(mixer.query, mixer.key_norm.weight, model.config.norm_eps, values)


def reference_full_attnres(model, toks):
    """Paper Eq. 1-4: sources v_0 = embedding, v_i = raw sublayer outputs; final mix; head."""
    values = [model.tok_embed(toks)]
    for _, block, name, mixer in sublayers(model):
        values.append(run_sublayer(model, block, name, mix(model, mixer, values)))
    h = mix(model, model.scheme.final_res, values)
    return model.unembed(model.ln_final(h))


def reference_block_attnres(model, toks, block_size):
    """Paper Fig. 2 pseudocode: mix over [completed blocks] + [partial]; at a boundary the partial
    becomes a completed block (here after the mix, as in the paper — same source set)."""
    blocks, partial = [model.tok_embed(toks)], None
    for s, block, name, mixer in sublayers(model):
        values = blocks + ([partial] if partial is not None else [])
        h = mix(model, mixer, values)
        if s % block_size == 0 and partial is not None:  # block boundary: start a new block
            blocks.append(partial)
            partial = None
        out = run_sublayer(model, block, name, h)
        partial = out if partial is None else partial + out
    h = mix(model, model.scheme.final_res, blocks + [partial])
    return model.unembed(model.ln_final(h))


# -- bank operations ---------------------------------------------------------------------------
def test_bank_ops_match_autograd_and_pass_gradcheck():
    gen = torch.Generator().manual_seed(0)
    vs = tuple(torch.randn(2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(4))
    rs = tuple(inv_rms(v, 1e-5) for v in vs)
    q = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)
    w_tok = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    w_src = torch.randn(4, dtype=torch.float64, generator=gen, requires_grad=True)
    bank = torch.stack(vs)
    assert torch.allclose(bank_logits(q, vs, rs), torch.einsum("nbtd,d->btn", bank, q) * torch.stack(rs, -1))
    assert torch.allclose(weighted_sum(w_tok, vs), torch.einsum("btn,nbtd->btd", w_tok, bank))
    assert torch.allclose(weighted_sum(w_src, vs), torch.einsum("n,nbtd->btd", w_src, bank))
    assert torch.autograd.gradcheck(lambda q, *v: bank_logits(q, v, tuple(inv_rms(x, 1e-5) for x in v)), (q, *vs))
    assert torch.autograd.gradcheck(lambda w, *v: weighted_sum(w, v), (w_tok, *vs))
    assert torch.autograd.gradcheck(lambda w, *v: weighted_sum(w, v), (w_src, *vs))


# -- init equivalence --------------------------------------------------------------------------
@pytest.mark.parametrize("arch,options", [("attnres", {}), ("blockattnres", {}),
                                          ("blockattnres", {"attnres_block_size": 3})])
def test_zero_queries_equal_preln(arch, options):
    """Zero queries: uniform average = Pre-LN residual / count; the next RMSNorm is scale invariant.
    Exact except eps: RMSNorm(h/n) = h/sqrt(ms(h) + n²·eps), so eps is made negligible (1e-12)."""
    preln = build("preln", eps=1e-12)
    perturb(preln)
    model = build(arch, eps=1e-12, **options)
    missing, unexpected = model.load_state_dict(preln.state_dict(), strict=False)
    assert not unexpected and all("_res" in k for k in missing)
    perturb(model, only="key_norm")  # key gains are irrelevant while the queries are zero
    toks = tokens()
    assert torch.allclose(model(toks), preln(toks), atol=1e-9, rtol=0)
    # ... and the lens at every depth is Pre-LN's lens (next-consumer mix of the sources so far)
    for ours, theirs in zip(model.run_states(toks), preln.run_states(toks)):
        assert torch.allclose(model.head(ours), preln.head(theirs), atol=1e-9, rtol=0)
    perturb(model, only="query", scale=0.5)  # the comparison can fail
    assert not torch.allclose(model(toks), preln(toks), atol=1e-3)


def test_mask_skip_at_zero_queries_equals_preln_skip():
    preln = build("preln", eps=1e-12)
    perturb(preln)
    model = build("attnres", eps=1e-12)
    model.load_state_dict(preln.state_dict(), strict=False)
    toks = tokens()
    for position in (0, 2, 3):
        plan = Plan.skipping(position)
        ours = model.run(toks, plan=Plan.skipping(position, rule="mask"))
        assert torch.allclose(ours, preln.run(toks, plan=plan), atol=1e-9, rtol=0)


# -- reference equations -----------------------------------------------------------------------
def test_full_attnres_matches_paper_equations():
    model = build("attnres", n_layer=5)
    perturb(model)  # non-trivial queries, key gains and backbone
    toks = tokens()
    assert torch.allclose(model(toks), reference_full_attnres(model, toks), atol=1e-10)


@pytest.mark.parametrize("block_size", [2, 3, 4, 10])
def test_block_attnres_matches_paper_pseudocode(block_size):
    model = build("blockattnres", n_layer=5, attnres_block_size=block_size)
    perturb(model)
    toks = tokens()
    assert torch.allclose(model(toks), reference_block_attnres(model, toks, block_size), atol=1e-10)


def test_block_size_one_is_full_attnres():
    full = build("attnres")
    perturb(full)
    block = build("blockattnres", attnres_block_size=1)
    block.load_state_dict(full.state_dict())
    toks = tokens()
    assert torch.allclose(block(toks), full(toks), atol=1e-12)
    for a, b in zip(block.run_states(toks), full.run_states(toks)):
        assert torch.allclose(block.readout(a), full.readout(b), atol=1e-12)
    other = build("blockattnres", attnres_block_size=2)  # ... and S=2 is not
    other.load_state_dict(full.state_dict())
    assert not torch.allclose(other(toks), full(toks), atol=1e-4)


def test_block_size_default_and_validation():
    assert [default_block_size(L) for L in (4, 8, 9, 16, 32)] == [2, 2, 4, 4, 8]
    assert build("blockattnres", n_layer=32).scheme.block_size == 8  # 64 sublayers -> 8 blocks
    with pytest.raises(DepthToolsError, match="attnres_block_size"):
        build("blockattnres", attnres_block_size=0)
    with pytest.raises(DepthToolsError, match="attnres_block_size"):
        build("attnres", attnres_block_size=2)


def test_extra_params_4Ld_for_any_block_size():
    for S in (1, 3, 8):
        cfg = config("blockattnres", n_layer=6, attnres_block_size=S)
        extra = DepthModel(cfg).param_counts()["total"] - DepthModel(cfg.replace(arch="preln", options={})).param_counts()["total"]
        assert extra == get_arch("blockattnres").extra_params(cfg) == 4 * 6 * 32


# -- readout / lens ----------------------------------------------------------------------------
def test_readout_is_next_consumer_mix_and_final_query_lens():
    model = build("attnres")
    perturb(model)
    toks = tokens()
    states = model.run_states(toks)
    _, cache = model.run_with_cache(toks)
    for l in range(1, model.n_layer):  # the lens at depth l = block l's attention-side input
        assert torch.allclose(model.readout(states[l]), cache[f"blocks.{l}.hook_attn_in"], atol=1e-12)
    assert torch.equal(model.readout(states[0]), states[0].sources[0])  # z_0 = embedding
    lens = model.scheme.final_query_readout(states[model.n_layer])
    assert torch.allclose(lens, model.readout(states[-1]), atol=1e-12)
    assert not torch.allclose(model.scheme.final_query_readout(states[2]), model.readout(states[2]), atol=1e-4)


def test_states_are_immutable_under_sweeps():
    model = build("blockattnres", attnres_block_size=3)
    perturb(model)
    toks = tokens()
    states = model.run_states(toks)
    before = [model.readout(s).clone() for s in states]
    for l in range(model.n_layer):
        for rule in model.scheme.skip_rules:
            model.run(plan=Plan.skipping(l, rule=rule), start=l, from_state=states[l])
    assert all(torch.equal(model.readout(s), b) for s, b in zip(states, before))


def test_hooks_expose_depth_attention_maps():
    model = build("attnres")
    perturb(model)
    toks = tokens()
    logits, cache = model.run_with_cache(toks)
    for b in range(model.n_layer):
        attn_w = cache[f"blocks.{b}.hook_attnres_weights_attn"]
        mlp_w = cache[f"blocks.{b}.hook_attnres_weights_mlp"]
        assert attn_w.shape == (*toks.shape, 2 * b + 1) and mlp_w.shape == (*toks.shape, 2 * b + 2)
        assert torch.allclose(mlp_w.sum(-1), torch.ones_like(mlp_w[..., 0]))
        assert f"blocks.{b}.hook_mlp_in" in cache and f"blocks.{b}.hook_attn_out" in cache
    assert cache["scheme.hook_attnres_weights_final"].shape[-1] == 2 * model.n_layer + 1
    # editing the depth-attention map changes the computation
    def one_hot_newest(w, hook):
        out = torch.zeros_like(w)
        out[..., -1] = 1
        return out
    edited = model.run_with_hooks(toks, fwd_hooks=[("blocks.2.hook_attnres_weights_attn", one_hot_newest)])
    assert not torch.allclose(edited, logits)


# -- skip rules --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,options", [("attnres", {}), ("blockattnres", {"attnres_block_size": 2})])
def test_skip_rules_differ_and_are_finite(arch, options):
    model = build(arch, **options)
    perturb(model)
    toks = tokens()
    assert model.scheme.skip_rules == ("mask", "next-output", "depthbench")
    for l in range(1, model.n_layer):  # (skipping block 0 leaves one source: both rules agree)
        mask = model.run(toks, plan=Plan.skipping(l, rule="mask"))
        nxt = model.run(toks, plan=Plan.skipping(l, rule="next-output"))
        assert torch.isfinite(mask).all() and torch.isfinite(nxt).all()
        assert not torch.allclose(mask, nxt, atol=1e-6)
        assert not torch.allclose(mask, model(toks), atol=1e-6)
    assert torch.equal(model.run(toks, plan=Plan.skipping(1)), model.run(toks, plan=Plan.skipping(1, rule="mask")))
    with pytest.raises(DepthToolsError, match="skip rule"):
        model.run(toks, plan=Plan.skipping(1, rule="identity"))


@pytest.mark.parametrize("arch,options", [("attnres", {}), ("blockattnres", {"attnres_block_size": 2}),
                                          ("blockattnres", {"attnres_block_size": 4})])
def test_skip_last_block_matches_hand_computation(arch, options):
    model = build(arch, **options)
    perturb(model)
    toks = tokens()
    L = model.n_layer
    _, cache = model.run_with_cache(toks)
    # the sources before block L-1: embedding and the outputs of blocks 0..L-2, grouped in S-blocks
    S = model.scheme.block_size
    outputs = [cache[f"blocks.{s // 2}.hook_{('attn', 'mlp')[s % 2]}_out"] for s in range(2 * (L - 1))]
    sources = [cache["hook_embed"]]
    for start in range(0, len(outputs), S):
        sources.append(sum(outputs[start : start + S]))
    final = model.scheme.final_res
    mask_expected = model.unembed(model.ln_final(mix(model, final, sources)))
    assert torch.allclose(model.run(toks, plan=Plan.skipping(L - 1, rule="mask")), mask_expected, atol=1e-10)
    # next-output: the final mix is the identity on the newest source
    next_expected = model.unembed(model.ln_final(sources[-1]))
    assert torch.allclose(model.run(toks, plan=Plan.skipping(L - 1, rule="next-output")), next_expected, atol=1e-10)


def test_next_output_feeds_newest_source_to_next_block():
    model = build("attnres")
    perturb(model)
    toks = tokens()
    _, cache = model.run_with_cache(toks)
    seen = {}
    def record(x, hook):
        seen[hook.name] = x
    names = lambda name: name in ("blocks.3.hook_attn_in", "blocks.2.hook_attn_out")  # noqa: E731
    with model.hooks(fwd_hooks=[(names, record)]):
        model.run(toks, plan=Plan.skipping(2, rule="next-output"))
    assert torch.allclose(seen["blocks.3.hook_attn_in"], cache["blocks.1.hook_mlp_out"], atol=1e-12)
    assert "blocks.2.hook_attn_out" not in seen


# -- swap rule ---------------------------------------------------------------------------------
@pytest.mark.parametrize("i,j", [(1, 2), (0, 3), (1, 3)])
def test_swap_exchanges_core_mlp_mixer_and_consuming_mixer(i, j):
    """DepthBench: swapping blocks i,j == a model whose block weights (incl. the MLP-side mixer) and
    consuming mixers (next attention-side mixer, or the final mixer for the last block) are exchanged."""
    model = build("attnres")
    perturb(model)
    toks = tokens()
    L = model.n_layer
    exchanged = copy.deepcopy(model)
    blocks = exchanged.blocks
    core_i, core_j = model.blocks[i].state_dict(), model.blocks[j].state_dict()
    blocks[i].load_state_dict(core_j)
    blocks[j].load_state_dict(core_i)
    consumer = lambda m, b: m.scheme.final_res if b == L - 1 else m.scheme.attn_res[b]  # noqa: E731
    consumer(exchanged, i).load_state_dict(consumer(model, j).state_dict())
    consumer(exchanged, j).load_state_dict(consumer(model, i).state_dict())
    swapped = model.run(toks, plan=Plan.swapping(i, j, L))
    assert torch.allclose(swapped, exchanged(toks), atol=1e-12)
    assert not torch.allclose(swapped, model(toks), atol=1e-4)


# -- two-phase forward (bankops.DepthBank.prefix_mix) --------------------------------------------
def _count_two_phase_mixes(monkeypatch):
    """Counts mixes that used a two-phase group entry."""
    from depthtools.arch import bankops

    used = {"mixes": 0}
    original = bankops.DepthBank.prefix_mix

    def counting(self, col, n):
        entry = original(self, col, n)
        used["mixes"] += entry is not None
        return entry

    monkeypatch.setattr(bankops.DepthBank, "prefix_mix", counting)
    return used


@pytest.mark.parametrize("arch,block_size", [("attnres", None), ("blockattnres", 2)])
def test_two_phase_mixes_match_paper_equations_and_gradients(monkeypatch, arch, block_size):
    """At L=12 most mixes read >= 6 sources, so the grouped log-sum-exp merge is on the path: output
    and every parameter gradient equal the slow paper reference's (autograd through it)."""
    options = {} if block_size is None else {"attnres_block_size": block_size}
    model = build(arch, n_layer=12, **options)
    perturb(model)
    toks = tokens()
    used = _count_two_phase_mixes(monkeypatch)
    ours = model(toks)
    ours.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert used["mixes"] >= (15 if block_size is None else 3)
    model.zero_grad()
    ref = reference_full_attnres(model, toks) if block_size is None else reference_block_attnres(model, toks, block_size)
    ref.square().sum().backward()
    assert torch.allclose(ours, ref, atol=1e-10)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-9, rtol=1e-9), name


def test_two_phase_results_do_not_depend_on_the_run_history(monkeypatch):
    """Groups are fixed by the model, not by what ran before: runs from every cached state, a lens
    readout before the next step, and a skip sweep from a cached prefix are bit-identical to the
    full runs; a swapped plan (mixers at other depths) equals the exchanged model."""
    model = build("attnres", n_layer=12)
    perturb(model)
    toks = tokens()
    used = _count_two_phase_mixes(monkeypatch)
    states = model.run_states(toks)
    full = model(toks)
    assert used["mixes"] >= 30
    for depth in range(model.n_layer + 1):
        model.readout(states[depth])  # (a lens reads the state with the next mixer first)
        assert torch.equal(model.run(from_state=states[depth], start=depth), full)
    for position in (3, 8):
        plan = Plan.skipping(position)
        assert torch.equal(model.run(plan=plan, start=position, from_state=states[position]), model.run(toks, plan=plan))
    i, j, L = 7, 9, model.n_layer
    exchanged = copy.deepcopy(model)
    exchanged.blocks[i].load_state_dict(model.blocks[j].state_dict())
    exchanged.blocks[j].load_state_dict(model.blocks[i].state_dict())
    exchanged.scheme.attn_res[i].load_state_dict(model.scheme.attn_res[j].state_dict())
    exchanged.scheme.attn_res[j].load_state_dict(model.scheme.attn_res[i].state_dict())
    assert torch.allclose(model.run(toks, plan=Plan.swapping(i, j, L)), exchanged(toks), atol=1e-12)


# -- backward passes over a retained graph that stop short of slot 0 ---------------------------------

def _source_jacobian_columns(model, toks, layer, columns, outputs, fresh):
    """Gradients of block `layer`'s output columns w.r.t. its newest source, several passes over one
    retained graph (fresh=False) or one graph per pass (fresh=True). `outputs` picks, per pass, which
    output tensor is differentiated: the block's output or its output squared (a different set of mixes
    is reached only through the same graph, so both stress the bank's deferred gradients)."""
    from depthtools.analysis.depthbench import _with_input, block_output

    with torch.no_grad():
        state = model.run_states(toks, stop=layer)[layer]
    x0 = block_output(model, state).detach()
    grads, y, x = [], None, None
    for k, how in zip(columns, outputs):
        if y is None or fresh:
            x = x0.clone().requires_grad_(True)
            y = block_output(model, model.block_step(layer, _with_input(model, state, x)))
        target = y if how == "plain" else y.square()
        cot = torch.zeros_like(y)
        cot[..., k] = 1.0
        (g,) = torch.autograd.grad(target, x, cot, retain_graph=True)
        grads.append(g)
    return torch.stack(grads)


@pytest.mark.parametrize("forced", [False, True])
def test_partial_backward_passes_over_a_retained_graph_do_not_mix(forced):
    """Bug (fixed): the bank's deferred source gradients were reset only when slot 0's backward ran, so a
    second pass over a retained graph that stopped at a later source added the first pass's gradients
    (3e-2 off at L3 d16). Reference: the same gradients with a fresh graph per pass, and the plain-autograd
    path (fused=False). With fallbacks forced (no bank: the explicit path) the results are the same.
    The forward's own Jacobian code (analysis.depthbench.mean_block_jacobian) reuses one graph per block."""
    from depthtools.arch import torch_private

    toks = tokens(batch=1, length=6)
    columns, outputs = [0, 1, 2, 0], ["plain", "plain", "plain", "plain"]
    if not forced:  # with the pass id the bank also separates passes from different outputs
        outputs = ["plain", "square", "plain", "square"]
    with torch_private.fallbacks(forced):
        model = build("attnres", n_layer=3)
        perturb(model)
        reused = _source_jacobian_columns(model, toks, 1, columns, outputs, fresh=False)
        fresh = _source_jacobian_columns(model, toks, 1, columns, outputs, fresh=True)
    reference = _source_jacobian_columns(_plain_copy(model), toks, 1, columns, outputs, fresh=False)
    torch.testing.assert_close(reused, fresh, rtol=0, atol=1e-12)
    torch.testing.assert_close(reused, reference, rtol=0, atol=1e-10)


def _plain_copy(model):
    """The same weights on the plain-autograd path (option fused=False)."""
    cfg = model.config.replace(options={**model.config.options, "fused": False})
    plain = DepthModel(cfg, seed=0).to(next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict())
    return plain


# -- DepthBench's skip (the "depthbench" rule) --------------------------------------------------------
def _db_mix(mixer, residuals, eps):
    """DepthBench's fused_attnres without the output norm: softmax_i(w · RMSNorm_γ(v_i)) Σ α_i v_i."""
    V = torch.stack(residuals, dim=-2)  # [B,T,n,d]
    keys = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + eps) * mixer.key_norm.weight
    alpha = (keys @ mixer.query).softmax(-1)  # [B,T,n]
    return (alpha.unsqueeze(-1) * V).sum(-2)


@torch.no_grad()
def _depthbench_skipped_logits(model, toks, skip):
    """DepthBench's AttnRes blocks (block.py, the AttnRes block's forward: a (states, prefix_sum) pair, a
    sublayer at global index s a boundary iff s mod S == 0) with `depth_probes.skip_block(skip)`: the block
    returns (x, states) unchanged — block 0 (states None) returns (x, [x]) — and the next consuming mix, when
    it is a boundary mix (the next block's attention, or the final mix), returns its newest residual."""
    S, L, eps = model.scheme.block_size, model.n_layer, model.config.norm_eps
    cos, sin = model.rope_cos, model.rope_sin
    x0 = model.embed(toks).sources[0]
    states, prefix = None, x0
    for b in range(L):
        if b == skip:
            if states is None:
                states = [prefix]
            continue
        blk = model.blocks[b]
        if states is None:
            h, states, prefix = prefix, [prefix], None
        else:
            residuals = [*states, prefix]
            if (2 * b) % S == 0:
                states, prefix = residuals, None
            identity = skip is not None and b == skip + 1 and (2 * b) % S == 0
            h = residuals[-1] if identity else _db_mix(model.scheme.attn_res[b - 1], residuals, eps)
        out = blk.attn(blk.attn_norm(h), cos, sin)
        prefix = out if prefix is None else prefix + out
        residuals = [*states, prefix]
        if (2 * b + 1) % S == 0:
            states, prefix = residuals, None
        out = blk.mlp(blk.mlp_norm(_db_mix(blk.mlp_res, residuals, eps)))
        prefix = out if prefix is None else prefix + out
    residuals = [*states, prefix]
    h = residuals[-1] if skip == L - 1 else _db_mix(model.scheme.final_res, residuals, eps)
    return model.unembed(model.ln_final(h))


@pytest.mark.parametrize("arch,options", [("attnres", {}), ("blockattnres", {"attnres_block_size": 2}),
                                          ("blockattnres", {"attnres_block_size": 4}),
                                          ("blockattnres", {"attnres_block_size": 6})])
def test_depthbench_skip_rule_equals_depthbench_skip_block(arch, options):
    """The "depthbench" rule = DepthBench's skip_block written out from its block code, in float64, every block."""
    model = build(arch, **options).double()
    perturb(model)
    toks = tokens()
    reference_intact = _depthbench_skipped_logits(model, toks, skip=None)
    torch.testing.assert_close(model(toks), reference_intact, atol=1e-10, rtol=0)  # the reference's blocks are ours
    differs = []
    for s in range(model.n_layer):
        got = model.run(toks, plan=Plan.skipping(s, rule="depthbench"))
        torch.testing.assert_close(got, _depthbench_skipped_logits(model, toks, skip=s), atol=1e-10, rtol=0)
        differs.append(not torch.allclose(got, model.run(toks, plan=Plan.skipping(s, rule="next-output")), atol=1e-6))
    # Full AttnRes: the rules differ only when block 0 is skipped (DepthBench banks the embedding twice)
    assert differs[0] and (arch == "blockattnres" or not any(differs[1:]))


@pytest.mark.parametrize("arch", ["attnres", "blockattnres"])
def test_mix_eps_sets_the_norms_that_read_a_mix_and_nothing_else(arch):
    """Option mix_eps (DepthBench's res norms at 1e-5 beside block norms at 1e-6): the key norms, every sublayer
    norm after a mix and the final norm take it; block 0's attention norm (no mix) keeps norm_eps. Its value
    against DepthBench's forward is tested in tests/test_olmo_core_mapping.py; here: where it goes, and that the
    default (0) and mix_eps = norm_eps are the same model bit for bit."""
    base = dict(arch=arch, vocab_size=61, d_model=32, n_layer=3, n_heads=4, norm_eps=1e-6)
    model = DepthModel(ModelConfig(**base, options={"mix_eps": 1e-5}), seed=0)
    scheme = model.scheme
    assert model.blocks[0].attn_norm.eps == 1e-6
    assert all(b.attn_norm.eps == 1e-5 for b in model.blocks[1:]) and all(b.mlp_norm.eps == 1e-5 for b in model.blocks)
    assert model.ln_final.eps == 1e-5
    assert all(m.key_norm.eps == 1e-5 for m in [*scheme.attn_res, scheme.final_res, *(b.mlp_res for b in model.blocks)])
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    default = DepthModel(ModelConfig(**base), seed=0).eval()
    explicit = DepthModel(ModelConfig(**base, options={"mix_eps": 1e-6}), seed=0).eval()
    with torch.no_grad():
        assert torch.equal(default(tokens), explicit(tokens))
        assert not torch.equal(default(tokens), model.eval()(tokens))
