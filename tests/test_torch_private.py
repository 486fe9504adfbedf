"""Private PyTorch APIs (depthtools/arch/torch_private.py): fenced, hook checks with one meaning, and
every architecture's forward and backward unchanged with the public fallbacks forced."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from depthtools.arch import DepthModel, Plan, layers, list_archs, torch_private
from depthtools.config import ModelConfig

VOCAB = 41
PACKAGE = Path(__file__).resolve().parents[1] / "depthtools"
ARCHS = [spec.name for spec in list_archs()]


def build(arch, n_layer=3, d_model=16, seed=0, **options):
    cfg = ModelConfig(arch=arch, vocab_size=VOCAB, d_model=d_model, n_layer=n_layer, n_heads=2, max_seq_len=12,
                      options=options)
    model = DepthModel(cfg, seed=seed).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # off the init: gates, queries and routing matter
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def tokens(batch=2, length=7, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- the fence ---------------------------------------------------------------------------------------

PRIVATE = {
    "hook dictionaries": r"\._(forward|backward)(_pre)?_hooks\b",
    "torch._C": r"torch\._C\b",
    "aten ops": r"torch\.ops\.aten\b",
    "Tensor._base": r"\._base\b",
    "Tensor._version": r"\._version\b|[\"']_version[\"']",
    "storage use count": r"_storage_Use_Count",
}


def test_private_torch_apis_are_used_only_in_torch_private():
    """Every private PyTorch use sits behind a helper in torch_private.py (and `Tensor.data` appears in
    no other module of depthtools/arch)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "torch_private.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            for what, pattern in PRIVATE.items():
                if re.search(pattern, code):
                    found.append(f"{path.relative_to(PACKAGE)}:{i}: {what}: {line.strip()}")
            if path.parent.name == "arch" and re.search(r"\.data\b", code):
                found.append(f"{path.relative_to(PACKAGE)}:{i}: Tensor.data: {line.strip()}")
    assert not found, "\n".join(found)


# -- hooks: one meaning --------------------------------------------------------------------------------

def backward_fires(model, name, toks):
    """Whether a backward-only hook on hook point `name` is called in a backward pass."""
    calls = []
    with model.hooks(bwd_hooks=[(name, lambda grad, hook: calls.append(tuple(grad.shape)))]):
        model(toks).square().sum().backward()
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_backward_only_hooks_on_the_attention_pattern_and_final_norm_fire(arch):
    """Bug (fixed): Attention.attend and HookedRMSNorm took their fused paths unless a *forward* hook
    was attached, so a backward-only hook on blocks.{l}.attn.hook_pattern (or ln_final.hook_normalized)
    never fired; MoDA's block 0 attends plainly, so its pattern hook never fired either."""
    model, toks = build(arch), tokens()
    B, T = toks.shape
    for name, shape in (("blocks.0.attn.hook_pattern", (B, 2, T, T)), (f"blocks.{model.n_layer - 1}.attn.hook_pattern",
                                                                      (B, 2, T, T)),
                        ("ln_final.hook_normalized", (B, T, 16))):
        assert backward_fires(model, name, toks) == [shape], name


@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_backward_only_hooks_on_hc_routing_weights_fire(arch):
    """Bug (fixed): a backward-only hook on hook_width_weights / hook_res_weights moved the connector off
    its fused path, but the weights were split into the hooked tensors only for *forward* hooks, so
    the hook point was never called and the hook never fired."""
    model, toks = build(arch), tokens()
    B, T = toks.shape
    for name, shape in (("blocks.1.attn_hc.hook_width_weights", (B, T, 4)),
                        ("blocks.1.mlp_hc.hook_res_weights", (B, T, 4, 4)),
                        ("blocks.1.mlp_hc.hook_depth_weights", (B, T, 4))):
        assert backward_fires(model, name, toks) == [shape], name


def test_is_hooked_sees_every_kind_of_hook():
    from transformer_lens.hook_points import HookPoint

    point = HookPoint()
    assert not torch_private.is_hooked(point)
    for register in (point.register_forward_hook, point.register_forward_pre_hook,
                     point.register_full_backward_hook, point.register_full_backward_pre_hook):
        handle = register(lambda *a: None)
        assert torch_private.is_hooked(HookPoint(), point)
        handle.remove()
    assert not torch_private.is_hooked(point)
    with torch_private.fallbacks():
        assert torch_private.is_hooked(point)  # the fallback: "hooked", i.e. the explicit path


# -- the fallbacks --------------------------------------------------------------------------------------

def forward_backward(model, toks, plan=None):
    model.zero_grad()
    out = model.run(toks, plan=plan)
    (out.square().mean() + out.mean()).backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def never(*args, **kwargs):
    raise AssertionError("a private PyTorch API was used with the fallbacks forced")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_gives_the_default_results_with_the_fallbacks_forced(monkeypatch, arch):
    """Forward and backward of every registered architecture (intact and with a skip) with every public
    fallback forced (no private op, hook lookup, storage count, _base, .data or _version) equal the
    default path's, and training steps reuse nothing behind the fallback's back."""
    model, toks = build(arch), tokens()
    plan = Plan.skipping(1)
    want = [forward_backward(model, toks), forward_backward(model, toks, plan)]
    monkeypatch.setattr(torch_private, "_FLASH", (never, never))
    monkeypatch.setattr(torch_private, "_use_count", never)
    with torch_private.fallbacks():
        got = [forward_backward(model, toks), forward_backward(model, toks, plan)]
    for (out, grads), (out_ref, grads_ref) in zip(got, want):
        torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-10)
        for name in grads.keys() | grads_ref.keys():  # (a parameter no path used: None on one, zeros on the other)
            a, b = grads.get(name), grads_ref.get(name)
            a, b = torch.zeros_like(b) if a is None else a, torch.zeros_like(a) if b is None else b
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["moda", "attnres"])
def test_sweeps_from_cached_states_with_the_fallbacks_forced(arch):
    """Runs from cached states (MoDA copy-on-append instead of in-place slot appends; AttnRes without a
    bank) give the default results, gradients included."""
    model, toks = build(arch, n_layer=4), tokens()

    def sweep():
        model.zero_grad()
        states = model.run_states(toks)
        outs = torch.stack([model.head(states[-1]), model.run(plan=Plan.skipping(2), start=2, from_state=states[2]),
                            model.run(plan=Plan.swapping(1, 2, 4), start=1, from_state=states[1])])
        outs.square().sum().backward()
        return outs.detach(), [p.grad.clone() for p in model.parameters()]

    want = sweep()
    with torch_private.fallbacks():
        got = sweep()
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-10)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_cpu_flash_attention_only_on_cpu_and_when_present(monkeypatch):
    assert torch_private.cpu_flash_attention_ok("cpu", torch.float32)
    for device in ("cuda", "cuda:1", "mps", "meta"):
        assert not torch_private.cpu_flash_attention_ok(device)
    assert not torch_private.cpu_flash_attention_ok("cpu", torch.int64)
    monkeypatch.setattr(torch_private, "_FLASH", None)  # a PyTorch build without the op
    assert not torch_private.cpu_flash_attention_ok("cpu")
    model, toks = build("moda"), tokens()
    assert torch.isfinite(model(toks)).all()  # the explicit joint softmax


def test_environment_variable_forces_the_fallbacks():
    code = "import depthtools.arch.torch_private as t; print(t.FORCED)"
    for value, expect in (("1", "True"), ("0", "False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"DEPTHTOOLS_TORCH_FALLBACKS": value, "PATH": "", "PYTHONPATH": ":".join(sys.path)})
        assert out.stdout.strip() == expect, value


# -- buffer reuse (layers.BufferPool, torch_private.storage_unshared) -----------------------------------

def fresh_take(self, role, shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("arch", ["moda", "attnres"])
def test_two_branches_backpropagated_together_do_not_share_a_gradient_buffer(monkeypatch, arch):
    """Bug (fixed): BufferPool.take handed out a kept buffer when no other *tensor* shared its storage,
    but a MoDA slot store (or AttnRes bank) that took the buffer as its gradient accumulator holds that
    very tensor, which the storage count cannot see. Two sweeps branching from cached states and
    backpropagated together then accumulated their slot gradients into ONE buffer: MoDA's gradients
    were off by up to ~70%. Now equal to a pool that never reuses."""
    model, toks = build(arch, n_layer=5, d_model=32), tokens(length=10)

    def gradients():
        model.zero_grad()
        states = model.run_states(toks)
        outs = torch.stack([model.run(plan=Plan.skipping(2), start=2, from_state=states[2]),
                            model.run(plan=Plan.swapping(1, 3, 5), start=1, from_state=states[1])])
        outs.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    got = gradients()
    monkeypatch.setattr(layers.BufferPool, "take", fresh_take)
    for a, b in zip(got, gradients()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


# -- forward AD and torch.func transforms (the custom ops' callers take the reference there) -----------------

def test_forward_ad_active_sees_dual_tangents_and_torch_func_transforms():
    import torch.autograd.forward_ad as fwAD

    x, y = torch.randn(3), torch.randn(3)
    seen = []
    probe = lambda *ts: seen.append(torch_private.forward_ad_active(*ts)) or ts[0] * 2  # noqa: E731
    probe(x, y)
    with fwAD.dual_level():
        probe(x, y)  # a dual level, but no tangent on these tensors
        probe(y, fwAD.make_dual(x, torch.ones(3)))
    torch.func.jvp(lambda t: probe(t), (x,), (y,))
    torch.func.grad(lambda t: probe(t).sum())(x)
    torch.func.vmap(lambda t: probe(t))(x.view(3, 1))
    torch.func.jacfwd(lambda t: probe(t))(x)
    assert seen == [False, False, True, True, True, True, True]
    with torch_private.fallbacks():
        assert torch_private.forward_ad_active(x)  # the fallback: the plain-autograd reference
