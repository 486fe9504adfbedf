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
