"""The vocabulary-chunked head (depthtools.analysis.headmetrics) against an independent float64 log-softmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from depthtools.analysis.headmetrics import BLOCK, Head, Reference, row_metrics


def _case(n=300, d=24, V=1000, cap=0.0, bias=True, seed=0):
    """Rows, a head (weight, bias, soft-cap), targets, and a reference distribution on the same rows."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=gen)
    b = torch.randn(V, generator=gen) if bias else None
    x, xr = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    targets = torch.randint(0, V, (n,), generator=gen)
    return Head(W, b, cap), x, xr, targets


def _logits64(head: Head, x: torch.Tensor) -> torch.Tensor:
    z = x.double() @ head.weight.double().T
    z = z if head.bias is None else z + head.bias.double()
    return torch.tanh(z / head.cap) * head.cap if head.cap else z


@pytest.mark.parametrize("chunk", [7, 2 * BLOCK, 4096])
@pytest.mark.parametrize("cap,bias", [(0.0, False), (0.0, True), (3.0, True)])
def test_row_metrics_match_a_float64_log_softmax(chunk, cap, bias):
    """CE, entropy, both KLs against a float64 log-softmax of the same logits to float32 rounding; the top-5
    ids hold the 5 largest logits; rank exactly as a full float32 log-softmax counts it (ties in lp are not 'greater')."""
    head, x, xr, t = _case(cap=cap, bias=bias)
    ref_lp = F.log_softmax(_logits64(head, xr).float(), -1)
    ref = Reference.of(ref_lp, k=5, head=head)
    m = row_metrics(head, x, t, ref, k=5, rank=True, reverse=True, chunk=chunk)
    lp = F.log_softmax(_logits64(head, x), -1)
    p, pr = lp.exp(), ref_lp.double().exp()
    close = dict(rtol=0, atol=2e-5)
    torch.testing.assert_close(m.ce, -lp.gather(1, t[:, None])[:, 0], **close)
    torch.testing.assert_close(m.entropy, -(p * lp).sum(1), **close)
    torch.testing.assert_close(m.kl_ref, (pr * (ref_lp.double() - lp)).sum(1), **close)
    torch.testing.assert_close(m.kl_rev, (p * (lp - ref_lp.double())).sum(1), **close)
    z32 = torch.cat([head.logits(x, lo, min(lo + chunk, 1000)) for lo in range(0, 1000, chunk)], 1)
    assert torch.equal(z32.gather(1, m.top), z32.topk(5, dim=1).values)  # ids of the 5 largest (ties: any)
    assert (m.top.sort(1).values.diff(dim=1) > 0).all()  # 5 distinct ids
    lp32 = F.log_softmax(z32, -1)
    assert torch.equal(m.rank, (lp32 > lp32.gather(1, t[:, None])).sum(1) + 1)
    assert (m.kl_ref >= -1e-6).all() and (m.kl_rev >= -1e-6).all()


def test_rank_counts_ties_as_the_full_log_softmax_does():
    """Logits one and two float32 ulps above the target's (an identity head, so the logits are the rows
    exactly): a full float32 log-softmax rounds some of them onto the target's log-prob, and those are not
    counted as greater; the chunked rank counts as it does (and the plain logit count would not)."""
    V, n = 600, 64
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(n, V, generator=gen) * 4 + 8  # log-probs near −log V: ulp(lp) is 16× ulp(z)
    t = torch.randint(10, V, (n,), generator=gen)
    zt = x.gather(1, t[:, None])
    x[:, :4] = torch.stack([torch.nextafter(zt, zt + 1), torch.nextafter(torch.nextafter(zt, zt + 1), zt + 1),
                            zt, zt - 1e-3], 1).squeeze(2)
    head = Head(torch.eye(V), None, 0.0)
    m = row_metrics(head, x, t, rank=True, chunk=128)
    lp = F.log_softmax(x, -1)
    expected = (lp > lp.gather(1, t[:, None])).sum(1) + 1
    assert torch.equal(m.rank, expected)
    assert (expected < (x > zt).sum(1) + 1).any()  # the case is real: some near-ties merged in lp


def test_low_precision_logits_are_widened_and_float64_rows_stay_float64():
    """A bfloat16 head's logits are widened to float32 before any sum (CE within bf16 rounding of the
    float64 value of the same bf16 logits); a float64 head is exact to float64."""
    head, x, _, t = _case(n=40, V=500, bias=False, seed=2)
    low = Head(head.weight.bfloat16(), None, 0.0)
    m = row_metrics(low, x.bfloat16(), t, chunk=128)
    z = torch.cat([F.linear(x.bfloat16(), low.weight[lo:lo + 128]) for lo in range(0, 500, 128)], 1).double()
    torch.testing.assert_close(m.ce, -F.log_softmax(z, -1).gather(1, t[:, None])[:, 0], rtol=0, atol=1e-5)
    wide = Head(head.weight.double(), None, 0.0)
    m64 = row_metrics(wide, x.double(), t, chunk=64)
    lp = F.log_softmax(_logits64(wide, x), -1)
    torch.testing.assert_close(m64.ce, -lp.gather(1, t[:, None])[:, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(m64.entropy, -(lp.exp() * lp).sum(1), rtol=0, atol=1e-12)


# -- the fused row metrics (C kernel "rowmetrics") -------------------------------------------------------------------

from depthtools.analysis import headmetrics  # noqa: E402
from depthtools.analysis.headmetrics import fused_metrics, fused_usable  # noqa: E402

needs_kernel = pytest.mark.skipif(not fused_usable(torch.zeros(1, 4)), reason="the rowmetrics C kernel did not build")


def _full_path(z: torch.Tensor, t: torch.Tensor, ref_lp: torch.Tensor | None, k: int):
    """What the full float32 path computes (lens `_DepthSums.add`, sweep `_Sums.add`), written out here."""
    lp = F.log_softmax(z, -1)
    target = lp.gather(1, t[:, None])
    top = lp.topk(k, dim=1).indices if k > 1 else lp.argmax(1, keepdim=True)
    rank = (lp > target).sum(1) + 1
    kl = None if ref_lp is None else (ref_lp.exp() * (ref_lp - lp)).sum(1)
    return top, rank, kl


def _fused_case(n, V, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=gen) * scale
    t = torch.randint(0, V, (n,), generator=gen)
    ref_lp = F.log_softmax(torch.randn(n, V, generator=gen) * scale, -1)
    return z, t, ref_lp


@needs_kernel
@pytest.mark.parametrize("n,V,k", [(300, 1000, 5), (64, 49152, 5), (37, 50, 1), (5, 3, 2), (40, 129, 8)])
def test_fused_metrics_match_a_float64_log_softmax_and_the_full_paths_ids(n, V, k):
    """CE, entropy and both KLs against a float64 log-softmax of the same float32 logits, to float32 rounding
    (closer than the full float32 path: below); the top ids and the rank exactly those of the full float32
    log-softmax (its ties included). Vocabularies on and off the kernel's 128/256 blocks, below k + 1 too."""
    z, t, ref_lp = _fused_case(n, V, seed=V)
    ref = Reference.of(ref_lp, k=k)
    m = fused_metrics(z, t, ref, k=min(k, V), rank=True, reverse=True)
    lp = F.log_softmax(z.double(), -1)
    p, pr = lp.exp(), ref_lp.double().exp()
    close = dict(rtol=4e-7, atol=2e-6)  # float32 rounding of values up to ~15
    torch.testing.assert_close(m.lse, torch.logsumexp(z.double(), -1), **close)
    torch.testing.assert_close(m.ce, -lp.gather(1, t[:, None])[:, 0], **close)
    torch.testing.assert_close(m.entropy, -(p * lp).sum(1), **close)
    torch.testing.assert_close(m.kl_ref, (pr * (ref_lp.double() - lp)).sum(1), **close)
    torch.testing.assert_close(m.kl_rev, (p * (lp - ref_lp.double())).sum(1), **close)
    top, rank, _ = _full_path(z, t, None, min(k, V))
    assert torch.equal(m.top, top) and torch.equal(m.rank, rank)


@needs_kernel
def test_fused_metrics_are_nearer_float64_than_the_full_float32_path():
    """At a 49k vocabulary the full path's float32 sums drift from float64 by ~1e-5 per row; the fused sums
    (float32 within 256 columns, float64 across) stay at float32 rounding of the result: what makes its means
    differ from the full path's by more than 1e-6 on high-entropy rows, and why that is not a regression."""
    z, t, ref_lp = _fused_case(128, 49152, seed=3)
    m = fused_metrics(z, t, Reference.of(ref_lp), rank=True)
    exact = (ref_lp.double().exp() * (ref_lp.double() - F.log_softmax(z.double(), -1))).sum(1)
    _, _, kl32 = _full_path(z, t, ref_lp, 1)
    fused_err, full_err = (m.kl_ref - exact).abs().max(), (kl32.double() - exact).abs().max()
    assert fused_err < 2e-6 and fused_err < full_err / 4


@needs_kernel
def test_fused_ranks_and_top_ids_resolve_near_ties_as_the_full_path():
    """Logits one and two ulps above the target's (where the float32 log-softmax merges some with it), exact
    ties at the top and between the 5th and 6th largest: the fused rank and top-5 ids are the full path's."""
    V, n = 600, 64
    gen = torch.Generator().manual_seed(1)
    z = torch.rand(n, V, generator=gen) * 4 + 8
    t = torch.randint(10, V, (n,), generator=gen)
    zt = z.gather(1, t[:, None])[:, 0]
    for j in range(1, 4):
        z[torch.arange(n), (t + j) % V] = zt + j * torch.finfo(torch.float32).eps * zt  # ~j ulps above
    z[:8, 3] = z[:8].amax(1) + 1  # an exact tie at the top: ids 3 and 4
    z[:8, 4] = z[:8, 3]
    z[8:16, 100:106] = z[8:16].amax(1, keepdim=True) + torch.tensor([5.0, 4, 3, 2, 1, 1])  # 5th = 6th
    m = fused_metrics(z, t, k=5, rank=True)
    top, rank, _ = _full_path(z, t, None, 5)
    assert torch.equal(m.rank, rank) and torch.equal(m.top, top)
    assert not torch.equal(rank, (z > zt[:, None]).sum(1) + 1)  # the case is one where the plain count differs


@needs_kernel
def test_fused_rows_with_non_finite_logits_are_the_full_paths():
    """A NaN, a −inf and a +inf logit in three rows: those rows' metrics are the full float32 path's (NaN where
    it gives NaN), the other rows are unaffected."""
    z, t, ref_lp = _fused_case(6, 300, seed=5)
    z[0, 7], z[1, 8], z[2, 9] = float("nan"), float("-inf"), float("inf")
    m = fused_metrics(z, t, Reference.of(ref_lp), rank=True, reverse=True)
    lp = F.log_softmax(z, -1)
    ce, kl = -lp.gather(1, t[:, None])[:, 0].double(), (ref_lp.exp() * (ref_lp - lp)).sum(1).double()
    torch.testing.assert_close(m.ce[:3], ce[:3], equal_nan=True)
    torch.testing.assert_close(m.kl_ref[:3], kl[:3], equal_nan=True)
    assert torch.isfinite(m.ce[3:]).all() and torch.isfinite(m.kl_ref[3:]).all()
    top, rank, _ = _full_path(z, t, None, 1)
    assert torch.equal(m.top[3:], top[3:]) and torch.equal(m.rank[3:], rank[3:])


@needs_kernel
def test_fused_metrics_read_strided_batches_and_do_not_depend_on_threads():
    """Rows of a [B, T, V] view with the first position dropped (the sweep's scored logits, not copied) give
    the metrics of the same rows made contiguous; one thread gives the same bits as two."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 9, 700, generator=gen)
    scored = logits[:, 1:]
    t = torch.randint(0, 700, (3 * 8,), generator=gen)
    flat = fused_metrics(scored.reshape(-1, 700).contiguous(), t, k=2, rank=True)
    view = fused_metrics(scored, t, k=2, rank=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_metrics(scored, t, k=2, rank=True)
    finally:
        torch.set_num_threads(threads)
    for a, b in ((flat, view), (view, one)):
        for name in ("lse", "ce", "entropy", "top", "rank"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_fused_path_is_declined_where_it_does_not_apply(monkeypatch):
    """float64, bfloat16 or a 1-D tensor, more top ids than the kernel keeps, or DEPTHTOOLS_FUSED_METRICS=0
    (FUSED off): the callers take the full log-softmax."""
    z = torch.zeros(4, 10)
    assert not fused_usable(z.double()) and not fused_usable(z.bfloat16()) and not fused_usable(z[0])
    assert not fused_usable(z, k=headmetrics.TOP_MAX)
    monkeypatch.setattr(headmetrics, "FUSED", False)
    assert not fused_usable(z)


@needs_kernel
@pytest.mark.parametrize("arch", ["preln", "hc", "attnres", "moda"])
def test_lens_and_sweep_on_the_fused_path_equal_the_full_path(arch, monkeypatch):
    """The logit lens and a skip sweep on a tiny model, fused (the CPU default) vs the full float32 log-softmax
    (FUSED off): every per-depth and per-plan metric within 1e-6, top-1/top-5 agreement, ranks, prediction
    depths and accuracy identical (the same top ids)."""
    from depthtools.analysis.lens import lens_analysis
    from depthtools.analysis.sweep import sweep
    from depthtools.arch import Plan

    from tiny_models import tiny, windows

    model, toks = tiny(arch).float(), windows()
    plans = [Plan.skipping(layer) for layer in range(model.n_layer)]

    def run():
        return lens_analysis(model, toks, batch_size=2, chunked_head=False), sweep(model, toks, plans, batch_size=2,
                                                                                    chunked_head=False)

    lens_fused, sweep_fused = run()
    monkeypatch.setattr(headmetrics, "FUSED", False)
    lens_full, sweep_full = run()
    a, b = lens_fused.depths, lens_full.depths
    for column in ("ce", "kl_final_lens", "kl_lens_final", "entropy", "top5_overlap"):
        assert (a[column] - b[column]).abs().max() < 1e-6, column
    assert (a["top1_agree"] == b["top1_agree"]).all() and (a["target_rank"] == b["target_rank"]).all()
    assert (lens_fused.prediction_depth == lens_full.prediction_depth).all()
    for x, y in zip(sweep_fused.plans, sweep_full.plans):
        assert abs(x.ce - y.ce) < 1e-6 and abs(x.kl - y.kl) < 1e-6
        assert x.top1_agree == y.top1_agree and x.top1_acc == y.top1_acc



@pytest.mark.parametrize("options", [{}, {"final_softcap": 3.0}, {"head_bias": True}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logits_buffer_decodes_the_heads_own_numbers_bit_for_bit(options, dtype):
    """Issue 47: `LogitsBuffer` decodes into one reused block where `hidden_logits(out=)` gives the module's own
    numbers bit for bit (a bias-free unhooked nn.Linear; the soft-cap in place in its own order), and returns a
    fresh tensor elsewhere (a biased head: F.linear's addmm; a hooked or streamed unembedding: its hooks fire)."""
    from depthtools.analysis.headmetrics import LogitsBuffer
    from depthtools.arch.backbone import softcap

    from tiny_models import tiny

    model = tiny("preln", **options).to(dtype)
    buffer = LogitsBuffer()
    rows = [torch.randn(2, 5, 32, dtype=dtype), torch.randn(3, 32, dtype=dtype), torch.randn(2, 5, 32, dtype=dtype)]
    with torch.enable_grad():  # autograd recording (the parameters require grad): a fresh tensor, as before
        assert buffer.decode(model, rows[0]).requires_grad and buffer._flat is None
    for x in rows:  # shapes change: the block is reused (or regrown) and each result is the module's
        expected = softcap(model.unembed(x), model.backbone.final_softcap)
        with torch.no_grad():
            got = buffer.decode(model, x)
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
        in_buffer = buffer._flat is not None and got.data_ptr() == buffer._flat.data_ptr()
        assert in_buffer == ("head_bias" not in options)
    def decode_hooked(register) -> torch.Tensor:
        handle = register()
        try:
            with torch.no_grad():
                return buffer.decode(model, rows[0])
        finally:
            handle.remove()

    hooked = decode_hooked(lambda: model.unembed.register_forward_hook(lambda module, args, out: out * 2))
    assert torch.equal(hooked, softcap(2 * model.unembed(rows[0]), model.backbone.final_softcap))  # it fired
    assert buffer._flat is None or hooked.data_ptr() != buffer._flat.data_ptr()
    hooked = decode_hooked(lambda: torch.nn.modules.module.register_module_forward_hook(  # one for every module
        lambda module, args, out: out * 3 if module is model.unembed else out))
    assert torch.equal(hooked, softcap(3 * model.unembed(rows[0]), model.backbone.final_softcap))
