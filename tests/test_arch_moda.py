"""MoDA (Mixture-of-Depths Attention): equations, Pre-LN reduction, skip rules, swap, hooks."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from depthtools.arch import DepthModel, Plan
from depthtools.arch.moda import MoDAState, moda_extra_params
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

VOCAB = 37


def build(n_layer=3, d_model=32, n_heads=4, n_kv_heads=None, seed=0, **options) -> DepthModel:
    cfg = ModelConfig(arch="moda", vocab_size=VOCAB, d_model=d_model, n_layer=n_layer, n_heads=n_heads,
                      n_kv_heads=n_kv_heads, max_seq_len=16, options=options)
    model = DepthModel(cfg, seed=seed).double().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # large, non-trivial weights so depth slots get real softmax mass
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.25
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def tokens(batch=2, length=6, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- a slow, obviously-correct reference written from the paper's equations ----------------------

def rms(x, weight, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, t, model):
    """RoPE of one head vector x [hd] at position t: pairs (i, i + hd/2) by angle t·theta^(-2i/hd).

    cos/sin come from the model's (float32) tables so the comparison can be tight; the test
    below checks those tables against the formula.
    """
    hd = x.shape[-1]
    cos, sin = model.rope_cos[t].double(), model.rope_sin[t].double()
    x1, x2 = x[: hd // 2], x[hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def test_rope_tables_follow_the_formula():
    model = build(n_layer=1)
    hd, theta = model.config.head_dim, model.config.rope_theta
    t = torch.arange(model.config.max_seq_len, dtype=torch.float64)[:, None]
    angle = t * theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    assert torch.allclose(model.rope_cos.double(), angle.cos(), atol=1e-6)
    assert torch.allclose(model.rope_sin.double(), angle.sin(), atol=1e-6)


def reference_logits(model: DepthModel, toks, skip=(), rule="mask"):
    """Per-position, per-head loop: one softmax over the list [seq keys j<=t] + [depth keys s].

    depth_rope "none": depth scores q·K_s un-rotated (relative offset 0; equal to rotating both by
    the query's position t, see test_unrotated_depth_score_is_rotation_invariant); "query": rotated
    q against raw K_s (DepthBench's kernel call).
    """
    cfg = model.config
    post = cfg.options.get("moda_norm", "pre") == "post"
    depth_rope = cfg.options.get("moda_depth_rope", "none")
    B, T = toks.shape
    H, Hkv, hd, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
    group = H // Hkv
    h = model.tok_embed.weight[toks]  # [B,T,d]
    slots = []  # list of (K [B,T,Hkv,hd], V [B,T,Hkv,hd], present)
    for b, blk in enumerate(model.blocks):
        last = b == cfg.n_layer - 1
        if b in skip:
            if not last:
                zero = torch.zeros(B, T, Hkv, hd, dtype=h.dtype)
                slots += [(zero, zero, rule == "zero")] * 2
            continue
        x = h if post else rms(h, blk.attn_norm.weight, eps)
        q = (x @ blk.attn.w_q.weight.T).view(B, T, H, hd)
        k = (x @ blk.attn.w_k.weight.T).view(B, T, Hkv, hd)
        v = (x @ blk.attn.w_v.weight.T).view(B, T, Hkv, hd)
        z = torch.zeros(B, T, H, hd, dtype=h.dtype)
        for i in range(B):
            for t in range(T):
                for head in range(H):
                    kv = head // group
                    qt = rotate(q[i, t, head], t, model)
                    scores = [qt @ rotate(k[i, j, kv], j, model) / math.sqrt(hd) for j in range(t + 1)]
                    vals = [v[i, j, kv] for j in range(t + 1)]
                    for K, V, present in slots:
                        if not present:
                            continue
                        if depth_rope == "none":  # offset 0: = R_t q · R_t K (R_t orthogonal)
                            s = q[i, t, head] @ K[i, t, kv]
                        else:
                            s = qt @ K[i, t, kv]
                        scores.append(s / math.sqrt(hd))
                        vals.append(V[i, t, kv])
                    p = torch.softmax(torch.stack(scores), 0)
                    z[i, t, head] = sum(pj * vj for pj, vj in zip(p, vals))
        h = h + z.flatten(2) @ blk.attn.w_o.weight.T
        if post:
            h = rms(h, blk.attn_post_norm.weight, eps)
        x = h if post else rms(h, blk.mlp_norm.weight, eps)
        if not last:
            kv = (x @ blk.kv_proj.weight.T).view(B, T, 2, Hkv, hd)
            slots += [(k, v, True), (kv[:, :, 0], kv[:, :, 1], True)]  # attention: raw (pre-RoPE) K
        mlp = blk.mlp
        h = h + (F.silu(x @ mlp.w1.weight.T) * (x @ mlp.w3.weight.T)) @ mlp.w2.weight.T
        if post:
            h = rms(h, blk.mlp_post_norm.weight, eps)
    return rms(h, model.ln_final.weight, eps) @ model.unembed.weight.T


def test_unrotated_depth_score_is_rotation_invariant():
    """Why "none" is the relative-offset-0 choice: (R_t q)·(R_t k) = q·k for every t (float64)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 16, generator=gen, dtype=torch.float64)
    for t in (0, 3, 11):
        angle = t * 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        c, s = angle.cos(), angle.sin()
        rot = lambda x: torch.cat([x[:8] * c - x[8:] * s, x[8:] * c + x[:8] * s])  # noqa: E731
        assert torch.allclose(rot(q) @ rot(k), q @ k, atol=1e-12)
        assert t == 0 or not torch.allclose(rot(q) @ k, q @ k)  # the "query" mode is not


@pytest.mark.parametrize(
    "norm,depth_rope,n_kv",
    [("pre", "none", None), ("pre", "query", None), ("post", "none", None), ("pre", "none", 2),
     ("post", "query", 2)],
)
def test_matches_per_position_reference(norm, depth_rope, n_kv):
    model = build(n_layer=3, n_kv_heads=n_kv, moda_norm=norm, moda_depth_rope=depth_rope)
    toks = tokens(batch=2, length=5)
    with torch.no_grad():
        fast, ref = model(toks), reference_logits(model, toks)
    assert torch.allclose(fast, ref, atol=1e-9, rtol=1e-9), (fast - ref).abs().max()


def test_reference_sees_the_depth_memories():
    """Guard for the reference test: depth slots carry real mass, and both RoPE modes differ."""
    toks = tokens(batch=1, length=5)
    model = build(n_layer=3)
    _, cache = model.run_with_cache(toks)
    assert cache["blocks.2.hook_moda_depth_pattern"].sum(-1).min() > 0.05
    query = build(n_layer=3, moda_depth_rope="query")
    assert not torch.allclose(model(toks), query(toks), atol=1e-6)


def test_mask_skip_in_reference_is_exact():
    model, toks = build(n_layer=4), tokens(batch=1, length=5)
    for rule in ("mask", "zero"):
        with torch.no_grad():
            fast = model.run(toks, plan=Plan.skipping(1, rule=rule))
            ref = reference_logits(model, toks, skip=(1,), rule=rule)
        assert torch.allclose(fast, ref, atol=1e-9), rule


# -- reduction to the normalisation family when no depth memory is visible ---------------------

def run_without_depth(model: DepthModel, toks):
    """Run MoDA with every depth slot masked out after each step (a hand-built state)."""
    state = model.embed(toks)
    for position in range(model.n_layer):
        state = model.block_step(position, state)
        state = state._replace(valid=(False,) * state.n_slots)
    return model.head(state)


@pytest.mark.parametrize("norm,family", [("pre", "preln"), ("post", "postln")])
def test_depth_masked_equals_normalisation_family(norm, family):
    model, toks = build(n_layer=4, moda_norm=norm), tokens()
    base = DepthModel(model.config.replace(arch=family, options={}), seed=0).double().eval()
    missing, unexpected = base.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all("kv_proj" in k for k in unexpected) and unexpected
    with torch.no_grad():
        assert torch.allclose(run_without_depth(model, toks), base(toks), atol=1e-10)
        assert not torch.allclose(model(toks), base(toks), atol=1e-4)  # depth memories matter


def test_single_layer_moda_is_preln():
    model, toks = build(n_layer=1), tokens()
    assert not any("kv_proj" in n for n, _ in model.named_parameters())
    base = DepthModel(model.config.replace(arch="preln", options={}), seed=0).double().eval()
    base.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(model(toks), base(toks), atol=1e-12)


# -- skip rules ---------------------------------------------------------------------------------

def test_skip_rules_are_finite_and_different():
    model, toks = build(n_layer=4), tokens()
    assert model.scheme.skip_rules == ("mask", "zero")
    with torch.no_grad():
        full = model(toks)
        mask = model.run(toks, plan=Plan.skipping(1, rule="mask"))
        zero = model.run(toks, plan=Plan.skipping(1, rule="zero"))
        default = model.run(toks, plan=Plan.skipping(1))
    assert torch.isfinite(mask).all() and torch.isfinite(zero).all()
    assert not torch.allclose(mask, zero, atol=1e-6)
    assert not torch.allclose(mask, full, atol=1e-6)
    assert torch.equal(default, mask)
    with pytest.raises(DepthToolsError, match="skip rule"):
        model.run(toks, plan=Plan.skipping(1, rule="identity"))


def test_mask_skip_equals_a_run_that_never_writes_the_slots():
    model, toks = build(n_layer=5), tokens()
    for skipped in (0, 2, 4):
        with torch.no_grad():
            planned = model.run(toks, plan=Plan.skipping(skipped, rule="mask"))
            state = model.embed(toks)
            for position in range(model.n_layer):
                if position != skipped:  # the skipped block leaves h and the cache untouched
                    state = model.block_step(position, state)
            by_hand = model.head(state)
        assert torch.allclose(planned, by_hand, atol=1e-12), skipped


def test_zero_skip_slots_dilute_the_softmax_and_mask_slots_get_no_weight():
    model, toks = build(n_layer=4), tokens()
    patterns = {}
    for rule in ("mask", "zero"):
        keep = lambda p, hook, rule=rule: patterns.__setitem__(rule, p)  # noqa: E731
        with model.hooks(fwd_hooks=[("blocks.2.hook_moda_depth_pattern", keep)]):
            model.run(toks, plan=Plan.skipping(1, rule=rule))  # slots 0..3; 2,3 = block 1
    assert patterns["mask"].shape[-1] == 4
    assert torch.all(patterns["mask"][..., 2:] == 0)
    assert torch.all(patterns["zero"][..., 2:] > 0)


# -- swap ---------------------------------------------------------------------------------------

def test_swap_moves_kv_proj_with_the_block():
    model, toks = build(n_layer=4), tokens()
    swapped = copy.deepcopy(model)
    with torch.no_grad():
        for (name, p1), p2 in zip(swapped.blocks[1].named_parameters(), swapped.blocks[2].parameters()):
            tmp = p1.clone()
            p1.copy_(p2)
            p2.copy_(tmp)
        assert torch.allclose(model.run(toks, plan=Plan.swapping(1, 2, 4)), swapped(toks), atol=1e-12)
        # the last block has no kv_proj: run early, it uses its position's own (DepthBench)
        out = model.run(toks, plan=Plan.swapping(0, 3, 4))
    assert torch.isfinite(out).all()


# -- hooks, state, registry ---------------------------------------------------------------------

def test_hooks_split_one_softmax_and_edits_take_effect():
    model, toks = build(n_layer=3), tokens()
    logits, cache = model.run_with_cache(toks)
    seq, depth = cache["blocks.2.attn.hook_pattern"], cache["blocks.2.hook_moda_depth_pattern"]
    assert seq.shape == (2, 4, 6, 6) and depth.shape == (2, 4, 6, 4)
    assert torch.allclose(seq.sum(-1) + depth.sum(-1), torch.ones(2, 4, 6, dtype=seq.dtype))
    assert cache["blocks.1.hook_moda_k"].shape == (2, 6, 4, 8)
    assert "blocks.2.hook_moda_k" not in cache  # the last block writes no slots
    assert torch.allclose(logits, model(toks), atol=1e-12)
    edited = model.run_with_hooks(
        toks, fwd_hooks=[("blocks.2.hook_moda_depth_pattern", lambda p, hook: torch.zeros_like(p))]
    )
    assert not torch.allclose(edited, logits, atol=1e-6)


def test_state_is_immutable_and_counts_slots():
    model, toks = build(n_layer=4), tokens()
    states = model.run_states(toks)
    assert [s.n_slots for s in states] == [0, 2, 4, 6, 6]
    assert isinstance(states[2], MoDAState) and states[2].keys.shape == (2, 6, 4, 4, 8)
    before = states[2].keys.clone(), states[2].h.clone()
    model.run(plan=Plan.skipping(2, rule="zero"), start=2, from_state=states[2])
    assert torch.equal(states[2].keys, before[0]) and torch.equal(states[2].h, before[1])
    assert torch.equal(model.readout(states[3]), states[3].h)


def test_logit_lens_accepts_moda():
    model, toks = build(n_layer=3), tokens()
    logits, cache = model.run_with_cache(toks)
    assert all(block.hook_out_is_single_residual_stream for block in model.blocks)
    resid = cache.accumulated_resid(apply_ln=False)
    assert resid.shape[0] == 4
    assert torch.allclose(model.unembed(model.ln_final(resid[-1])), logits, atol=1e-10)
    result = cache.logit_lens(positions=None)  # TransformerLens' own tool accepts the blocks
    assert result.labels[-1] == "final_post" and len(result.labels) == 4
    assert torch.allclose(result.values[-1].to(logits.dtype), logits, atol=1e-6)


def test_extra_params_and_options():
    for n_kv in (None, 2):
        cfg = ModelConfig(arch="moda", vocab_size=VOCAB, d_model=48, n_layer=5, n_heads=4, n_kv_heads=n_kv)
        extra = sum(p.numel() for n, p in DepthModel(cfg).named_parameters() if "kv_proj" in n)
        assert extra == moda_extra_params(cfg) == 2 * 48 * cfg.n_kv_heads * 12 * 4
    with pytest.raises(DepthToolsError, match="moda_norm"):
        build(moda_norm="sandwich")
    with pytest.raises(DepthToolsError, match="moda_depth_rope"):
        build(moda_depth_rope="both")


# -- buffer reuse (layers.BufferPool) ----------------------------------------------------------
def _train_step(model, toks):
    model(toks).square().sum().backward()


def test_slot_buffers_are_reused_across_steps_but_never_while_a_state_views_them():
    model = build(n_layer=4).float().train()
    toks = tokens(length=8)
    _train_step(model, toks)
    first = model.run_states(toks)[-1].keys._base.data_ptr()
    _train_step(model, toks)  # the states above are gone: the same buffer serves the next run
    kept = model.run_states(toks)  # ... and these stay alive
    assert kept[-1].keys._base.data_ptr() == first
    snapshot = [(s.keys.clone(), s.values.clone()) for s in kept if s.keys is not None]
    _train_step(model, tokens(length=8, seed=5))  # other tokens, while `kept` still views its buffer
    assert model.run_states(toks)[-1].keys._base.data_ptr() != first
    for s, (k, v) in zip([s for s in kept if s.keys is not None], snapshot):
        assert torch.equal(s.keys, k) and torch.equal(s.values, v)
    model.zero_grad()
    _train_step(model, tokens(length=8, seed=5))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _train_step(model, tokens(length=8, seed=5))  # on the reused gradient buffers: the same gradients
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_the_cpu_only_fused_kernel_is_chosen_by_device_type(monkeypatch):
    """The private CPU flash-attention op must never receive a CUDA (or any non-CPU) tensor: the choice
    is a function of device.type, and a non-CPU forward takes the explicit joint softmax, which gives
    the same logits as the fused path."""
    from depthtools.arch import moda

    assert moda.fused_kernel_for(torch.device("cpu"))
    for device in ("cuda", "cuda:1", "mps", "meta"):
        assert not moda.fused_kernel_for(torch.device(device))
    model, toks = build(n_layer=3), tokens()
    fused = model(toks)
    monkeypatch.setattr(moda, "fused_kernel_for", lambda device: False)  # what a CUDA tensor sees
    monkeypatch.setattr(moda._DepthAttention, "apply", staticmethod(lambda *a: pytest.fail("fused kernel called")))
    assert torch.allclose(model(toks), fused, atol=1e-10)


# -- option moda_kv_dtype="bfloat16": the depth K/V cache stored in bfloat16 ------------------------

def _bf16_grads(model, toks):
    model.zero_grad()
    logits = model(toks)
    logits.square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("path", ["C kernels", "torch ops"])
def test_bfloat16_slots_equal_the_reference_with_rounded_slots(monkeypatch, path):
    """A float32 model with moda_kv_dtype="bfloat16" stores its slots in bfloat16 (the buffers are bfloat16) and
    computes what the reference path computes with every slot rounded to bfloat16 and its gradient passed
    through (fused=False): logits and every parameter gradient, through the C kernels and through torch ops.
    The rounding is real: the model differs from one with float32 slots by far more than the tolerance."""
    from depthtools.arch import cpu_kernels

    if path == "torch ops":
        monkeypatch.setattr(cpu_kernels, "moda_usable", lambda t, kv_dtype=None: False)
    toks = tokens(batch=3, length=12)
    model = build(n_layer=4, n_kv_heads=2, moda_kv_dtype="bfloat16").float()
    reference = copy.deepcopy(model)  # same weights, through the reference path
    reference.scheme.fused = False
    states = model.run_states(toks)
    assert states[-1].keys.dtype == torch.bfloat16
    got, got_grads = _bf16_grads(model, toks)
    want, want_grads = _bf16_grads(reference, toks)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * max(1.0, b.abs().max().item()))
    full = build(n_layer=4, n_kv_heads=2).float()
    assert (full(toks) - got).abs().max() > 100 * 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("stream", [True, False])
def test_slot_store_writes_every_token_with_and_without_streaming_stores(dtype, stream, monkeypatch):
    """The C slot store equals a permuted copy, bit for bit, on both of its paths: whole 64-byte rows (streaming
    stores where the CPU has them; N = 192 tokens) and the plain path (N = 200: rows that are not whole lines and
    a last block of 8 tokens; a destination that is not 64-byte aligned; or streaming switched off), from
    contiguous and strided sources."""
    from depthtools.arch import cpu_kernels
    from depthtools.arch.ops import moda as moda_ops

    if cpu_kernels.library("moda") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    monkeypatch.setattr(moda_ops, "STREAM_STORES", stream)
    gen = torch.Generator().manual_seed(0)
    src_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    for B, T, offset in ((3, 64, 0), (4, 50, 0), (3, 64, 1)):
        both = torch.randn(B, T, 2, 3, 16, generator=gen, dtype=src_dtype)
        for src in (both[:, :, 0].contiguous(), both[:, :, 1]):  # [B,T,Hkv,hd]: contiguous, and a strided view
            flat = torch.zeros(offset + 2 * 3 * 16 * B * T, dtype=dtype)
            dst = flat[offset:].view(2, 3, 16, B, T)[1]  # one slot's worth inside the buffer
            moda_ops.moda_store_slot(src, dst)
            assert torch.equal(dst, src.to(dtype).permute(2, 3, 0, 1))
            assert not flat[offset: offset + 3 * 16 * B * T].any()  # nothing written outside the slot


def test_bfloat16_slot_store_rounds_as_torch_does():
    """The C slot store rounds float32 to bfloat16 to nearest even, bit for bit as torch's .to(torch.bfloat16),
    including ties, subnormals, infinities and NaN."""
    from depthtools.arch import cpu_kernels
    from depthtools.arch.ops import moda as moda_ops

    if cpu_kernels.library("moda") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x7F800000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.cat([bits, torch.tensor([float("nan"), -0.0, 1e-40])])
    x = torch.cat([special, torch.randn(8 * 5 * 2 * 4 - special.numel()) * 10])
    src = x.view(8, 5, 2, 4)  # [B,T,Hkv,hd]
    dst = torch.empty(2, 4, 8, 5, dtype=torch.bfloat16)
    moda_ops.moda_store_slot(src, dst)
    want = src.to(torch.bfloat16).permute(2, 3, 0, 1)
    assert torch.equal(dst.view(torch.int16)[~want.isnan()], want.contiguous().view(torch.int16)[~want.isnan()])
    assert dst.isnan().equal(want.isnan())
