"""Every private PyTorch API depthtools uses, each behind one small helper with a public fallback.

The fused code paths use a few things PyTorch does not promise to keep (underscored attributes and
ops). They are the fastest way to do something on CPU, some exist only on CPU, and any may change
between PyTorch versions. So nothing else in the package touches them: each has one helper here
that says what it relies on, where it is valid, and what the public fallback computes instead.
The fallback computes the same function (usually more slowly) and is chosen per call by device,
dtype and availability; `fallbacks()` (or DEPTHTOOLS_TORCH_FALLBACKS=1 in the environment) forces
every fallback, so a suspected private-API problem can be ruled out in one run, and
tests/test_torch_private.py checks that every architecture gives the default path's results with
them forced. A forced fallback is one module-level flag read per call: it costs nothing measurable.

    private use                                       helper                   public fallback
    nn.Module._forward_hooks & co. (hook lookups)     is_hooked                "hooked": the explicit path
    aten._scaled_dot_product_flash_attention_for_cpu  cpu_flash_attention_ok   explicit attention (caller)
      and its _backward (MoDA's fused depth attention)  cpu_flash_attention(_backward)
    torch._C._storage_Use_Count (buffer reuse)        storage_unshared         never reuse: allocate
    Tensor._base (MoDA: find a view's slot buffer)    view_base                None: copy-on-append
    attributes on a tensor (the buffer's slot store)  tensor_tag / set_tensor_tag   None (as view_base)
    Tensor.data (append without a version bump)       untracked                the tensor itself
    Tensor._version (AttnRes bank fingerprint)        versions                 None: bank never reused
    torch._C._current_graph_task_id (backward pass)   backward_pass_id         None: a mix that already
                                                                               holds a gradient starts a pass
    torch._C._functorch.peek_interpreter_stack        forward_ad_active        True: the caller's plain-
      (a torch.func transform is running)                                       autograd formulation
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.autograd.forward_ad as fwAD
from torch.nn.modules import module as _module

FORCED = os.environ.get("DEPTHTOOLS_TORCH_FALLBACKS", "").strip() not in ("", "0")


@contextmanager
def fallbacks(on: bool = True):
    """Force (or, with on=False, un-force) every public fallback inside the block."""
    global FORCED
    before, FORCED = FORCED, on
    try:
        yield
    finally:
        FORCED = before


# -- hooks --------------------------------------------------------------------------------------

def is_hooked(*points: torch.nn.Module) -> bool:
    """Whether any of these hook points has a hook in either direction (forward, forward-pre,
    backward, backward-pre), i.e. whether it must be called on a path where its hooks fire.

    One meaning everywhere: a fast path that skips a hook point (fused attention, fused connectors,
    the AttnRes bank) is taken only when no hook of any kind is attached to it -- a backward-only
    hook needs the hook point in the graph just as a forward hook needs its value. Reads nn.Module's
    private hook dictionaries (there is no public query); fallback: True (always the explicit path).
    """
    if FORCED:
        return True
    for p in points:
        if p._forward_hooks or p._forward_pre_hooks or p._backward_hooks or p._backward_pre_hooks:
            return True
    return False


def global_module_hooks() -> bool:
    """Whether a hook registered for every module (`torch.nn.modules.module.register_module_forward_hook` and
    its pre-hook) is set: a path that calls a layer's function instead of the module would skip it. Reads
    nn.Module's private global dictionaries; fallback: True."""
    try:
        return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)
    except AttributeError:
        return True


# -- PyTorch's CPU flash attention (MoDA's `_DepthAttention`) ------------------------------------

_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _flash_ops():
    ops = torch.ops.aten
    try:
        return ops._scaled_dot_product_flash_attention_for_cpu, ops._scaled_dot_product_flash_attention_for_cpu_backward
    except (AttributeError, RuntimeError):  # an op missing from this PyTorch build
        return None


_FLASH = _flash_ops()


def cpu_flash_attention_ok(device: torch.device | str, dtype: torch.dtype | None = None) -> bool:
    """Whether `cpu_flash_attention` may run on `device` (and `dtype`): the op is CPU-only and private,
    so only on CPU, for the dtypes it takes, when this PyTorch has it. Otherwise the caller takes its
    explicit (device-generic, public) formulation."""
    if FORCED or _FLASH is None or torch.device(device).type != "cpu":
        return False
    return dtype is None or dtype in _FLASH_DTYPES


def cpu_flash_attention(q, k, v, scale: float):
    """Causal attention (out [B,H,T,hd], log-sum-exp per row [B,H,T]) for q, k, v [B,H,T,hd] on CPU.
    Public PyTorch returns no log-sum-exp, which MoDA needs to merge the depth part."""
    return _FLASH[0](q, k, v, 0.0, True, scale=scale)


def cpu_flash_attention_backward(dout, q, k, v, out, lse, scale: float):
    """(dq, dk, dv) of `cpu_flash_attention` given the output gradient and its (out, lse) -- which may be
    those of a larger softmax the sequence part belongs to (MoDA passes the joint ones)."""
    return _FLASH[1](dout, q, k, v, out, lse, 0.0, True, scale=scale)


# -- buffer reuse (layers.BufferPool) -------------------------------------------------------------

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_unshared(t: torch.Tensor) -> bool:
    """Whether no other tensor (view, saved tensor, .data alias) shares `t`'s storage. The count is
    private (`torch._C._storage_Use_Count`; `t` and the temporary storage object below are the two
    expected users); fallback: False (never reuse, allocate)."""
    if FORCED or _use_count is None:
        return False
    return _use_count(t.untyped_storage()._cdata) <= 2


# -- MoDA's append-only slot buffers -------------------------------------------------------------

def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (`Tensor._base`), or None. Fallback: None, so callers treat every
    tensor as foreign (MoDA then copies instead of appending in place)."""
    return None if FORCED else t._base


def set_tensor_tag(t: torch.Tensor, value) -> None:
    """Attach `value` to tensor `t` (a Python attribute; it lives as long as PyTorch keeps t's Python
    object, which it does while any view of t exists). Read back with `tensor_tag`."""
    t._depthtools_tag = value


def tensor_tag(t: torch.Tensor):
    """What `set_tensor_tag` attached to `t`, or None (always None with fallbacks forced)."""
    return None if FORCED else getattr(t, "_depthtools_tag", None)


def untracked(t: torch.Tensor) -> torch.Tensor:
    """`t.data`: the same storage, but writes through it do not bump the version counter that t's
    views share, so an append past the end of a buffer does not invalidate views of its prefix that
    autograd saved. Fallback: t itself -- callers only write untracked where the fallback path never
    reaches (MoDA appends in place only when `view_base` finds the buffer)."""
    return t if FORCED else t.data


# -- parameter change detection (AttnRes' DepthBank) ---------------------------------------------

def versions(tensors) -> tuple[int, ...] | None:
    """The in-place version counters of `tensors` (`Tensor._version`: every optimizer step or in-place
    edit bumps it), or None when unknown -- callers then assume the tensors changed (fallback)."""
    if FORCED:
        return None
    return tuple(t._version for t in tensors)


# -- which backward pass is running (the AttnRes bank's deferred source gradients) ---------------------

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def backward_pass_id() -> int | None:
    """An id of the backward pass (autograd graph task) now running, or None. Private
    (`torch._C._current_graph_task_id`, what torch.utils.checkpoint uses for the same purpose). The
    AttnRes bank defers source gradients across autograd nodes and must not mix two passes over a
    retained graph. Fallback: None; the bank then starts a new pass when a mix that already holds a
    gradient runs again, which covers repeated passes from the same output (Jacobian columns) but
    not passes from different outputs that reach different mixes."""
    if FORCED or _graph_task_id is None:
        return None
    task = _graph_task_id()
    return None if task < 0 else task



# -- forward-mode AD and torch.func transforms (the custom ops in depthtools.arch.ops) -----------------

_interpreter_stack = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def forward_ad_active(*tensors: torch.Tensor) -> bool:
    """Whether forward-mode AD or a torch.func transform may see a computation on `tensors`: one of them carries a
    forward-AD tangent (`torch.autograd.forward_ad.unpack_dual`, public), or a torch.func transform (jvp, jacfwd,
    grad, vjp, vmap, ...) is running. The kernels' custom ops (depthtools.arch.ops) have neither a forward-mode
    derivative (under torch.func.jvp one silently yields a zero tangent) nor a torch.func.grad rule, so their
    callers then take the plain-autograd reference, which supports every transform. Whether a transform is running
    has no public query: torch._C._functorch.peek_interpreter_stack (None when none is). Fallback: True (the
    reference: correct everywhere, slower)."""
    if FORCED or _interpreter_stack is None:
        return True
    return _interpreter_stack() is not None or any(fwAD.unpack_dual(t).tangent is not None for t in tensors)
