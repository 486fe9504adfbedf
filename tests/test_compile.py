"""Compiled training (issue 20): compiled regions vs the eager reference, the compile setting and its
"auto" rule, device dispatch without a GPU, and hooks that always see the eager path."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from depthtools.arch import DepthModel, compiled
from depthtools.arch.moda import fused_kernel_for
from depthtools.arch.ops import connector as connector_ops
from depthtools.arch.torch_private import cpu_flash_attention_ok
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.train import loop as train_loop

from tiny_models import SMALL, one_thread  # noqa: F401  (one intra-op thread for this module)

# float32 tolerance: a compiled graph fuses elementwise chains and may reorder reductions of up to
# d x T = 16 x 8 terms; each reordering moves a sum by a few ulps (eps = 1.2e-7), and ~10 such
# steps per block chain through 2 blocks and the backward. Observed differences are ~1e-6 relative;
# 1e-4 relative (on the scale of each tensor) is far below any real bug (a dropped term, a wrong
# branch: O(1e-2) or more) and far above reordering noise.
RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """Inductor's cache in a temporary folder (a test must not fill ~/.cache)."""
    import os

    before = os.environ.get(compiled.CACHE_ENV)
    os.environ[compiled.CACHE_ENV] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if before is None:
        os.environ.pop(compiled.CACHE_ENV, None)
    else:
        os.environ[compiled.CACHE_ENV] = before


def _model(arch: str, **options) -> DepthModel:
    cfg = ModelConfig(arch=arch, vocab_size=64, d_model=16, n_layer=2, n_heads=2, max_seq_len=8, options=options)
    model = DepthModel(cfg, seed=0).train()
    with torch.no_grad():  # move every parameter off its init, so zero-init gates and queries hide nothing
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _loss_and_grads(model: DepthModel, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(float(b.abs().max()), 1e-6)
    err = float((a - b).abs().max()) / scale
    assert err <= RTOL, f"{what}: compiled vs eager differ by {err:.2e} of the tensor's scale (> {RTOL})"


# one architecture per compiled region and connector kind: the norm family's step, HC's and mHC's
# (references + the opaque Sinkhorn op) and AttnRes' sublayer cores
@pytest.mark.parametrize("arch", ["preln", "hc", "mhc", "attnres"])
def test_compiled_training_step_matches_eager(arch):
    model = _model(arch)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    eager_logits, eager_grads = _loss_and_grads(model, tokens)
    assert compiled.enable(model)
    calls = []
    step = model.compiled.step
    model.compiled.step = lambda *a: calls.append(a[0]) or step(*a)
    logits, grads = _loss_and_grads(model, tokens)
    assert calls == [0, 1], "the compiled region did not run"
    _close(logits, eager_logits, "logits")
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        _close(grad, eager_grads[name], f"grad {name}")
    with torch.no_grad():  # evaluation stays eager: bit-identical to the eager model
        compiled.disable(model)
        reference = model(tokens[:, :-1])
        compiled.enable(model)
        assert torch.equal(model(tokens[:, :-1]), reference)


def test_hooks_and_plans_bypass_the_compiled_region():
    """A hooked block, run_with_cache, and a swap plan run eagerly (the compiled region must not run:
    here it raises), and hooks fire as on the eager model."""
    from depthtools.arch import Plan

    model = _model("hc")
    model.compiled = compiled.CompiledRegions(model)

    def refuse(*args):
        raise AssertionError("compiled region ran")

    model.compiled.step = refuse
    tokens = torch.randint(0, 64, (2, 8))
    with pytest.raises(AssertionError, match="compiled region ran"):
        model(tokens)  # unhooked training forward: compiled
    seen = []
    for block in model.blocks:
        block.hook_attn_out.add_hook(lambda t, hook: seen.append(hook.name))
    model(tokens).sum().backward()
    assert seen == ["blocks.0.hook_attn_out", "blocks.1.hook_attn_out"]
    model.reset_hooks()
    _, cache = model.run_with_cache(tokens)
    assert "blocks.1.hook_streams_post" in cache
    model.run(tokens, plan=Plan.swapping(0, 1, 2))  # blocks at other positions: eager
    with torch.no_grad():
        model(tokens)  # evaluation: eager


def test_compile_setting_reads_old_configs_and_refuses_bad_values():
    assert TrainConfig().compile == "auto"
    assert TrainConfig(compile=True).compile == "on" and TrainConfig(compile=False).compile == "off"
    assert TrainConfig.from_dict({"compile": True}).compile == "on"
    assert TrainConfig.from_json(TrainConfig(compile="off").to_json()).compile == "off"
    with pytest.raises(DepthToolsError, match=r"unknown compile 'fast'; valid: auto, on, off"):
        TrainConfig(compile="fast")
    # compile changes how fast, not what is trained: the run fingerprint ignores it (old runs resume)
    model_cfg = ModelConfig(arch="preln", **SMALL)
    prints = {train_loop.run_fingerprint(model_cfg, TrainConfig(compile=c), "data") for c in (False, True, "auto")}
    assert len(prints) == 1


def test_cli_compile_option(tmp_path):
    from cli.main import app

    result = CliRunner().invoke(app, ["train", "--arch", "preln", "--layers", "2", "--d-model", "32",
                                      "--compile", "maybe", "--data", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown compile 'maybe'; valid: auto, on, off" in result.output
    result = CliRunner().invoke(app, ["grid", "train", "--preset", "tiny", "--compile", "sometimes",
                                      "--root", str(tmp_path)])
    assert result.exit_code == 2 and "unknown compile 'sometimes'" in result.output


def test_auto_compiles_long_runs_only(monkeypatch):
    monkeypatch.setattr(compiled, "backend_for", lambda device: "inductor")
    cpu = torch.device("cpu")
    # CI-sized: the tiny preset's cells and the tests' runs
    assert compiled.decide("auto", "step", 300, 16 * 128, 4, 64, cpu)[0] == "off"
    assert compiled.decide("auto", "step", 40, 8 * 32, 2, 32, cpu)[0] == "off"
    # the benchmark's run: L32 d64, 500 steps of 8x128 -> ~37 s saved vs ~30 s compile
    assert compiled.decide("auto", "step", 500, 8 * 128, 32, 64, cpu)[0] == "on"
    assert compiled.decide("auto", "step", 100, 8 * 128, 32, 64, cpu)[0] == "off"
    assert compiled.decide("auto", "none", 10**6, 8 * 128, 32, 64, cpu)[0] == "off"
    assert compiled.decide("off", "step", 10**6, 8 * 128, 32, 64, cpu)[0] == "off"
    assert compiled.decide("on", "step", 1, 1, 1, 1, cpu)[0] == "on"
    cuda = torch.device("cuda")
    assert compiled.decide("auto", "step", 999, 8 * 128, 32, 64, cuda)[0] == "off"
    assert compiled.decide("auto", "step", 5000, 8 * 128, 32, 64, cuda)[0] == "on"
    monkeypatch.setattr(compiled, "backend_for", lambda device: None)
    choice, why = compiled.decide("on", "step", 10**6, 8 * 128, 32, 64, cuda)
    assert choice == "off" and "no compiler backend" in why


def test_dispatch_by_device_type_without_a_gpu(monkeypatch):
    """CUDA gets Triton only at compute capability >= 7.0 with Triton installed; no CPU-only kernel
    (the private CPU flash attention behind MoDA's fused path, the MoDA depth-attention, HC/mHC connector and
    AttnRes bank C kernels) is selected for a CUDA or meta tensor."""
    import importlib.util

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else None)
    assert compiled.backend_for(cuda) == "inductor"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (6, 1))
    assert compiled.backend_for(cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert compiled.backend_for(cuda) is None
    assert compiled.backend_for(torch.device("meta")) is None
    assert not cpu_flash_attention_ok(cuda, torch.float32) and not fused_kernel_for(cuda)
    assert cpu_flash_attention_ok(torch.device("cpu"), torch.float32)
    # the connector C kernels: never for a non-CPU tensor, eagerly or in a compiled step
    from depthtools.arch import cpu_kernels

    meta = torch.empty(8, 4, 16, device="meta")
    assert not cpu_kernels.connector_usable(meta)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not connector_ops.uses_op(meta) and connector_ops.uses_op(torch.empty(8, 4, 16))
    # AttnRes' bank kernels: a bank on a non-CPU device takes torch ops
    from depthtools.arch.bankops import DepthBank

    assert not DepthBank(meta, torch.empty(3, 16, device="meta"), 4, 1e-5, None).kernel
    assert DepthBank(torch.empty(8, 4, 16), torch.empty(3, 16), 4, 1e-5, None).kernel == (
        cpu_kernels.library("bank") is not None)
    # MoDA's depth-attention kernels: CPU float32/float64 only (other devices never reach _DepthAttention:
    # fused_kernel_for above; a CPU half-precision model takes its torch ops)
    assert not cpu_kernels.moda_usable(meta) and not cpu_kernels.moda_usable(torch.empty(2, dtype=torch.bfloat16))
    assert cpu_kernels.moda_usable(torch.empty(2)) == (cpu_kernels.library("moda") is not None)
    # bfloat16 slots (option moda_kv_dtype) with float32 arithmetic only
    assert cpu_kernels.moda_usable(torch.empty(2), torch.bfloat16) == (cpu_kernels.library("moda") is not None)
    assert not cpu_kernels.moda_usable(torch.empty(2, dtype=torch.float64), torch.bfloat16)


def test_sinkhorn_op_kernel_matches_its_twin(monkeypatch):
    """The op the compiled and eager mHC paths use (depthtools::sinkhorn_tokens_last): forward and gradient on its
    C kernel equal those of its plain-PyTorch twin (forced), and hyper.sinkhorn_knopp calls it."""
    from depthtools.arch import cpu_kernels, hyper
    from depthtools.arch.ops import sinkhorn as sinkhorn_ops

    if cpu_kernels.library("sinkhorn") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    logits = torch.randn(3, 5, 4, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 5, 4, 4, dtype=torch.float64)
    for first, order in ((0, "rows_last"), (1, "cols_last")):
        a = sinkhorn_ops.sinkhorn(logits, 7, first)
        (ga,) = torch.autograd.grad(a, logits, grad)
        assert torch.equal(a, hyper.sinkhorn_knopp(logits, 7, order))
        with monkeypatch.context() as m:
            m.setattr(cpu_kernels, "usable", lambda *tensors: False)
            b = sinkhorn_ops.sinkhorn(logits, 7, first)
            (gb,) = torch.autograd.grad(b, logits, grad)
        assert torch.allclose(a, b, atol=1e-12) and torch.allclose(ga, gb, atol=1e-12)


def test_trainer_records_the_resolved_decision(data_dir, tmp_path):
    """A CI-sized run with the default "auto" trains eagerly and says so in config.json."""
    from depthtools.train import train_cell

    recipe = TrainConfig(tokens=8 * 32 * 3, batch_size=8, seq_len=32, eval_tokens=256, eval_every=0,
                         log_every=1, depth_stats_every=0, checkpoint_every=0, threads=1)
    train_cell(ModelConfig(arch="hc", **SMALL), recipe, data_dir, tmp_path / "cell")
    record = json.loads((tmp_path / "cell" / "config.json").read_text())["train_resolved"]["compile"]
    assert record["setting"] == "auto" and record["resolved"] == "off" and record["why"].startswith("auto:")


def test_compiled_training_resumes_bit_identically_after_an_interruption(data_dir, tmp_path):
    """The trainer's promise (kill, resume, same weights and metrics) holds for a compiled run too: a
    preln cell trained straight through with compile="on" equals one interrupted after its step-4
    checkpoint and resumed in a fresh model (whose compiled region is rebuilt)."""
    from depthtools.checkpoint import read_metrics, read_tensors
    from depthtools.train import train_cell

    from tiny_models import train_killed_after

    recipe = TrainConfig(tokens=8 * 32 * 8, batch_size=8, seq_len=32, eval_tokens=256, eval_every=0, log_every=1,
                         depth_stats_every=0, checkpoint_every=4, threads=1, compile="on")
    model = ModelConfig(arch="preln", **SMALL)
    straight = train_cell(model, recipe, data_dir, tmp_path / "straight")
    train_killed_after(6, model, recipe, data_dir, tmp_path / "resumed")  # its last checkpoint: step 4
    resumed = train_cell(model, recipe, data_dir, tmp_path / "resumed")
    assert resumed["resumed_from"] == 4
    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert config["train_resolved"]["compile"]["resolved"] == "on", config["train_resolved"]["compile"]
    a, b = read_tensors(tmp_path / "straight" / "model.safetensors"), read_tensors(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]  # noqa: E731
    assert strip(read_metrics(tmp_path / "resumed")) == strip(read_metrics(tmp_path / "straight"))
    assert straight["train_loss"] == resumed["train_loss"]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sinkhorn_cpu_kernel_matches_the_reference(dtype, tol):
    """The C kernel behind the compiled path's Sinkhorn op (cpu_kernels) against the plain-autograd
    reference: values and gradients, both orders, token counts around its block size, several t_max."""
    from depthtools.arch import cpu_kernels, reference
    from depthtools.arch.ops import sinkhorn as sinkhorn_ops

    if cpu_kernels.library() is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    gen = torch.Generator().manual_seed(0)
    for tokens, t_max in ((1, 20), (63, 1), (65, 7), (200, 20)):
        for first in (0, 1):
            logits = (4 * torch.randn(tokens, 4, 4, generator=gen, dtype=torch.float64)).to(dtype).requires_grad_(True)
            grad = torch.randn(tokens, 4, 4, generator=gen, dtype=torch.float64).to(dtype)
            want = reference.sinkhorn(logits, t_max, first)
            (want_grad,) = torch.autograd.grad(want, logits, grad)
            z = logits.detach().permute(1, 2, 0).contiguous()
            got = sinkhorn_ops.kernel_forward(z, t_max, first).permute(2, 0, 1)
            got_grad = sinkhorn_ops.kernel_backward(z, grad.permute(1, 2, 0).contiguous(), t_max, first).permute(2, 0, 1)
            assert float((got - want.detach()).abs().max()) <= tol, (tokens, t_max, first)
            assert float((got_grad - want_grad).abs().max()) <= tol * float(want_grad.abs().max()), (tokens, t_max, first)
    assert not cpu_kernels.usable(torch.zeros(4, 4, 3, dtype=torch.float16))
    assert not cpu_kernels.usable(torch.zeros(4, 3, 4).transpose(1, 2))


def test_unrolled_stream_mix_matches_bmm():
    """The compiled path's stream mix (n multiply-adds per row) equals [w; R] @ H, values and gradients."""
    from depthtools.arch import reference

    gen = torch.Generator().manual_seed(0)
    routing = torch.randn(6, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    H = torch.randn(6, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    u, mixed = reference.stream_mix_unrolled(routing, H)
    out = routing @ H
    assert torch.allclose(u, out[:, 0], rtol=0, atol=1e-14) and torch.allclose(mixed, out[:, 1:], rtol=0, atol=1e-14)
    g = torch.randn(6, 5, 8, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad((u * g[:, 0]).sum() + (mixed * g[:, 1:]).sum(), (routing, H))
    want = torch.autograd.grad((out * g).sum(), (routing, H))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-13) for a, b in zip(got, want))


def _hc_inputs(tokens: int, n: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Streams, HC connector parameters off their init (scale ~0.5 so tanh is used well past its linear
    part) and output gradients, drawn in float64 then cast."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    params = [draw(tokens, n, d), draw(d, n + 1, s=0.3), draw(d, s=0.3), draw(n, n + 1), draw(n), draw((), s=0.5),
              draw((), s=0.5)]
    grads = [draw(tokens, d), draw(tokens, n, d), draw(tokens, n)]
    return params, grads


def _hc_forward_backward(connect, params, grads):
    """Outputs and input gradients of connect(*params[, eps]) for output gradients `grads`."""
    leaves = [p.clone().requires_grad_(True) for p in params]
    out = connect(*leaves, 1e-8) if len(params) == 7 else connect(*leaves)
    return [t.detach() for t in (*out, *torch.autograd.grad(out, leaves, grads))]


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hc_connector_op_matches_the_reference(kernel, dtype, monkeypatch):
    """The compiled HC step's opaque connector (`depthtools::hc_connect`: the fused C kernel, or its torch
    fallback where the kernel does not apply) against the plain-autograd reference in float64 on the same
    inputs: (u, R H, β) and the gradients of the streams and all six parameters, for several token
    counts, stream counts and widths (odd ones too: the kernel's vector loops have remainders).
    float64: to 1e-12 of each tensor's scale. float32: within 2e-6 of the scale, or within 5x the error
    of the reference itself run in float32: token sums of the parameter gradients cancel (the sum is
    ~100x smaller than its terms for ds_beta here), which amplifies rounding, and the kernel's tanh
    is within 4 ulp where torch's is within ~1 (measured worst: 1.5e-5 vs the reference's 3.4e-6)."""
    from depthtools.arch import cpu_kernels, reference

    if kernel == "c" and cpu_kernels.library("connector") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    if kernel == "torch":
        monkeypatch.setattr(cpu_kernels, "connector_usable", lambda *tensors: False)
    names = ("u", "R H", "beta", "dH", "dW_a", "dw_b", "dS_a", "ds_b", "ds_a", "ds_beta")
    for tokens, n, d in ((1, 4, 64), (63, 4, 16), (200, 2, 7), (33, 5, 33)):
        params, grads = _hc_inputs(tokens, n, d, dtype)
        exact = _hc_forward_backward(reference.hc_connect, [p.double() for p in params], [g.double() for g in grads])
        got = _hc_forward_backward(connector_ops.hc_connect, params, grads)
        same_dtype = _hc_forward_backward(reference.hc_connect, params, grads)
        for name, a, b, c in zip(names, got, exact, same_dtype):
            scale = max(float(b.abs().max()), 1e-30)
            err = float((a.double() - b).abs().max()) / scale
            bound = 1e-12 if dtype == torch.float64 else max(2e-6, 5 * float((c.double() - b).abs().max()) / scale)
            assert err <= bound, f"{kernel} {dtype} tokens={tokens} n={n} d={d}: {name} off by {err:.1e} (> {bound:.1e})"


def _mhc_inputs(tokens: int, n: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Streams, mHC connector parameters (projections, gates, biases: strong enough that the sigmoids and
    the Sinkhorn are far from their linear parts) and output gradients."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda *shape, s=1.0: (s * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    params = [draw(tokens, n, d), draw(n * d, n, s=0.3), draw(n * d, n, s=0.3), draw(n * d, n * n, s=0.3), draw(()),
              draw(()), draw(()), draw(n), draw(n), draw(n, n, s=2.0)]
    return params, [draw(tokens, d), draw(tokens, n, d), draw(tokens, n)]


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mhc_connector_op_matches_the_reference(kernel, dtype, monkeypatch):
    """The compiled mHC step's opaque connector (`depthtools::mhc_connect`: the fused C kernel with the
    Sinkhorn inside, or, where the kernel does not apply, the reference the op falls back to) against the float64
    reference: outputs and the gradients of the streams and all nine parameters, both Sinkhorn orders,
    token counts around the kernel's block of 64. Bounds as for HC (the kernel's exp is within 2 ulp)."""
    from depthtools.arch import cpu_kernels, reference

    if kernel == "c" and cpu_kernels.library("connector") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    if kernel == "torch":
        monkeypatch.setattr(cpu_kernels, "connector_usable", lambda *tensors: False)
    for (tokens, n, d, t_max), first in zip(((1, 4, 16, 20), (63, 4, 8, 7), (130, 2, 8, 20), (65, 3, 5, 3)), (0, 1, 0, 1)):
        params, grads = _mhc_inputs(tokens, n, d, dtype)

        def connect(fn):
            return lambda *xs: fn(*xs[:10], 1e-6, t_max, first)

        exact = _hc_forward_backward(connect(reference.mhc_connect), [p.double() for p in params],
                                     [g.double() for g in grads])
        got = _hc_forward_backward(connect(connector_ops.mhc_connect), params, grads)
        same_dtype = _hc_forward_backward(connect(reference.mhc_connect), params, grads)
        for i, (a, b, c) in enumerate(zip(got, exact, same_dtype)):
            scale = max(float(b.abs().max()), 1e-30)
            err = float((a.double() - b).abs().max()) / scale
            bound = 1e-12 if dtype == torch.float64 else max(2e-6, 5 * float((c.double() - b).abs().max()) / scale)
            assert err <= bound, f"{kernel} {dtype} tokens={tokens} n={n} d={d}: output/grad {i} off by {err:.1e} (> {bound:.1e})"


@pytest.mark.parametrize("path", ["c kernel", "twin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_op_registration(path, dtype, monkeypatch):
    """torch.library.opcheck of every op in depthtools/arch/ops (schema, fake vs real, autograd registration, AOT
    dispatch) on small CPU inputs, on the C kernels and with them forced off (the Sinkhorn's torch twin, the
    connectors' reference fallback): the forward ops with
    inputs that require grad, the backward ops (no autograd of their own) with inputs that do not."""
    from depthtools.arch import cpu_kernels
    from depthtools.arch.ops import sinkhorn as sinkhorn_ops  # noqa: F401  (registers the Sinkhorn ops)

    if path == "twin":
        monkeypatch.setattr(cpu_kernels, "usable", lambda *tensors: False)
        monkeypatch.setattr(cpu_kernels, "connector_usable", lambda *tensors: False)
    elif cpu_kernels.library("connector") is None or cpu_kernels.library("sinkhorn") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    ops = torch.ops.depthtools
    grad = lambda xs: [x.detach().clone().requires_grad_(True) for x in xs]  # noqa: E731
    plain = lambda xs: [x.detach().clone() for x in xs]  # noqa: E731
    params, (gu, gm, gd) = _hc_inputs(5, 4, 8, dtype)
    g_out = torch.cat([gu[:, None], gm], 1)
    torch.library.opcheck(ops.hc_connect.default, (*grad(params), 1e-8))
    _, _, raw, inv, t = ops.hc_connect(*params, 1e-8)
    if path == "c kernel":  # (the backward ops are the kernels' only: without them the forward op's autograd
        # takes autograd of the reference, which the forward opcheck covers)
        torch.library.opcheck(ops.hc_connect_backward.default, (*plain(params), raw, inv, t, g_out, gd))
    params, (gu, gm, gd) = _mhc_inputs(5, 4, 8, dtype)
    g_out = torch.cat([gu[:, None], gm], 1)
    for first in (0, 1):
        torch.library.opcheck(ops.mhc_connect.default, (*grad(params), 1e-6, 4, first))
        _, _, raw, inv = ops.mhc_connect(*params, 1e-6, 4, first)
        if path == "c kernel":
            torch.library.opcheck(ops.mhc_connect_backward.default, (*plain(params), raw, inv, g_out, gd, 4, first))
        z = torch.randn(4, 4, 70, dtype=dtype, generator=torch.Generator().manual_seed(first))
        torch.library.opcheck(ops.sinkhorn_tokens_last.default, (z.clone().requires_grad_(True), 5, first))
        torch.library.opcheck(ops.sinkhorn_tokens_last_backward.default, (torch.randn_like(z), z, 5, first))


def test_ops_run_on_the_meta_device_through_their_fake_implementations():
    """A forward of HC and mHC models on `meta` runs through the ops (their fake implementations) and builds no
    kernel library (nothing is attempted: cpu_kernels never sees a CPU tensor)."""
    from depthtools.arch import DepthModel, cpu_kernels

    attempted = set(cpu_kernels._libs)
    for arch in ("hc", "mhc"):
        cfg = ModelConfig(arch=arch, vocab_size=32, d_model=16, n_layer=2, n_heads=2, max_seq_len=8)
        with torch.device("meta"):
            model = DepthModel(cfg, seed=0)
        logits = model(torch.zeros(2, 8, dtype=torch.long, device="meta"))
        assert logits.device.type == "meta" and logits.shape == (2, 8, 32)
    assert set(cpu_kernels._libs) == attempted


def test_connector_kernel_tanh_and_exp_are_accurate():
    """The C connector kernels' vectorisable float32 tanh and exp: tanh within 4 ulp (relative) of float64
    tanh over [-12, 12], exact at 0 and ±inf, NaN for NaN; exp within 2 ulp over [-87, 88] (where its
    value is a normal float), NaN for NaN."""
    from depthtools.arch import cpu_kernels

    if cpu_kernels.library("connector") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    x = torch.linspace(-12, 12, 400_001)
    got, want = connector_ops.tanh_f32(x).double(), torch.tanh(x.double())
    rel = (got - want).abs() / want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert float(rel[want != 0].max()) <= 4 * torch.finfo(torch.float32).eps
    special = connector_ops.tanh_f32(torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30]))
    assert special[:4].tolist() == [0.0, 0.0, 1.0, -1.0] and torch.isnan(special[4]) and special[5] == 1e-30
    x = torch.linspace(-87, 88, 400_001)
    got, want = connector_ops.exp_f32(x).double(), torch.exp(x.double())
    assert float(((got - want).abs() / want).max()) <= 2 * torch.finfo(torch.float32).eps
    assert torch.isnan(connector_ops.exp_f32(torch.tensor([float("nan")]))).all()


def test_connector_kernels_do_not_depend_on_the_thread_count():
    """The connector kernels split tokens over torch's intra-op threads, and sum parameter gradients per
    fixed chunk of tokens, then over the chunks in order: 1 and 3 threads give bit-identical results."""
    from depthtools.arch import cpu_kernels

    if cpu_kernels.library("connector") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    (H, Wa, wb, Sa, sb, sa, sbeta), (gu, gm, gd) = _hc_inputs(700, 4, 16, torch.float32)
    g_out = torch.cat([gu[:, None], gm], 1).contiguous()
    Pt, S = torch.cat([Wa, wb[:, None]], 1).t().contiguous(), torch.cat([Sa, sb[:, None]], 1).contiguous()
    scale = torch.cat([sa.expand(5), sbeta[None]]).contiguous()
    (_, pp, po, pr, g1, g2, g3, bp, bq, br), _ = _mhc_inputs(700, 4, 16, torch.float32)
    PhiT, gates = torch.cat([pp, po, pr], 1).t().contiguous(), torch.stack([g1, g2, g3])
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            hc = connector_ops.hc_kernel_forward(H, Pt, S, scale, 1e-8)
            hc_grads = connector_ops.hc_kernel_backward(H, Pt, S, scale, *hc[2:], g_out, gd)
            mhc = connector_ops.mhc_kernel_forward(H, PhiT, gates, bp, bq, br.reshape(-1), 1e-6, 20, 0)
            mhc_grads = connector_ops.mhc_kernel_backward(H, PhiT, gates, bp, bq, br.reshape(-1), mhc[2], mhc[3],
                                                          g_out, gd, 20, 0)
            results.append([*hc, *hc_grads, *mhc, *mhc_grads])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bank_kernels_do_not_depend_on_the_thread_count():
    """AttnRes' bank kernels (mix, two-phase prefix, flush) split tokens over torch's intra-op threads;
    every token's arithmetic is the same whatever the split: 1 and 3 threads give bit-identical results."""
    from depthtools.arch import cpu_kernels
    from depthtools.arch.ops import bank as bank_ops

    if cpu_kernels.library("bank") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    gen = torch.Generator().manual_seed(0)
    cap, N, d, M = 9, 700, 24, 5
    values, inv = torch.randn(cap, N, d, generator=gen), torch.rand(cap, N, generator=gen) + 0.5
    dots = torch.randn(cap, M, N, generator=gen)
    grads = [torch.randn(N, d, generator=gen) for _ in range(5)]
    weights = [torch.rand(cap, N, generator=gen) for _ in range(5)]
    rhos = [torch.randn(N, generator=gen) for _ in range(5)]
    partial, p_logit = torch.randn(N, d, generator=gen), torch.randn(N, generator=gen)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            mu, P = bank_ops.bank_prefix(values, inv, dots, 6, [1, 3, 4])
            mixed = bank_ops.bank_mix_forward(values, inv, dots, 8, 3, partial, p_logit, 6, mu[1], P[:, 1])
            sums = [torch.zeros_like(values), torch.zeros_like(dots), torch.zeros_like(inv)]
            bank_ops.bank_flush(values, inv, dots, 0, cap, grads, weights, rhos, [0, 2, 2, 4, 1], *sums)
            results.append([mu, P, *mixed, *sums])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_moda_kernels_do_not_depend_on_the_thread_count():
    """MoDA's depth kernels split (kv head, token tile) pairs over the threads and sum slot gradients over the
    readers in a fixed order: 1 and 3 threads give bit-identical results (GQA, a masked slot, a partial tile)."""
    from depthtools.arch import cpu_kernels, moda
    from depthtools.arch.ops import moda as moda_ops

    if cpu_kernels.library("moda") is None:
        pytest.fail("the C kernels did not build: this test needs a C compiler (CI has gcc)")
    gen = torch.Generator().manual_seed(0)
    S, Hkv, g, hd, N = 5, 2, 2, 8, 2500
    K, V = torch.randn(S, Hkv, hd, N, generator=gen), torch.randn(S, Hkv, hd, N, generator=gen)
    q, o, dz = (torch.randn(5, 500, Hkv * g, hd, generator=gen) for _ in range(3))
    lse_seq, invalid = torch.randn(5, 500, Hkv * g, generator=gen), torch.tensor([False, True, False, False, False])
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            z, lse, probs, qs = moda_ops.moda_forward(K, V, q, o, lse_seq, invalid, 0.3)
            dqd, ds, dzt = moda_ops.moda_backward(K, V, z, dz, probs, invalid, 0.3)
            grads = moda._slot_grads([(ds, probs, qs, dzt, S), (ds[:3], probs[:3], dzt, qs, 3)], 1, 4, (5, 500))
            results.append([z, lse, probs, qs, dqd, ds, dzt, *grads])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_kernel_libraries_build_on_the_first_cpu_call_not_when_a_model_is_built(monkeypatch):
    """Building a model compiles nothing, on CPU or on `meta` (the grid planner's parameter counts); the first
    CPU forward that needs a library builds it (and only it)."""
    from depthtools.arch import cpu_kernels

    built, real_build = [], cpu_kernels._build
    monkeypatch.setattr(cpu_kernels, "_libs", {})  # as in a fresh process
    monkeypatch.setattr(cpu_kernels, "_build", lambda name, folder=None: built.append(name) or real_build(name, folder))
    for arch in ("attnres", "blockattnres", "hc", "mhc", "moda", "preln"):
        _model(arch)
        with torch.device("meta"):
            DepthModel(ModelConfig(arch=arch, vocab_size=64, d_model=16, n_layer=2, n_heads=2, max_seq_len=8))
    assert built == []
    _model("hc")(torch.randint(0, 64, (2, 8))).sum().backward()
    assert built == ["connector"] and cpu_kernels._libs["connector"] is not None
    assert cpu_kernels.kernel_status()["connector"] == "C (loaded)"
