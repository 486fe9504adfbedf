"""MoDA's depth-attention kernels as torch custom ops: `depthtools::moda_forward`, `moda_backward`,
`moda_slot_grads`, `moda_store_slot`.

The depth part of a MoDA attention works slots-first and tokens-last: K, V [S,Hkv,hd,N] (N = B·T tokens; a view of
the slot buffer, see `moda._AppendSlots`), the depth query and outputs as [B,T,H,hd] token rows. Each op below is
one unit: a typed schema, a fake (shapes only: torch.compile's tracing and the `meta` device), and one
implementation that runs the C kernel (`csrc/moda_impl.h`, library "moda") where `cpu_kernels.moda_usable` says so
(CPU float32/float64, slots of that dtype or bfloat16 slots with float32, the library built) and its plain-PyTorch
twin everywhere else. Callers never choose between them.

No autograd is registered on these ops, by design: they are the pieces of `moda._DepthAttention` and
`_AppendSlots`, autograd Functions that own MoDA's gradient. `_DepthAttention`'s backward joins PyTorch's flash
attention backward over the sequence keys with the JOINT output and log-sum-exp (so `moda_forward`'s inputs o and
lse_seq are never differentiated on their own), and a slot's gradients are not formed by each reader but once, by
the slot's writer, from what all its readers' backwards recorded (`moda_slot_grads`, see `moda._SlotStore`).
`moda_backward` and `moda_slot_grads` are backward pieces (first-order only); `moda_store_slot` writes a slot into
the buffer in place (mutates dst; its gradient is `_AppendSlots`').
"""

from typing import Optional

import torch
from torch import Tensor

from depthtools.arch import cpu_kernels

STREAM_STORES = True  # False: plain stores only in moda_store_slot (for the same-run A/B in benchmarks/bench_speedups.py)


# called with the slots' dtype (float32, float64 or bfloat16: the instantiation whose KV_T they are)
_FORWARD = cpu_kernels.Kernel("moda", "moda_forward",
                              "K V q qst scale o ost lse_seq lst invalid S Hkv g hd N z lse probs qs threads")
_BACKWARD = cpu_kernels.Kernel("moda", "moda_backward", "K V z dz probs invalid S Hkv g hd N scale dqd ds dzt threads")
_SLOT_GRADS = cpu_kernels.Kernel("moda", "moda_slot_grads",
                                 "R ds probs qs dzt reads start stop Hkv g hd N gk gv add threads")
_STORE_SLOT = cpu_kernels.Kernel("moda", "moda_store_slot", "src rs C N dst stream threads")


def _out_of_memory(status: int, what: str = "MoDA depth-attention") -> None:
    if status:
        raise MemoryError(f"{what} CPU kernel: out of memory")


def _mask(invalid: Optional[Tensor]) -> Optional[Tensor]:
    return None if invalid is None else invalid.to(torch.uint8).contiguous()


def _rows(x: Tensor) -> tuple[Tensor, int]:
    """(x, token stride) for x [B,T,...] whose B*T tokens are equally spaced rows of contiguous values (the
    model's [B,T,H,hd] projections and the flash kernel's outputs are), else (a contiguous copy, its stride)."""
    inner = x[0, 0]
    if not inner.is_contiguous() or x.shape[0] > 1 and x.stride(0) != x.shape[1] * x.stride(1):
        x = x.contiguous()
    return x, x.stride(1)


# -- the forward: depth scores, the softmax joined with the sequence part, the weighted sum -------------------

@torch.library.custom_op("depthtools::moda_forward", mutates_args=())
def moda_forward(K: Tensor, V: Tensor, q: Tensor, o: Tensor, lse_seq: Tensor, invalid: Optional[Tensor],
                 scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The depth part of one MoDA attention joined with its sequence part: (z [B,T,H,hd], lse [B,T,H], probs
    [S,Hkv,g,N], qs [Hkv,g,hd,N] = the scaled depth query tokens last, for the slot gradients) from slots K, V
    [S,Hkv,hd,N] (contiguous; the model's dtype, or bfloat16 with a float32 query), the depth query q [B,T,H,hd]
    (unscaled), the sequence part's output o [B,T,H,hd] and log-sum-exp lse_seq [B,T,H], invalid [S] bool (masked
    slots) or None. Outputs in q's dtype."""
    if cpu_kernels.moda_usable(q, K.dtype):
        return _kernel_forward(K, V, q, o, lse_seq, invalid, scale)
    if K.dtype != q.dtype:  # bfloat16 slots, torch ops: compute in q's dtype
        K, V = K.to(q.dtype), V.to(q.dtype)
    return _depth_forward(K, V, q, o, lse_seq, invalid, scale)


@moda_forward.register_fake
def _(K, V, q, o, lse_seq, invalid, scale):
    S, Hkv, hd, N = K.shape
    B, T, H, _ = q.shape
    return (q.new_empty(B, T, H, hd), q.new_empty(B, T, H), q.new_empty(S, Hkv, H // Hkv, N),
            q.new_empty(Hkv, H // Hkv, hd, N))


def _kernel_forward(K, V, q, o, lse_seq, invalid, scale):
    K, V = K.contiguous(), V.contiguous()  # (no copy for slot-buffer views, which are)
    S, Hkv, hd, N = K.shape
    B, T, H, _ = q.shape
    (q, qst), (o, ost), (lse_seq, lst) = _rows(q), _rows(o), _rows(lse_seq)
    z, lse = q.new_empty(B, T, H, hd), q.new_empty(B, T, H)
    probs, qs = q.new_empty(S, Hkv, H // Hkv, N), q.new_empty(Hkv, H // Hkv, hd, N)
    mask = _mask(invalid)  # (kept alive through the call)
    _out_of_memory(_FORWARD(K.dtype, K, V, q, qst, scale, o, ost, lse_seq, lst, mask, S, Hkv, H // Hkv, hd, N, z, lse,
                            probs, qs, torch.get_num_threads()))
    return z, lse, probs, qs


def _depth_forward(K, V, q, o, lse_seq, invalid, scale: float):
    """`moda_forward`'s twin in torch ops (any device and dtype; K, V in q's dtype). Works tokens last."""
    S, Hkv, hd, N = K.shape
    B, T, H, _ = q.shape
    g = H // Hkv
    qs = q.permute(2, 3, 0, 1).reshape(Hkv, g, hd, N) * scale  # scaled depth query
    scores = torch.mul(K[:, :, None, 0], qs[:, :, 0])  # [S,Hkv,g,N]
    for i in range(1, hd):
        scores.addcmul_(K[:, :, None, i], qs[:, :, i])
    if invalid is not None:
        scores.masked_fill_(invalid.view(S, 1, 1, 1), float("-inf"))
    lse_seq = lse_seq.permute(2, 0, 1).reshape(Hkv, g, N)
    top = torch.maximum(scores.amax(0), lse_seq)  # [Hkv,g,N]
    probs = scores.sub_(top).exp_()  # [S,Hkv,g,N], unnormalised
    seq_weight = (lse_seq - top).exp_()
    total = probs.sum(0).add_(seq_weight)  # joint normaliser / exp(top)
    probs.div_(total)  # depth probabilities
    seq_weight.div_(total)  # = exp(lse_seq - lse), the sequence part's total probability
    lse = total.log_().add_(top)  # joint log-sum-exp
    zt = o.permute(2, 3, 0, 1).reshape(Hkv, g, hd, N) * seq_weight.unsqueeze(2)
    for s in range(S):
        zt.addcmul_(V[s, :, None], probs[s].unsqueeze(2))
    z = zt.reshape(H, hd, B, T).permute(2, 3, 0, 1).contiguous()
    # (probs and qs have their operands' strides: returned contiguous, as the kernel's and the fake's are)
    return z, lse.reshape(H, B, T).permute(1, 2, 0).contiguous(), probs.contiguous(), qs.contiguous()


# -- the backward: score gradients and the depth query's gradient ---------------------------------------------

@torch.library.custom_op("depthtools::moda_backward", mutates_args=())
def moda_backward(K: Tensor, V: Tensor, z: Tensor, dz: Tensor, probs: Tensor, invalid: Optional[Tensor],
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dqd [B,T,H,hd], ds [S,Hkv,g,N], dzt [Hkv,g,hd,N]) of `moda_forward`: the gradient of the unscaled depth
    query, the slots' score gradients ds = P ⊙ (dz·V_s - Σ dz·z) and dz tokens last, from the joint output z and its
    gradient dz [B,T,H,hd]."""
    if cpu_kernels.moda_usable(z, K.dtype):
        return _kernel_backward(K, V, z, dz, probs, invalid, scale)
    if K.dtype != z.dtype:
        K, V = K.to(z.dtype), V.to(z.dtype)
    return _depth_backward(K, V, z, dz, probs, invalid, scale)


@moda_backward.register_fake
def _(K, V, z, dz, probs, invalid, scale):
    S, Hkv, hd, N = K.shape
    H = z.shape[2]
    return z.new_empty(z.shape), probs.new_empty(probs.shape), z.new_empty(Hkv, H // Hkv, hd, N)


def _kernel_backward(K, V, z, dz, probs, invalid, scale):
    S, Hkv, hd, N = K.shape
    H = z.shape[2]
    K, V, z, dz, probs = (x.contiguous() for x in (K, V, z, dz, probs))  # (the kernel's layout; no copy when they are)
    dqd, ds, dzt = z.new_empty(z.shape), probs.new_empty(probs.shape), z.new_empty(Hkv, H // Hkv, hd, N)
    mask = _mask(invalid)  # (kept alive through the call)
    _out_of_memory(_BACKWARD(K.dtype, K, V, z, dz, probs, mask, S, Hkv, H // Hkv, hd, N, scale, dqd, ds, dzt,
                             torch.get_num_threads()))
    return dqd, ds, dzt


def _depth_backward(K, V, z, dz, probs, invalid, scale: float):
    """`moda_backward`'s twin in torch ops."""
    S, Hkv, hd, N = K.shape
    B, T, H, _ = z.shape
    g = H // Hkv
    dzt = dz.permute(2, 3, 0, 1).reshape(Hkv, g, hd, N)  # (may be a view of dz: returned as a copy)
    zt = z.permute(2, 3, 0, 1).reshape(Hkv, g, hd, N)
    ds = torch.mul(V[:, :, None, 0], dzt[:, :, 0])  # [S,Hkv,g,N] = dz·V_s
    for i in range(1, hd):
        ds.addcmul_(V[:, :, None, i], dzt[:, :, i])
    ds.sub_((dzt * zt).sum(2)).mul_(probs)  # dL/dscore = P ⊙ (dz·V_s - Σ dz·z); masked slots: P = 0
    dqt = torch.mul(K[0, :, None], ds[0].unsqueeze(2))  # [Hkv,g,hd,N]
    for s in range(1, S):
        dqt.addcmul_(K[s, :, None], ds[s].unsqueeze(2))
    dqd = dqt.mul_(scale).reshape(H, hd, B, T).permute(2, 3, 0, 1).contiguous()
    return dqd, ds.contiguous(), dzt.clone(memory_format=torch.contiguous_format)


# -- the slot gradients, from the readers' records ------------------------------------------------------------

@torch.library.custom_op("depthtools::moda_slot_grads", mutates_args=("gk", "gv"))
def moda_slot_grads(ds: list[Tensor], probs: list[Tensor], qs: list[Tensor], dzt: list[Tensor], reads: list[int],
                    start: int, stop: int, gk: Tensor, gv: Tensor, add: bool) -> None:
    """The gradients gk, gv [stop-start,B,T,Hkv,hd] of slots start..stop-1, written in place (by the kernel when they
    are contiguous; add: added to what they hold), from R reader records r (ds_r, probs_r [S_r,Hkv,g,N] and qs_r,
    dzt_r [Hkv,g,hd,N] as `moda_forward` and `moda_backward` return them; reads[r] = S_r, the slots reader r read):
    gK_s = Σ_r Σ_j ds_r[s,:,j] qs_r[:,j], gV_s = Σ_r Σ_j probs_r[s,:,j] dzt_r[:,j] over the readers with S_r > s, in
    the order given (see `moda._SlotStore`)."""
    if ds and cpu_kernels.moda_usable(ds[0]) and gk.is_contiguous() and gv.is_contiguous():
        _kernel_slot_grads(ds, probs, qs, dzt, reads, start, stop, gk, gv, add)
    else:
        _torch_slot_grads(ds, probs, qs, dzt, reads, start, stop, gk, gv, add)


@moda_slot_grads.register_fake
def _(ds, probs, qs, dzt, reads, start, stop, gk, gv, add):
    return None


def _kernel_slot_grads(ds, probs, qs, dzt, reads, start, stop, gk, gv, add):
    ds, probs, qs, dzt = ([x.contiguous() for x in xs] for xs in (ds, probs, qs, dzt))  # (kept alive through the call)
    Hkv, g, hd, N = qs[0].shape
    table = torch.tensor([[x.data_ptr() for x in xs] for xs in (ds, probs, qs, dzt)] + [list(reads)], dtype=torch.long)
    _out_of_memory(_SLOT_GRADS(ds[0].dtype, len(ds), *table, start, stop, Hkv, g, hd, N, gk, gv, int(add),
                               torch.get_num_threads()), "MoDA slot-gradient")


def _torch_slot_grads(ds, probs, qs, dzt, reads, start, stop, gk, gv, add):
    """`moda_slot_grads`' twin in torch ops."""
    if not add:
        gk.zero_()
        gv.zero_()
    if not ds:
        return
    Hkv, g, hd, N = qs[0].shape
    n = stop - start
    for ds_r, probs_r, qs_r, dzt_r, reads_r in zip(ds, probs, qs, dzt, reads):
        hi = min(stop, reads_r)
        if hi > start:
            gk.view(n, N, Hkv, hd)[: hi - start] += torch.einsum("shjn,hjin->snhi", ds_r[start:hi], qs_r)
            gv.view(n, N, Hkv, hd)[: hi - start] += torch.einsum("shjn,hjin->snhi", probs_r[start:hi], dzt_r)


# -- a slot store ---------------------------------------------------------------------------------------------

@torch.library.custom_op("depthtools::moda_store_slot", mutates_args=("dst",))
def moda_store_slot(src: Tensor, dst: Tensor) -> None:
    """dst [Hkv,hd,B,T] (a slot of the buffer; src's dtype, or bfloat16 for float32 src: rounded to nearest even)
    = src [B,T,Hkv,hd], tokens last, in place (the kernel takes a contiguous dst, the twin any). The C kernel writes whole 64-byte rows with streaming
    stores where the CPU has them (`STREAM_STORES`)."""
    if cpu_kernels.moda_usable(src, dst.dtype) and dst.is_contiguous():
        src, rs = _rows(src)
        B, T, Hkv, hd = src.shape
        _STORE_SLOT(dst.dtype, src, rs, Hkv * hd, B * T, dst, int(STREAM_STORES), torch.get_num_threads())
    else:
        dst.copy_(src.permute(2, 3, 0, 1))


@moda_store_slot.register_fake
def _(src, dst):
    return None
