"""The AttnRes bank and MoDA kernels as torch custom ops (depthtools/arch/ops/bank.py, ops/moda.py; issue 36 item 1):
`torch.library.opcheck` of every op (schema and declared mutations, fake impl, autograd registration, AOT dispatch)
in float32 and float64, with the C kernel and with the plain-PyTorch twin forced; kernel and twin agree through each
op; and attnres / blockattnres / denseformer / moda models build and run a forward on the `meta` device through the
fake impls, building no kernel."""

from __future__ import annotations

import pytest
import torch

from depthtools.arch import DepthModel, cpu_kernels
from depthtools.arch.ops import bank as bank_ops, moda as moda_ops
from depthtools.config import ModelConfig

DTYPES = [torch.float32, torch.float64]


def _force(monkeypatch, path: str, library: str) -> None:
    """path "kernel": the C kernel (the library must build); "twin": every op of `library` takes its torch twin."""
    if path == "twin":
        if library == "bank":
            monkeypatch.setattr(cpu_kernels, "bank_usable", lambda values: False)
        else:
            monkeypatch.setattr(cpu_kernels, "moda_usable", lambda t, kv_dtype=None: False)
    elif cpu_kernels.library(library) is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")


# -- inputs ----------------------------------------------------------------------------------------------------

def _bank(dtype, d=8, cap=5, N=40, M=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(cap, N, d, generator=gen, dtype=dtype)
    inv_rms = torch.rand(cap, N, generator=gen, dtype=dtype) + 0.5
    dots = torch.randn(cap, M, N, generator=gen, dtype=dtype)
    return gen, values, inv_rms, dots


def bank_cases(dtype):
    """{name: (op, args)}: each bank op on small inputs, its branches covered (a partial source, the two-phase
    prefix, the twin's loop and bmm mixes, a one-source and a bulk flush)."""
    cases = {}
    for d in (8, 110):  # n·d < 400: the twin's loop; above: its bmm
        gen, values, inv_rms, dots = _bank(dtype, d)
        N = values.shape[1]
        partial, p_logit = torch.randn(N, d, generator=gen, dtype=dtype), torch.randn(N, generator=gen, dtype=dtype)
        cases[f"mix d{d}"] = (bank_ops.bank_mix_forward, (values, inv_rms, dots, 4, 1, None, None, 0, None, None))
        cases[f"mix+partial d{d}"] = (bank_ops.bank_mix_forward,
                                      (values, inv_rms, dots, 5, 2, partial, p_logit, 0, None, None))
        mu, P = bank_ops._torch_prefix(values, inv_rms, dots, 2, [0, 2])
        cases[f"mix two-phase d{d}"] = (bank_ops.bank_mix_forward,
                                        (values, inv_rms, dots, 4, 2, partial, p_logit, 2, mu[1], P[:, 1]))
    gen, values, inv_rms, dots = _bank(dtype)
    N, d = values.shape[1:]
    cases["prefix"] = (bank_ops.bank_prefix, (values, inv_rms, dots, 3, [1, 0, 2]))
    K = 5
    grads = [torch.randn(N, d, generator=gen, dtype=dtype) for _ in range(K)]
    weights = [torch.rand(values.shape[0], N, generator=gen, dtype=dtype) for _ in range(K)]
    rhos = [torch.randn(N, generator=gen, dtype=dtype) for _ in range(K)]
    for lo, hi in ((2, 3), (0, 5), (1, 4)):
        acc = [torch.randn_like(values), torch.randn_like(dots), torch.randn_like(inv_rms)]
        cases[f"flush {lo}..{hi}"] = (bank_ops.bank_flush,
                                      (values, inv_rms, dots, lo, hi, grads, weights, rhos, [0, 2, 2, 1, 0], *acc))
    return cases


def moda_cases(dtype, kv_dtype=None):
    """{name: (op, args)}: each MoDA op on small inputs (GQA, a masked slot; bfloat16 slots with float32)."""
    gen = torch.Generator().manual_seed(0)
    S, Hkv, g, hd, B, T = 3, 2, 2, 4, 2, 5
    H, N = Hkv * g, B * T
    kv = dtype if kv_dtype is None else kv_dtype
    K, V = (torch.randn(S, Hkv, hd, N, generator=gen, dtype=dtype).to(kv) for _ in range(2))
    q, o, dz = (torch.randn(B, T, H, hd, generator=gen, dtype=dtype) for _ in range(3))
    lse_seq = torch.randn(B, T, H, generator=gen, dtype=dtype)
    invalid = torch.tensor([False, True, False])
    cases = {}
    for mask in (None, invalid):
        name = "" if mask is None else " masked"
        cases["forward" + name] = (moda_ops.moda_forward, (K, V, q, o, lse_seq, mask, 0.5))
        z, _, probs, qs = moda_ops._depth_forward(K.to(dtype), V.to(dtype), q, o, lse_seq, mask, 0.5)
        cases["backward" + name] = (moda_ops.moda_backward, (K, V, z, dz, probs, mask, 0.5))
    _, ds, dzt = moda_ops._depth_backward(K.to(dtype), V.to(dtype), z, dz, probs, invalid, 0.5)
    records = [(ds, probs, qs, dzt, S), (ds[:2], probs[:2], dzt.flip(0).contiguous(), qs, 2)]
    columns = [list(c) for c in zip(*records)]
    for add in (False, True):
        gk, gv = (torch.randn(S - 1, B, T, Hkv, hd, generator=gen, dtype=dtype) for _ in range(2))
        cases[f"slot grads add={add}"] = (moda_ops.moda_slot_grads, (*columns, 1, S, gk, gv, add))
    src = torch.randn(B, T, 2, Hkv, hd, generator=gen, dtype=dtype)[:, :, 1]  # a strided view
    cases["store slot"] = (moda_ops.moda_store_slot, (src, torch.zeros(Hkv, hd, B, T, dtype=kv)))
    return cases


def _clone(args):
    return [[x.clone() for x in a] if isinstance(a, list) and a and torch.is_tensor(a[0])
            else a.clone() if torch.is_tensor(a) else a for a in args]


def _run(op, args, copy: bool = True):
    """The op's outputs, or for a mutating op the tensors it mutated, on a copy of args (copy=False: on args)."""
    args = _clone(args) if copy else list(args)
    out = op(*args)
    if out is not None:
        return list(out)
    return {bank_ops.bank_flush: args[-3:], moda_ops.moda_slot_grads: args[-3:-1],
            moda_ops.moda_store_slot: args[-1:]}[op]


# -- opcheck ---------------------------------------------------------------------------------------------------

def _opcheck(name, op, args):
    try:
        torch.library.opcheck(op, _clone(args))
    except Exception as exc:
        raise AssertionError(f"{name}: {exc}") from exc


@pytest.mark.parametrize("path", ["kernel", "twin"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bank_ops_pass_opcheck(monkeypatch, path, dtype):
    _force(monkeypatch, path, "bank")
    for name, (op, args) in bank_cases(dtype).items():
        _opcheck(name, op, args)


@pytest.mark.parametrize("path", ["kernel", "twin"])
@pytest.mark.parametrize("dtype", DTYPES + ["bf16 slots"])
def test_moda_ops_pass_opcheck(monkeypatch, path, dtype):
    _force(monkeypatch, path, "moda")
    cases = moda_cases(torch.float32, torch.bfloat16) if dtype == "bf16 slots" else moda_cases(dtype)
    for name, (op, args) in cases.items():
        _opcheck(name, op, args)


# -- the kernel and the twin agree through each op --------------------------------------------------------------

@pytest.mark.parametrize("library", ["bank", "moda"])
def test_kernel_and_twin_agree_through_each_op(monkeypatch, library):
    """float64: every output (or mutated tensor) of every op within 1e-6 relative (measured: ~1e-15)."""
    if cpu_kernels.library(library) is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    cases = (bank_cases if library == "bank" else moda_cases)(torch.float64)
    kernel = {name: _run(op, args) for name, (op, args) in cases.items()}
    _force(monkeypatch, "twin", library)
    twin = {name: _run(op, args) for name, (op, args) in cases.items()}
    for name in cases:
        for i, (a, b) in enumerate(zip(kernel[name], twin[name], strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype, (name, i)
            scale = max(b.abs().max().item(), 1e-30)
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * scale, msg=lambda m: f"{name} output {i}: {m}")


# -- the meta device -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["attnres", "blockattnres", "denseformer", "moda"])
def test_a_model_on_meta_runs_a_forward_through_the_fake_impls(monkeypatch, arch):
    """A model built on `meta` runs its forward there: the bank / MoDA ops take their fake impls (the AttnRes
    models' mixes and prefixes, MoDA's slot stores: it attends through the explicit joint softmax off CPU), and no
    kernel library is built or even looked up."""
    looked_up = []
    monkeypatch.setattr(cpu_kernels, "_libs", {})
    monkeypatch.setattr(cpu_kernels, "library", lambda name="sinkhorn", folder=None: looked_up.append(name))
    cfg = ModelConfig(arch=arch, vocab_size=64, d_model=16, n_layer=4, n_heads=2, max_seq_len=8)
    with torch.device("meta"):
        model = DepthModel(cfg, seed=0)
        tokens = torch.zeros(2, 8, dtype=torch.long)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logits = model(tokens)
    assert logits.shape == (2, 8, 64) and logits.device.type == "meta"
    ops = {e.name for e in prof.events() if e.name.startswith("depthtools::")}
    want = {"attnres": {"depthtools::bank_mix_forward"}, "blockattnres": {"depthtools::bank_mix_forward"},
            "denseformer": set(), "moda": {"depthtools::moda_store_slot"}}[arch]
    assert want <= ops, ops
    assert looked_up == [] and cpu_kernels._libs == {}


# -- torch.compile -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("library", ["bank", "moda"])
def test_the_ops_trace_whole_under_torch_compile(library):
    """torch.compile traces every op as one opaque node (fullgraph: no graph break; aot_eager: through AOT
    autograd's functionalisation of the mutating ops, no inductor build) and gives the eager results, bit for bit."""
    for name, (op, args) in (bank_cases if library == "bank" else moda_cases)(torch.float64).items():
        torch._dynamo.reset()  # (one code object for every case: a fresh cache each)
        compiled = torch.compile(lambda *a, _op=op: _run(_op, a), backend="aot_eager", fullgraph=True, dynamic=False)
        for i, (a, b) in enumerate(zip(compiled(*_clone(args)), _run(op, args), strict=True)):
            assert torch.equal(a, b), (name, i)


def test_strided_inputs_and_outputs_are_taken_as_they_are(monkeypatch):
    """The kernels need dense rows: an op given strided inputs reads contiguous copies, and one given a strided
    tensor to write into (a flush's gradient buffer, a slot store's destination) takes its twin; either way the
    results equal the twin's on the same tensors."""
    if cpu_kernels.library("bank") is None or cpu_kernels.library("moda") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")

    def strided(x):  # the same values, every other element of a buffer twice the size
        return torch.stack([x, torch.full_like(x, float("nan"))], -1)[..., 0]

    cases = {**bank_cases(torch.float64), **moda_cases(torch.float64)}
    dense = {name: _run(op, args) for name, (op, args) in cases.items()}
    restride = (lambda a: [strided(x) for x in a] if isinstance(a, list) and a and torch.is_tensor(a[0])
                else strided(a) if torch.is_tensor(a) and a.dtype.is_floating_point else a)
    for name, (op, args) in cases.items():
        given = [restride(a) for a in args]  # (new tensors: the cases stay as they are)
        assert any(torch.is_tensor(a) and not a.is_contiguous() for a in given)
        for a, b in zip(_run(op, given, copy=False), dense[name], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
