"""Every fused autograd Function against its plain-autograd reference (depthtools/arch/reference.py).

Per Function, in float64 on tiny shapes: outputs, the gradients of every input for random
cotangents, and -- where it has a hand-written jvp -- forward-mode derivatives (torch.autograd.forward_ad)
equal the reference's; torch.autograd.gradcheck checks the hand-written backward (and jvp) against
finite differences. The Sinkhorn, the fused mHC connector and the two per-source bank ops already
have gradcheck tests (test_arch_hyper.py, test_arch_attnres.py); here they are compared with the
package's reference. Per model: option fused=False (every reference, no custom Function) against the
default at training shapes in float32 -- logits and every parameter gradient -- including sweeps
from cached states, skip plans and option variants.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from depthtools.arch import DepthModel, Plan, bankops, cpu_kernels, hyper, list_archs, moda, reference
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

F64 = torch.float64
# every architecture with a fused path (the option `fused` selects it), read from the registry
FUSED_ARCHS = [spec.name for spec in list_archs() if "fused" in spec.option_schema()]


def randn(*shape, seed, scale=1.0, grad=True):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
    t = scale * torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(grad)


def as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def assert_same_function(fused, ref, inputs, atol=1e-12):
    """Outputs and all input gradients (two random cotangents each) of fused(*inputs) == ref(*inputs)."""
    got, want = as_tuple(fused(*inputs)), as_tuple(ref(*inputs))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    diff = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    for seed in (10, 11):
        gs = [randn(*t.shape, seed=seed + i, grad=False) for i, t in enumerate(want)]
        g_got = torch.autograd.grad(got, diff, gs, retain_graph=True, allow_unused=True)
        g_want = torch.autograd.grad(want, diff, gs, retain_graph=True, allow_unused=True)
        for i, (a, b) in enumerate(zip(g_got, g_want)):
            a = torch.zeros_like(diff[i]) if a is None else a
            b = torch.zeros_like(diff[i]) if b is None else b
            torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=f"gradient of input {i}")


def assert_same_jvp(fused, ref, inputs, atol=1e-12):
    """Forward-mode derivatives (dual numbers) of fused == ref, for a random tangent on every input."""
    tangents = [randn(*t.shape, seed=20 + i, grad=False) if torch.is_tensor(t) else None for i, t in enumerate(inputs)]
    results = []
    for fn in (fused, ref):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(t.detach(), d) if d is not None else t for t, d in zip(inputs, tangents)]
            results.append([fwAD.unpack_dual(o).tangent for o in as_tuple(fn(*duals))])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


# -- hyper.py --------------------------------------------------------------------------------------

N, n, d = 3, 3, 4  # tokens, streams, width


def hc_inputs(seed=0):
    return (randn(N, n, d, seed=seed), randn(d, n + 1, seed=seed + 1, scale=0.7), randn(d, seed=seed + 2, scale=0.7),
            randn(n, n + 1, seed=seed + 3), randn(n, seed=seed + 4), randn((), seed=seed + 5, scale=0.5),
            randn((), seed=seed + 6, scale=0.5), 1e-8)


def mhc_inputs(first, seed=0):
    m = n * d
    return (randn(N, n, d, seed=seed), randn(m, n, seed=seed + 1, scale=0.5), randn(m, n, seed=seed + 2, scale=0.5),
            randn(m, n * n, seed=seed + 3, scale=0.5), randn((), seed=seed + 4), randn((), seed=seed + 5),
            randn((), seed=seed + 6), randn(n, seed=seed + 7), randn(n, seed=seed + 8), randn(n, n, seed=seed + 9),
            1e-6, 3, first)


JVP_CASES = {  # the Function with a hand-written jvp, and the connectors' entry points (forward AD: the reference)
    "_Update": (hyper._Update.apply, reference.stream_update,
                lambda: (randn(2, N, n, d, seed=0), randn(2, N, n, seed=1), randn(2, N, d, seed=2))),
    "hyper.hc_connect": (hyper.hc_connect, reference.hc_connect, hc_inputs),
    "hyper.mhc_connect": (hyper.mhc_connect, reference.mhc_connect, lambda: mhc_inputs(0)),
}


@pytest.mark.parametrize("name", [*JVP_CASES])
def test_functions_with_jvp_match_reference_and_pass_gradcheck(name):
    """Backward and forward mode of _Update and the HC/mHC connectors' entry points (hyper.hc_connect /
    mhc_connect: the op `depthtools::hc_connect` / `mhc_connect` on its C kernel, or, under forward AD, the
    reference): equal to the reference's autograd, and gradcheck (finite differences) with check_forward_ad."""
    if "connect" in name and cpu_kernels.library("connector") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    fused, ref, make = JVP_CASES[name]
    inputs = make()
    assert_same_function(fused, ref, inputs)
    assert_same_jvp(fused, ref, inputs)
    diff = [i for i, t in enumerate(inputs) if torch.is_tensor(t)]
    fn = lambda *xs: fused(*xs, *inputs[len(diff):])  # noqa: E731  (the tensors first, then eps / t_max / first)
    assert torch.autograd.gradcheck(fn, inputs[: len(diff)], check_forward_ad=True)


@pytest.mark.parametrize("name", ["hc_connect", "mhc_connect"])
def test_connector_ops_without_their_kernel_are_the_reference(name, monkeypatch):
    """Where the kernel does not take the inputs (forced here), hyper's entry points run the reference itself, and
    the op called directly answers from the reference (forward without autograd, backward by autograd of the
    reference): the same values and gradients, bit for bit (the entry point's mHC Sinkhorn: within an ulp), and
    gradcheck of the op's backward."""
    from depthtools.arch.ops import connector as connector_ops

    monkeypatch.setattr(cpu_kernels, "connector_usable", lambda *tensors: False)
    calls = []
    monkeypatch.setattr(connector_ops, f"{name}_op", lambda *a: calls.append(a))
    inputs = hc_inputs() if name == "hc_connect" else mhc_inputs(1)
    # (mHC's entry point keeps its Sinkhorn on the op `depthtools::sinkhorn_tokens_last`, a reciprocal per
    # half-step where reference.sinkhorn divides: within an ulp)
    assert_same_function(getattr(hyper, name), getattr(reference, name), inputs, atol=0 if name == "hc_connect" else 1e-15)
    assert calls == []  # the entry point never reached the op
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "connector_usable", lambda *tensors: False)
    op = getattr(connector_ops, name)  # the op (u, R H, β) without the kernel: the reference's outputs and gradients
    assert_same_function(op, getattr(reference, name), inputs, atol=0)
    diff = [i for i, t in enumerate(inputs) if torch.is_tensor(t)]
    assert torch.autograd.gradcheck(lambda *xs: op(*xs, *inputs[len(diff):]), inputs[: len(diff)])


def test_connector_entry_points_take_the_op_unless_forward_ad_sees_them(monkeypatch):
    """hyper.hc_connect / mhc_connect call the op (ops/connector.py) outside forward AD, and the reference inside a
    dual level with a tangent on an input or inside a torch.func transform (where the op would give a zero tangent)."""
    from depthtools.arch.ops import connector as connector_ops

    calls = []
    for name in ("hc_connect", "mhc_connect"):
        real = getattr(connector_ops, name)
        monkeypatch.setattr(connector_ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    H, *rest = hc_inputs()
    hyper.hc_connect(H, *rest)
    hyper.mhc_connect(*mhc_inputs(0))
    assert calls == ["hc_connect", "mhc_connect"]
    with fwAD.dual_level():
        hyper.hc_connect(H, *rest)  # a dual level without a tangent on these inputs: the op
        hyper.hc_connect(fwAD.make_dual(H.detach(), torch.ones_like(H)), *rest)
    assert calls == ["hc_connect", "mhc_connect", "hc_connect"]
    tangent = torch.func.jvp(lambda h: hyper.hc_connect(h, *rest)[1], (H.detach(),), (torch.ones_like(H),))[1]
    want = torch.func.jvp(lambda h: reference.hc_connect(h, *rest)[1], (H.detach(),), (torch.ones_like(H),))[1]
    torch.testing.assert_close(tangent, want, rtol=0, atol=1e-12)
    assert float(tangent.detach().abs().max()) > 0 and len(calls) == 3
    params = [t.detach() if torch.is_tensor(t) else t for t in mhc_inputs(0)[1:]]
    g = torch.func.grad(lambda h: hyper.mhc_connect(h, *params)[1].sum())(H.detach())
    (want,) = torch.autograd.grad(reference.mhc_connect(H, *params)[1].sum(), H)
    torch.testing.assert_close(g, want, rtol=0, atol=1e-12)
    assert len(calls) == 3


@pytest.mark.parametrize("path", ["c kernel", "no kernel"])
@pytest.mark.parametrize("first", [0, 1])
def test_sinkhorn_and_mhc_connector_ops_match_reference(first, path, monkeypatch):
    """The ops depthtools::sinkhorn_tokens_last (ops.sinkhorn.sinkhorn) and depthtools::mhc_connect
    (ops.connector.mhc_connect) against the reference, in both Sinkhorn orders (first = 0: the paper's rows_last;
    1: cols_last), with an underflowing line too (the clamp of a sum at the smallest normal number), each on its C
    kernel and with the kernels forced off (the Sinkhorn's plain-PyTorch twin; the connector op answering from the
    reference: its forward, and autograd of it); gradcheck of each op's backward."""
    from depthtools.arch.ops import connector as connector_ops, sinkhorn as sinkhorn_ops

    if path == "no kernel":
        monkeypatch.setattr(cpu_kernels, "usable", lambda *tensors: False)
        monkeypatch.setattr(cpu_kernels, "connector_usable", lambda *tensors: False)
    elif cpu_kernels.library("sinkhorn") is None or cpu_kernels.library("connector") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    logits = randn(2, 3, n, n, seed=0, scale=2.0)
    assert_same_function(lambda z: sinkhorn_ops.sinkhorn(z, 4, first), lambda z: reference.sinkhorn(z, 4, first),
                         (logits,))
    strong = torch.tensor([[[300.0, -300.0], [0.0, 0.0]]], dtype=F64, requires_grad=True)
    assert_same_function(lambda z: sinkhorn_ops.sinkhorn(z, 3, first), lambda z: reference.sinkhorn(z, 3, first),
                         (strong,))
    assert torch.autograd.gradcheck(lambda z: sinkhorn_ops.sinkhorn(z, 4, first), (logits,))
    inputs = mhc_inputs(first)
    assert_same_function(connector_ops.mhc_connect, reference.mhc_connect, inputs)
    assert torch.autograd.gradcheck(lambda *a: connector_ops.mhc_connect(*a, 1e-6, 3, first), inputs[:10])


@pytest.mark.parametrize("path", ["c kernel", "no kernel"])
def test_hc_connector_op_matches_reference_and_passes_gradcheck(path, monkeypatch):
    """The op depthtools::hc_connect (ops.connector.hc_connect, called directly: no forward-AD dispatch) on its C
    kernel and with the kernel forced off (the op answers from the reference): values and gradients equal the
    reference's, and gradcheck of its backward."""
    from depthtools.arch.ops import connector as connector_ops

    if path == "no kernel":
        monkeypatch.setattr(cpu_kernels, "connector_usable", lambda *tensors: False)
    elif cpu_kernels.library("connector") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    inputs = hc_inputs()
    assert_same_function(connector_ops.hc_connect, reference.hc_connect, inputs)
    assert torch.autograd.gradcheck(lambda *a: connector_ops.hc_connect(*a, 1e-8), inputs[:7])


def test_connector_modules_take_the_reference_with_fused_false():
    """HyperConnection / ManifoldHyperConnection with fused=False compute the same (u, R H, β) as the
    fused connector through `reference`, on the unhooked path and, with a weights hook, step by step."""
    torch.manual_seed(0)
    for cls, args in ((hyper.HyperConnection, (n, d, 1, 1e-8, True)),
                      (hyper.ManifoldHyperConnection, (n, d, 1, 1e-6, "uniform", 3, "rows_last"))):
        fast, slow = cls(*args).double(), cls(*args, fused=False).double()
        with torch.no_grad():
            for p in fast.parameters():
                p.add_(0.3 * torch.randn_like(p))
        slow.load_state_dict(fast.state_dict())
        H = randn(2, N, n, d, seed=1)
        assert_same_function(fast, slow, (H,))
        handle = slow.hook_res_weights.register_forward_hook(lambda m, i, o: o)
        assert_same_function(fast, slow, (H,))
        handle.remove()


# -- bankops.py ------------------------------------------------------------------------------------

def test_per_source_bank_ops_match_reference():
    """_WeightedSum (per-source and per-token weights) and _BankLogits (gradcheck in test_arch_attnres.py)."""
    vs = tuple(randn(2, 3, 5, seed=i) for i in range(4))
    rs = tuple(randn(2, 3, seed=10 + i).abs() for i in range(4))
    for w in (randn(4, seed=20), randn(2, 3, 4, seed=21)):
        assert_same_function(lambda w, *v: bankops.weighted_sum(w, v), lambda w, *v: reference.weighted_sum(w, v),
                             (w, *vs))
    assert_same_function(lambda q, *t: bankops.bank_logits(q, t[:4], t[4:]),
                         lambda q, *t: reference.bank_logits(q, t[:4], t[4:]), (randn(5, seed=30), *vs, *rs))


def bank_mixes(plan, eps=1e-5, groups=None, column_floor=0):
    """f(queries [M,d], partial [B,T,d], *sources) -> the stacked mixes of `plan` [(column, sources
    read, with partial)] over one DepthBank (fused: _Push per source, _Mix per mix) and its reference."""

    def fused(queries, partial, *sources):
        bank = bankops.DepthBank(sources[0], queries, len(sources), eps, None, groups, column_floor=column_floor)
        handles = [None]
        for v in sources:
            handles.append(bankops.bank_push(bank, handles[-1], v))
        return torch.stack([bankops.bank_mix(bank, handles[k], k, col, partial if p else None) for col, k, p in plan])

    def ref(queries, partial, *sources):
        return torch.stack([reference.depth_mix(queries[col], sources[:k] + ((partial,) if p else ()), eps)
                            for col, k, p in plan])

    return fused, ref


@pytest.mark.parametrize("kernel", ["C", "torch"])
@pytest.mark.parametrize("path", ["one-by-one", "bulk flush", "two-phase"])
def test_depth_bank_push_and_mix_match_reference_and_pass_gradcheck(monkeypatch, path, kernel):
    """_Push + _Mix (AttnRes' DepthBank: deferred, bulk-flushed source gradients; the two-phase
    grouped prefix mix) against the per-source softmax mix, and gradcheck of the whole bank; with the
    C kernels (mix, prefix, flush) and with torch ops."""
    if kernel == "torch":
        monkeypatch.setattr(cpu_kernels, "bank_usable", lambda values: False)
    elif cpu_kernels.library("bank") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    M, n_src = 3, 4
    plan = [(0, 1, True), (1, 2, False), (2, 3, True), (0, 4, False), (1, 4, True), (2, 2, True)]
    groups = None
    if path == "bulk flush":
        monkeypatch.setattr(bankops, "FLUSH_AT", 2)
    if path == "two-phase":
        monkeypatch.setattr(bankops, "TWO_PHASE_FROM", 2)
        groups = bankops.MixGroups([(1, 2), (2, 3), (0, 4)])  # a group of three mixers, n0 = 2
        plan = [(1, 2, True), (2, 3, False), (0, 4, True), (1, 3, False)]
    fused, ref = bank_mixes(plan, groups=groups)
    inputs = (randn(M, 5, seed=0), randn(2, 3, 5, seed=1), *(randn(2, 3, 5, seed=2 + i) for i in range(n_src)))
    assert_same_function(fused, ref, inputs)
    assert torch.autograd.gradcheck(fused, inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_depth_bank_kernels_at_uneven_sizes_match_reference(monkeypatch, dtype):
    """The C kernels' blocked paths: width 37 (two vector chunks and a tail), 300 tokens (two mix tiles of 128
    and a partial one), 11 sources, flushes of four or more mixes (blocks of four and a rest), a two-phase
    group whose prefix of 6 sources is a block of four and two more, a partial source, and a mixer column
    used twice; slots get key dots at push time only for columns >= slot - 1 (the scheme's `column_floor`),
    so mixes with lower columns form the rest on demand (tokens 300 also cover the 64-token prefix tiles).
    float64: within 1e-12 of the per-source reference; float32: the same inputs rounded, against the
    reference in float64, within 2e-6 of each tensor's scale."""
    if cpu_kernels.library("bank") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    monkeypatch.setattr(bankops, "FLUSH_AT", 4)
    monkeypatch.setattr(bankops, "TWO_PHASE_FROM", 6)
    groups = bankops.MixGroups([(0, 6), (1, 7), (2, 8), (3, 9)])
    plan = [(4, 2, False), (5, 4, True), (0, 6, False), (1, 7, True), (2, 8, False), (3, 9, False),
            (5, 11, False), (4, 10, True), (5, 5, False), (2, 11, False)]
    fused, ref = bank_mixes(plan, groups=groups, column_floor=1)
    B, T, d = 3, 100, 37
    inputs = (randn(6, d, seed=0, scale=0.3), randn(B, T, d, seed=1), *(randn(B, T, d, seed=2 + i) for i in range(11)))
    if dtype == torch.float64:
        assert_same_function(fused, ref, inputs)
        return
    low = tuple(x.detach().float().requires_grad_() for x in inputs)
    cotangent = randn(len(plan), B, T, d, seed=50, grad=False)
    got, want = fused(*low), ref(*inputs)
    grads_got = torch.autograd.grad(got, low, cotangent.float())
    grads_want = torch.autograd.grad(want, inputs, cotangent)
    for name, a, b in [("mixes", got, want), *((f"gradient of input {i}", a, b) for i, (a, b)
                                              in enumerate(zip(grads_got, grads_want)))]:
        scale = b.abs().max().item()
        torch.testing.assert_close(a.double(), b.detach(), rtol=0, atol=2e-6 * scale, msg=lambda m: f"{name}: {m}")


# -- moda.py ---------------------------------------------------------------------------------------

def moda_pair(H=4, Hkv=2, capacity=6, invalid=None):
    """f(q, k, v, q_depth, k0, v0, k1, v1, k2, v2) -> two MoDA attentions: over slots (k0, v0, k1, v1)
    appended to an empty cache (a fresh buffer), then over those + (k2, v2) appended in place (the
    buffer's newest state), so the slot gradients come from both readers' records. The fused
    version runs _AppendSlots and _DepthAttention; the reference, concatenation and the joint softmax."""

    def run(append, attend):
        def f(q, k, v, qd, *slots):
            k, v = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
            keys, values = append(None, None, slots[:4])
            z1 = attend(q, k, v, qd, keys, values, None if invalid is None else invalid[:2])
            keys, values = append(keys, values, slots[4:])
            z2 = attend(q, k, v, qd, keys, values, invalid)
            return z1, z2
        return f

    fused = run(lambda keys, values, new: moda._AppendSlots.apply(capacity, None, None, keys, values, *new),
                moda._DepthAttention.apply)
    return fused, run(reference.append_slots, reference.depth_attention)


@pytest.fixture(params=["C kernels", "torch ops"])
def moda_path(request, monkeypatch):
    """MoDA's depth part through the C kernels (cpu_kernels.moda_*) and through torch ops (other devices and
    dtypes, or no C compiler)."""
    if request.param == "torch ops":
        monkeypatch.setattr(cpu_kernels, "moda_usable", lambda t, kv_dtype=None: False)
    else:
        assert cpu_kernels.moda_usable(torch.zeros(1))
    return request.param


@pytest.mark.parametrize("case", ["mha", "gqa", "masked slot"])
def test_depth_attention_and_append_slots_match_reference_and_pass_gradcheck(case, moda_path):
    """_AppendSlots (fresh buffer and in-place append; slot gradients formed from the readers' records
    and from dense gradients) with _DepthAttention (PyTorch's CPU flash attention merged with the depth
    softmax): against concatenation + the explicit joint softmax, and gradcheck."""
    B, T, hd = 1, 3, 4
    H, Hkv = (2, 2) if case == "mha" else (4, 2)
    invalid = torch.tensor([False, True, False]) if case == "masked slot" else None
    fused, ref = moda_pair(H, Hkv, invalid=invalid)
    inputs = (randn(B, T, H, hd, seed=0), randn(B, T, Hkv, hd, seed=1), randn(B, T, Hkv, hd, seed=2),
              randn(B, T, H, hd, seed=3), *(randn(B, T, Hkv, hd, seed=4 + i) for i in range(6)))
    assert_same_function(fused, ref, inputs)
    assert torch.autograd.gradcheck(fused, inputs)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_depth_attention_kernels_match_reference_at_uneven_token_counts(dtype, moda_path):
    """Token counts that are not a multiple of the kernels' tile (DT = 1024), above and below it, with GQA
    and a masked slot: values and gradients against the float64 reference (float32 within 1e-4)."""
    B, T, H, Hkv, hd = 3, 400, 4, 2, 8
    invalid = torch.tensor([False, False, True])
    fused, ref = moda_pair(H, Hkv, invalid=invalid)
    inputs = (randn(B, T, H, hd, seed=0), randn(B, T, Hkv, hd, seed=1), randn(B, T, Hkv, hd, seed=2),
              randn(B, T, H, hd, seed=3), *(randn(B, T, Hkv, hd, seed=4 + i) for i in range(6)))
    assert_same_function(lambda *xs: tuple(z.double() for z in fused(*(x.to(dtype) for x in xs))), ref, inputs,
                         atol=1e-11 if dtype == F64 else 1e-4)


def test_append_slots_copy_on_branch_matches_reference(moda_path):
    """Appending to a state that is not its buffer's newest (a sweep branching from a cached state)
    copies the prefix into a fresh buffer; both branches' gradients reach the shared prefix."""
    B, T, H, hd = 1, 2, 2, 4

    def make(append, attend):
        def f(q, qd, *slots):
            k = v = q
            base = append(None, None, slots[:2])
            a = append(*base, slots[2:4])  # in place: base is the newest
            b = append(*base, slots[4:6])  # base is no longer the newest: copy-on-branch
            return attend(q, k, v, qd, *a, None), attend(q, k, v, qd, *b, None)
        return f

    fused = make(lambda keys, values, new: moda._AppendSlots.apply(4, None, None, keys, values, *new), moda._DepthAttention.apply)
    ref = make(reference.append_slots, reference.depth_attention)
    inputs = (randn(B, T, H, hd, seed=0), randn(B, T, H, hd, seed=1), *(randn(B, T, H, hd, seed=2 + i) for i in range(6)))
    assert_same_function(fused, ref, inputs)


def test_moda_retained_graph_backpropagates_twice():
    """Bug (fixed): _DepthAttention's backward dropped its depth keys/values from ctx, so a second
    backward through a retained graph (torch.autograd.grad(..., retain_graph=True) twice, as
    per-output attributions do) failed with AttributeError. Now the gradients are the same twice."""
    model = build("moda", d_model=16, n_layer=3, T=5, dtype=F64)
    toks = tokens(2, 5)
    out = model(toks)
    params = list(model.parameters())
    first = torch.autograd.grad(out[..., 0].sum(), params, retain_graph=True)
    again = torch.autograd.grad(out[..., 0].sum(), params, retain_graph=True)
    other = torch.autograd.grad(out[..., 1].sum(), params)
    want = torch.autograd.grad(model(toks)[..., 1].sum(), params)
    for a, b, c, e in zip(first, again, other, want):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, e, rtol=0, atol=1e-12)


def test_moda_pass_that_stops_short_then_a_full_pass_count_each_reader_once():
    """Bug (fixed): a backward pass over a retained graph that stopped before the lowest blocks
    (torch.autograd.grad to the upper blocks' parameters only) left its readers' slot-gradient records (before:
    side-channel sums) in the slot store, and the next full pass counted them a second time: gradients off by
    up to ~3e-3 here. Readers now replace their own record. Equal to a fresh full pass."""
    model = build("moda", d_model=32, n_layer=4, T=8, dtype=F64)
    toks = tokens(2, 8)
    params = list(model.parameters())
    want = torch.autograd.grad(model(toks).square().mean(), params)
    loss = model(toks).square().mean()
    upper = [p for name, p in model.named_parameters() if name.startswith(("blocks.2.", "blocks.3."))]
    torch.autograd.grad(loss, upper, retain_graph=True)
    for got, expected in zip(torch.autograd.grad(loss, params), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


# -- whole models: fused (default) vs fused=False ---------------------------------------------------

VOCAB = 97


def build(arch, d_model=64, n_layer=6, T=32, dtype=torch.float32, seed=0, **options):
    cfg = ModelConfig(arch=arch, vocab_size=VOCAB, d_model=d_model, n_layer=n_layer, n_heads=4,
                      n_kv_heads=options.pop("n_kv_heads", None), max_seq_len=T, options=options)
    model = DepthModel(cfg, seed=seed).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # off the init, so routing/gates/queries matter
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen).to(dtype))
    return model


def tokens(B=4, T=32, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def reference_twin(model):
    """The same weights with option fused=False."""
    cfg = model.config.replace(options={**model.config.options, "fused": False})
    twin = DepthModel(cfg).to(next(model.parameters()).dtype)
    twin.load_state_dict(model.state_dict())
    return twin


def loss_and_grads(model, fn):
    model.zero_grad()
    out = fn(model)
    (out.float().square().mean() + out.float().mean()).backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_models_agree(model, fn, rtol=1e-5, scalar_rtol=None):
    """Logits and every parameter gradient of `model` (fused) and its reference twin: elementwise
    |a - b| <= rtol·|b| + rtol·scale, scale = the tensor's largest gradient (at least 1e-3 of the model's
    largest: some gradients are zero in exact arithmetic, e.g. of the last mHC connector's H_res under
    a sum readout, and both paths then return rounding noise). The gradients of the small routing
    parameters (<= 16 elements: HC's alpha/beta scales, mHC's gates and biases) sum a term per token
    and stream that largely cancel, so in float32 their rounding is larger: scalar_rtol (default rtol)."""
    twin = reference_twin(model)
    out, grads = loss_and_grads(model, fn)
    out_ref, grads_ref = loss_and_grads(twin, fn)
    torch.testing.assert_close(out, out_ref, rtol=rtol, atol=rtol * out_ref.abs().max().item())
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    largest = max(g.abs().max().item() for g in grads_ref.values())
    for name, want in grads_ref.items():
        tol = scalar_rtol if want.numel() <= 16 and scalar_rtol is not None else rtol
        scale = max(want.abs().max().item(), 1e-3 * largest)
        torch.testing.assert_close(grads[name], want, rtol=tol, atol=tol * scale, msg=lambda m: f"{name}: {m}")


MODEL_CASES = [
    ("hc", {}), ("hc", {"connector_norm_gain": True, "head_mixer": True}),
    ("mhc", {}), ("mhc", {"sinkhorn_order": "cols_last", "mhc_init": "uniform"}),
    ("attnres", {}), ("blockattnres", {}), ("blockattnres", {"attnres_block_size": 3}),
    ("denseformer", {}), ("denseformer", {"dwa_dilation": 2}),
    ("moda", {}), ("moda", {"n_kv_heads": 2, "moda_norm": "post", "moda_depth_rope": "query"}),
]


@pytest.mark.parametrize("arch,options", MODEL_CASES, ids=[f"{a}-{'-'.join(o) or 'default'}" for a, o in MODEL_CASES])
def test_fused_model_equals_reference_model_at_training_shapes(arch, options):
    """float32, d=64, L=6, 4x32 tokens: logits and every parameter gradient of the default model equal
    those of the same weights with fused=False (no custom autograd Function anywhere) to rtol 1e-5
    (3e-4 for the small routing scales/gates/biases, see assert_models_agree); float64 at d=32, L=4 to 1e-10."""
    model = build(arch, **options)
    toks = tokens()
    assert_models_agree(model, lambda m: m(toks), rtol=1e-5, scalar_rtol=3e-4)
    small = build(arch, d_model=32, n_layer=4, T=16, dtype=F64, **options)  # and in float64, to rounding
    toks = tokens(2, 16)
    assert_models_agree(small, lambda m: m(toks), rtol=1e-10)


@pytest.mark.parametrize("arch", ["attnres", "moda", "hc"])
def test_fused_equals_reference_on_sweeps_and_skips(arch):
    """A loss over the full run and two runs from its cached states (a skip and a swap: AttnRes
    copy-on-branch banks, MoDA copy-on-branch slot buffers whose reader records meet in one
    backward) has the reference model's gradients."""
    model = build(arch, n_layer=5, dtype=F64)
    toks = tokens(2, 16)
    rules = model.scheme.skip_rules

    def sweep(m):
        states = m.run_states(toks)
        outs = [m.head(states[-1]), m.run(plan=Plan.skipping(2, rule=rules[-1]), start=2, from_state=states[2]),
                m.run(plan=Plan.swapping(1, 3, m.n_layer), start=1, from_state=states[1]),
                m.run(plan=Plan.skipping(3), start=3, from_state=states[3])]
        return torch.stack(outs)

    assert_models_agree(model, sweep, rtol=1e-10)


def test_hc_forward_mode_jvp_equals_reference():
    """torch.func.jvp through an HC model (the connectors' references and _Update's hand-written jvp; used by
    analysis.contrib) equals forward mode through the reference model."""
    model = build("hc", d_model=16, n_layer=3, T=8, dtype=F64)
    twin = reference_twin(model)
    toks = tokens(2, 8)
    state = model.run_states(toks, stop=1)[-1].detach()
    tangent = torch.randn(state.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    # (PyTorch's fused SDPA has no forward-mode derivative: hooked patterns take the explicit attention)
    patterns = [(f"blocks.{l}.attn.hook_pattern", lambda x, hook: x) for l in range(model.n_layer)]
    with model.hooks(fwd_hooks=patterns), twin.hooks(fwd_hooks=patterns):
        got = torch.func.jvp(lambda s: model.run(from_state=s, start=1), (state,), (tangent,))
        want = torch.func.jvp(lambda s: twin.run(from_state=s, start=1), (state,), (tangent,))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_option_fused_is_validated_and_round_trips(arch):
    with pytest.raises(DepthToolsError, match="fused"):
        build(arch, d_model=16, n_layer=2, T=8, fused="no")
    model = build(arch, d_model=16, n_layer=2, T=8, fused=False)
    assert model.config.options["fused"] is False
    assert ModelConfig.from_dict(model.config.to_dict()).options["fused"] is False
