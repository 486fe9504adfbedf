"""Regional `torch.compile` for training steps (issue 20): what is compiled, when, and for which device.

The eager path is the reference; this module only accelerates it. `enable(model)` attaches a
`CompiledRegions` to a `DepthModel`; `DepthModel.block_step` then runs a block through a compiled
region when (a) autograd records (a training step; evaluation, analyses and `torch.no_grad` sweeps
stay eager and compile nothing), (b) the block runs at its own position (no swap/replace plan), and
(c) no hook of any kind is attached to any hook point of the block (`torch_private.is_hooked`), so
`run_with_cache`, `run_with_hooks`, probes with pattern hooks and every analysis see the eager path.

Which region, per scheme (`ResidualScheme.compile_region`, chosen by measurement, benchmarks/RESULTS.md):

    "step"      the whole block step (norms, attention, MLP, connectors, update) is one graph
                shared by every block with the same `compile_key(position)` (the block's parameters
                are graph inputs, so L blocks compile once): the norm family, HC, mHC.
    "sublayer"  only norm + attention and norm + SwiGLU are compiled (two graphs for the model);
                the depth mixing stays on its hand-written fused kernels, whose state (a growing
                source bank, MoDA's slot buffers) changes shape with depth and would compile once
                per position: Full/Block AttnRes, DenseFormer.
    "none"      nothing compiled: MoDA (its MLP core compiled gained nothing measurable, -3% to +5%;
                its cost is the depth attention, memory-bound on the slot cache: a fused C kernel
                for it measured slower than the torch-op loops, benchmarks/RESULTS.md).

Inside a compiled step the hand-written autograd Functions (hyper.py) are replaced by their
plain-autograd references (reference.py) -- what inductor fuses; the HC/mHC stream mix [w; R] @ H is
written there as n multiply-adds per row under compile, so it fuses too -- with two exceptions, kept
opaque as custom ops because inductor's code for them is slower (benchmarks/RESULTS.md):
  mHC's Sinkhorn (n = 4 reductions), `depthtools::sinkhorn_tokens_last`: on CPU (float32/float64) a
    small C kernel iterating each token's 4x4 matrix in registers, the torch-op kernel elsewhere;
  HC's and mHC's whole connectors on CPU, `depthtools::hc_connect` / `depthtools::mhc_connect`: one C
    kernel per direction that reads each token's streams once (inductor's code for a block is 7 kernels
    forward and 9 backward, most passing over the stream state, which streams from memory; mHC's kernel runs the
    Sinkhorn inside, per block of 64 tokens); on other devices the references, which inductor fuses there.
The kernels' sources are in csrc/ (cpu_kernels.py builds and calls them).

Device dispatch (`backend_for`): CPU compiles with inductor's C++ backend when a C++ compiler is
found; CUDA with inductor's Triton kernels only when Triton is importable and the device's compute
capability is at least 7.0 (Triton's floor); anything else runs eager. The private CPU-only kernels
(torch_private) are never selected for a non-CPU tensor.

Caches: inductor's FX-graph and AOTAutograd caches are on disk, so a (shape, graph) compiles once
per machine. Their folder: $DEPTHTOOLS_COMPILE_CACHE, else $TORCHINDUCTOR_CACHE_DIR, else
~/.cache/depthtools/inductor (torch's own default, /tmp/torchinductor_$USER, is cleared on reboot).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from typing import Any, Callable

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch import cpu_kernels, reference
from depthtools.arch.compile_cache import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: this module's interface too)
from depthtools.arch.sinkhorn_torch import sinkhorn_backward, sinkhorn_forward
from depthtools.arch.torch_private import is_hooked

logger = logging.getLogger(__name__)

REGIONS = ("step", "sublayer", "none")


# -- device dispatch -------------------------------------------------------------------------------

def backend_for(device: torch.device | str) -> str | None:
    """The compiler backend for tensors on `device`: "inductor" where inductor can generate kernels for
    it (CPU: a C++ compiler on PATH; CUDA: Triton importable and compute capability >= 7.0), else None
    (the run stays eager and says why in the log)."""
    device = torch.device(device)
    if device.type == "cpu":
        return "inductor" if any(shutil.which(cc) for cc in (os.environ.get("CXX", "g++"), "g++", "clang++", "c++")) else None
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return None
        index = device.index if device.index is not None else 0
        return "inductor" if tuple(torch.cuda.get_device_capability(index)) >= (7, 0) else None
    return None


# -- mHC's Sinkhorn as an opaque op (the fused tokens-last kernel, device-generic torch ops) -------

@torch.library.custom_op("depthtools::sinkhorn_tokens_last", mutates_args=())
def _sinkhorn_tl(z: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """Sinkhorn of tokens-last logits z [n_out, n_in, N] (sinkhorn_torch.sinkhorn_forward); contiguous result.
    CPU float32/float64: the C kernel (cpu_kernels), else the torch-op kernel."""
    if cpu_kernels.usable(z):
        return cpu_kernels.sinkhorn_forward(z, t_max, first)
    return sinkhorn_forward(z, t_max, first)[0].contiguous()


@_sinkhorn_tl.register_fake
def _(z, t_max, first):
    return z.new_empty(z.shape)


@torch.library.custom_op("depthtools::sinkhorn_tokens_last_backward", mutates_args=())
def _sinkhorn_tl_backward(grad: torch.Tensor, z: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """Gradient of `_sinkhorn_tl` w.r.t. z (recomputes the cheap forward for its saved terms)."""
    grad = grad.contiguous()
    if cpu_kernels.usable(z, grad):
        return cpu_kernels.sinkhorn_backward(z, grad, t_max, first)
    _, saved = sinkhorn_forward(z, t_max, first)
    return sinkhorn_backward(saved, grad.contiguous()).contiguous()


@_sinkhorn_tl_backward.register_fake
def _(grad, z, t_max, first):
    return z.new_empty(z.shape)


def _sinkhorn_setup(ctx, inputs, output):
    z, t_max, first = inputs
    ctx.save_for_backward(z)
    ctx.t_max, ctx.first = t_max, first


def _sinkhorn_grad(ctx, grad):
    (z,) = ctx.saved_tensors
    return _sinkhorn_tl_backward(grad, z, ctx.t_max, ctx.first), None, None


_sinkhorn_tl.register_autograd(_sinkhorn_grad, setup_context=_sinkhorn_setup)


def sinkhorn_op(logits: torch.Tensor, t_max: int, first: int) -> torch.Tensor:
    """`reference.sinkhorn`'s signature (logits [..., n, n]) on the fused tokens-last kernel, as an op
    torch.compile does not trace into (the layout change around it is fused into its neighbours)."""
    n = logits.shape[-1]
    z = logits.reshape(-1, n, n).permute(1, 2, 0).contiguous()
    return _sinkhorn_tl(z, t_max, first).permute(2, 0, 1).reshape(logits.shape)


# -- the HC / mHC connectors as opaque ops (CPU: the fused C kernels; elsewhere torch ops) ------------
#
# Inside a compiled block step on CPU, a connector runs as one of these ops instead of inductor's code for
# the plain-autograd reference: one pass over the stream state per direction instead of most of the
# block's 7 forward and 9 backward kernels (cpu_kernels; measured in benchmarks/RESULTS.md, "Third pass"). On other devices the
# compiled step keeps the references (`connector_op`), so inductor generates those kernels there.

@torch.library.custom_op("depthtools::hc_connect", mutates_args=())
def _hc_connect(H: torch.Tensor, Pt: torch.Tensor, S: torch.Tensor, scale: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out = [w; R] @ H [N,n+1,d], β [N,n], raw, inv, t) -- cpu_kernels.hc_connect_forward's contract;
    the last three are saved for the backward. Torch ops where the C kernel does not apply."""
    H, Pt, S, scale = H.contiguous(), Pt.contiguous(), S.contiguous(), scale.contiguous()
    if cpu_kernels.connector_usable(H, Pt, S, scale):
        return cpu_kernels.hc_connect_forward(H, Pt, S, scale, eps)
    return _hc_reference(H, Pt, S, scale, eps)


def _hc_reference(H, Pt, S, scale, eps):
    """`_hc_connect`'s outputs by differentiable torch ops: raw = H_s · P_j, inv = 1/rms(H_s),
    t = tanh(raw · inv), coefficients S + scale ⊙ t, out = [w; R] @ H, β."""
    N, n, d = H.shape
    raw = (H.reshape(N * n, d) @ Pt.t()).view(N, n, n + 2)
    inv = torch.rsqrt(torch.linalg.vecdot(H, H) / d + eps)
    t = torch.tanh(raw * inv.unsqueeze(-1))
    coeffs = S + scale * t
    return torch.bmm(coeffs[..., : n + 1].transpose(1, 2), H), coeffs[..., n + 1].contiguous(), raw, inv, t


@_hc_connect.register_fake
def _(H, Pt, S, scale, eps):
    N, n, d = H.shape
    return (H.new_empty(N, n + 1, d), H.new_empty(N, n), H.new_empty(N, n, n + 2), H.new_empty(N, n),
            H.new_empty(N, n, n + 2))


@torch.library.custom_op("depthtools::hc_connect_backward", mutates_args=())
def _hc_connect_backward(H: torch.Tensor, Pt: torch.Tensor, S: torch.Tensor, scale: torch.Tensor,
                         raw: torch.Tensor, inv: torch.Tensor, t: torch.Tensor, g_out: torch.Tensor,
                         g_depth: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dH, dL/dPt, dL/dS, dL/dscale) of `_hc_connect` (the reference's vjp where the kernel does not apply)."""
    args = [x.contiguous() for x in (H, Pt, S, scale, raw, inv, t, g_out, g_depth)]
    if cpu_kernels.connector_usable(*args):
        return cpu_kernels.hc_connect_backward(*args)
    _, vjp = torch.func.vjp(lambda *xs: _hc_reference(*xs, eps)[:2], *args[:4])
    return tuple(g.contiguous() for g in vjp((args[7], args[8])))


@_hc_connect_backward.register_fake
def _(H, Pt, S, scale, raw, inv, t, g_out, g_depth, eps):
    return tuple(x.new_empty(x.shape) for x in (H, Pt, S, scale))  # contiguous, as the kernel returns them


def _hc_connect_setup(ctx, inputs, output):
    H, Pt, S, scale, ctx.eps = inputs
    ctx.save_for_backward(H, Pt, S, scale, *output[2:])


def _hc_connect_grad(ctx, g_out, g_depth, *_):
    H, Pt, S, scale, raw, inv, t = ctx.saved_tensors
    N, n, d = H.shape
    g_out = H.new_zeros(N, n + 1, d) if g_out is None else g_out
    g_depth = H.new_zeros(N, n) if g_depth is None else g_depth
    return (*_hc_connect_backward(H, Pt, S, scale, raw, inv, t, g_out, g_depth, ctx.eps), None)


_hc_connect.register_autograd(_hc_connect_grad, setup_context=_hc_connect_setup)


@torch.library.custom_op("depthtools::mhc_connect", mutates_args=())
def _mhc_connect(H: torch.Tensor, PhiT: torch.Tensor, gates: torch.Tensor, b_pre: torch.Tensor, b_post: torch.Tensor,
                 b_res: torch.Tensor, eps: float, t_max: int, first: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out = [H_pre; H_res] @ H [N,n+1,d], H_post [N,n], raw, inv) -- cpu_kernels.mhc_connect_forward's
    contract (b_res flattened row-major); raw and inv are saved for the backward. Torch ops (the
    reference) where the C kernel does not apply."""
    args = [x.contiguous() for x in (H, PhiT, gates, b_pre, b_post, b_res)]
    if cpu_kernels.connector_usable(*args):
        return cpu_kernels.mhc_connect_forward(*args, eps, t_max, first)
    out, depth = _mhc_reference(*args, eps, t_max, first)
    x = H.reshape(H.shape[0], -1)
    return out, depth, x @ PhiT.t(), torch.rsqrt(torch.linalg.vecdot(x, x) / x.shape[1] + eps)


def _mhc_reference(H, PhiT, gates, b_pre, b_post, b_res, eps, t_max, first):
    """(out, H_post) of `_mhc_connect` by `reference.mhc_connect` (differentiable torch ops)."""
    n = H.shape[1]
    phi_pre, phi_post, phi_res = PhiT.t().split([n, n, n * n], 1)
    u, mixed, depth = reference.mhc_connect(H, phi_pre, phi_post, phi_res, gates[0], gates[1], gates[2], b_pre,
                                            b_post, b_res.view(n, n), eps, t_max, first)
    return torch.cat([u.unsqueeze(1), mixed], 1), depth


@_mhc_connect.register_fake
def _(H, PhiT, gates, b_pre, b_post, b_res, eps, t_max, first):
    N, n, d = H.shape
    return H.new_empty(N, n + 1, d), H.new_empty(N, n), H.new_empty(N, PhiT.shape[0]), H.new_empty(N)


@torch.library.custom_op("depthtools::mhc_connect_backward", mutates_args=())
def _mhc_connect_backward(H: torch.Tensor, PhiT: torch.Tensor, gates: torch.Tensor, b_pre: torch.Tensor,
                          b_post: torch.Tensor, b_res: torch.Tensor, raw: torch.Tensor, inv: torch.Tensor,
                          g_out: torch.Tensor, g_depth: torch.Tensor, eps: float, t_max: int, first: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `_mhc_connect`'s six tensor inputs (the reference's vjp where the kernel does not apply)."""
    args = [x.contiguous() for x in (H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth)]
    if cpu_kernels.connector_usable(*args):
        return cpu_kernels.mhc_connect_backward(*args, t_max, first)
    _, vjp = torch.func.vjp(lambda *xs: _mhc_reference(*xs, eps, t_max, first), *args[:6])
    return tuple(g.contiguous() for g in vjp((args[8], args[9])))


@_mhc_connect_backward.register_fake
def _(H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, eps, t_max, first):
    return tuple(x.new_empty(x.shape) for x in (H, PhiT, gates, b_pre, b_post, b_res))


def _mhc_connect_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6], *output[2:])
    ctx.eps, ctx.t_max, ctx.first = inputs[6:]


def _mhc_connect_grad(ctx, g_out, g_depth, *_):
    H, PhiT, gates, b_pre, b_post, b_res, raw, inv = ctx.saved_tensors
    N, n, d = H.shape
    g_out = H.new_zeros(N, n + 1, d) if g_out is None else g_out
    g_depth = H.new_zeros(N, n) if g_depth is None else g_depth
    grads = _mhc_connect_backward(H, PhiT, gates, b_pre, b_post, b_res, raw, inv, g_out, g_depth, ctx.eps,
                                  ctx.t_max, ctx.first)
    return (*grads, None, None, None)


_mhc_connect.register_autograd(_mhc_connect_grad, setup_context=_mhc_connect_setup)


def connector_op(H: torch.Tensor) -> bool:
    """Whether an HC/mHC connector traced by torch.compile runs as the opaque `depthtools::hc_connect` /
    `depthtools::mhc_connect`: on CPU (a static property under tracing, guarded by dynamo), where their C
    kernels beat inductor's code."""
    return compiling() and H.device.type == "cpu"


def hc_connect_op(H, Wa, wb, Sa, sb, sa, sbeta, eps):
    """`reference.hc_connect` (u, R H, β) as the opaque op; the parameters are packed by traced ops
    (P = [W_a | w_b], S = [S_a | s_b], scale = [s_a .. s_a, s_b]), whose gradients autograd unpacks."""
    Pt, S = cpu_kernels.hc_pack(Wa, wb, Sa, sb)
    scale = torch.cat([sa.expand(H.shape[1] + 1), sbeta.reshape(1)])
    out, depth, *_ = _hc_connect(H, Pt, S, scale, eps)
    return out[:, 0], out[:, 1:], depth


def mhc_connect_op(H, phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res, eps, t_max, first):
    """`reference.mhc_connect` (u, H_res H, H_post) as the opaque op (parameters packed by traced ops)."""
    packed = cpu_kernels.mhc_pack(phi_pre, phi_post, phi_res, g_pre, g_post, g_res, b_pre, b_post, b_res)
    out, depth, *_ = _mhc_connect(H, *packed, eps, t_max, first)
    return out[:, 0], out[:, 1:], depth


def compiling() -> bool:
    """Whether this code is being traced by torch.compile (then the schemes take their traceable
    formulations: plain-autograd references, no private APIs, no buffer pools)."""
    return torch.compiler.is_compiling()


# -- the regions -----------------------------------------------------------------------------------

def _hook_points(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules() if isinstance(m, HookPoint)]


class CompiledRegions:
    """The compiled callables of one model (see the module docstring). Not part of the model's state:
    `model.compiled = None` (or `disable(model)`) returns it to the eager path."""

    def __init__(self, model: nn.Module, region: str | None = None):
        scheme = model.scheme
        self.region = region or scheme.compile_region
        if self.region not in REGIONS:
            raise ValueError(f"unknown compile region {self.region!r}; valid: {REGIONS}")
        self.backend = "inductor"
        self._points = {id(b): _hook_points(b) for b in model.blocks}
        self._steps: dict[Any, Callable] = {}
        self._scheme = scheme
        self.cores = None
        if self.region == "sublayer":
            self.cores = (torch.compile(_attn_core, backend=self.backend, dynamic=False),
                          torch.compile(_mlp_core, backend=self.backend, dynamic=False))

    def unhooked(self, block: nn.Module) -> bool:
        points = self._points.get(id(block))
        if points is None:
            points = self._points[id(block)] = _hook_points(block)
        return not is_hooked(*points)

    def step(self, position: int, block: nn.Module, state, rope):
        """The block step through the compiled region (the caller checked the conditions)."""
        scheme = self._scheme
        if self.region == "step":
            key = scheme.compile_key(position)
            fn = self._steps.get(key)
            if fn is None:
                fn = self._steps[key] = _step_function(scheme, position, self.backend)
            return fn(block, state, *rope)
        scheme.compiled_cores = self.cores
        try:
            return scheme.step(position, block, state, block, rope)
        finally:
            scheme.compiled_cores = None


def _step_function(scheme, position: int, backend: str) -> Callable:
    """scheme.step at `position` (and every position with its compile key) as one compiled function
    of (block, state, cos, sin); the block's parameters are graph inputs, so all blocks share it."""
    def block_step(block, state, cos, sin):
        return scheme.step(position, block, state, block, (cos, sin))

    return torch.compile(block_step, backend=backend, dynamic=False)


def _attn_core(norm: nn.Module, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return attn(norm(x), cos, sin)


def _mlp_core(norm: nn.Module, mlp: nn.Module, x: torch.Tensor):
    return mlp(norm(x))


def enable(model: nn.Module, device: torch.device | str | None = None) -> bool:
    """Attach compiled regions to `model` (a DepthModel) for training on `device` (default: where its
    parameters are). Returns False, leaving the model eager, when the device has no compiler backend
    (`backend_for`) or the architecture declares no region."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if backend_for(device) is None:
        logger.warning("compile: no compiler backend for %s here (CPU: a C++ compiler; CUDA: Triton and "
                       "compute capability >= 7.0); training eagerly", device)
        model.compiled = None
        return False
    if model.scheme.compile_region == "none":
        model.compiled = None
        return False
    cache_dir()
    model.compiled = CompiledRegions(model)
    return True


def disable(model: nn.Module) -> None:
    model.compiled = None


# -- "auto": does compiling pay for itself? ---------------------------------------------------------

# Measured on the 2-core dev machine, 1 thread, L32 d64, batch 8x128 (benchmarks/bench_compile.py,
# benchmarks/RESULTS.md "Compiled training (issue 20)"): saved seconds per training step per
# (token x layer x d_model) -- the saving scales with the elementwise work -- and the first step's
# extra time with a cold inductor cache (a warm cache makes it ~5 s).
# Saved per step: preln 70 ms, hc 182 ms, attnres 135 ms, blockattnres 60 ms at 8x128 (2.1M units);
# first-step compile: 17-28 s for a whole-block region, 4-9 s for the sublayer cores.
SAVING_PER_UNIT_S = {"step": 3.5e-8, "sublayer": 2.5e-8}  # preln / blockattnres: the smallest of each region
COMPILE_COST_S = {"step": 30.0, "sublayer": 10.0}
CUDA_MIN_STEPS = 1000  # not measured on a GPU yet: compile CUDA runs of at least this many steps


def decide(setting: str, region: str, total_steps: int, tokens_per_step: int, n_layer: int, d_model: int,
           device: torch.device | str) -> tuple[str, str]:
    """("on" | "off", why) for TrainConfig.compile `setting` ("auto" | "on" | "off").

    "auto" is "on" when the planned run's estimated saving exceeds the estimated (cold-cache)
    compile time: total_steps x SAVING_PER_UNIT_S[region] x tokens_per_step x n_layer x d_model >
    COMPILE_COST_S[region] on CPU; total_steps >= CUDA_MIN_STEPS on CUDA. A CI-sized run (tens to
    hundreds of steps of a d <= 64, L <= 8 model) estimates a saving of well under a second: "off".
    "on" without a compiler backend for the device (`backend_for`) is "off" too, with the reason."""
    device = torch.device(device)
    if setting == "off":
        return "off", "compile off"
    if region == "none":
        return "off", "this architecture declares no compiled region"
    if setting == "auto":
        if device.type == "cuda":
            if total_steps < CUDA_MIN_STEPS:
                return "off", f"auto: {total_steps} steps < {CUDA_MIN_STEPS} on CUDA"
        else:
            saving = total_steps * SAVING_PER_UNIT_S[region] * tokens_per_step * n_layer * d_model
            cost = COMPILE_COST_S[region]
            if saving <= cost:
                return "off", f"auto: estimated saving {saving:.0f} s <= compile time ~{cost:.0f} s"
    if backend_for(device) is None:
        return "off", f"no compiler backend for {device.type} here (CPU: C++ compiler; CUDA: Triton, capability >= 7.0)"
    if setting == "on":
        return "on", "compile on"
    return "on", "auto: the estimated saving exceeds the compile time"
