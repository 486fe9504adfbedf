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
opaque because inductor's code for them is slower (benchmarks/RESULTS.md). They are the same torch custom
ops the eager path calls (depthtools/arch/ops/; their fake implementations are what the tracer sees):
  mHC's Sinkhorn (n = 4 reductions), `depthtools::sinkhorn_tokens_last` (ops/sinkhorn.py): on CPU
    (float32/float64) a small C kernel iterating each token's 4x4 matrix in registers, its torch twin elsewhere;
  HC's and mHC's whole connectors on CPU, `depthtools::hc_connect` / `depthtools::mhc_connect`
    (ops/connector.py, chosen by `connector.uses_op`): one C kernel per direction that reads each token's
    streams once (inductor's code for a block is 7 kernels forward and 9 backward, most passing over the stream
    state, which streams from memory; mHC's kernel runs the Sinkhorn inside, per block of 64 tokens); on other
    devices (or where the kernel library did not build) the references, which inductor fuses there (mHC's
    Sinkhorn staying the op above).
The kernels' sources are in csrc/ (cpu_kernels.py builds them).

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

from depthtools.arch.compile_cache import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: this module's interface too)
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
