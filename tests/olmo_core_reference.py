"""DepthBench's OLMo-core fork, its forward written out in plain torch from reading the fork (for tests only).

`fork_logits(config, tensors, tokens)` computes what the fork's `Transformer.forward` computes for a step's
`config.json` and its state dict (the fork's names), in the tensors' dtype (tests use float64). Written from
keyu-wang-2002/DepthBench, pretrain/OLMo-core/src/olmo_core/: `nn/transformer/block.py` (each block's forward),
`nn/hyper_connections.py` (`_forward_hc`, `_forward_mhc`, `sinkhorn_log`; stream expand and reduce),
`nn/moda.py` (MoDAAttention: rotated query, un-rotated cached keys; MoDAFeedForwardDepthCache's `kv_proj` slot),
the AttnRes kernel's semantics (`fused_attnres`: RMSNorm keys, softmax over sources, mix, RMSNorm output at the
same eps), Liger's mHC reference (linkedin/Liger-Kernel test_mhc.py: phi = [pre | post | res], softmax-start
Sinkhorn with eps, out_o = sum_i H_res[o, i] x_i), and `Transformer.forward`'s heads (HC and PyTorch mHC: the LM
head's norm on every stream, then the sum; Liger mHC: the mean, then the norm; AttnRes: the final mix). It imports
nothing from depthtools: it is the independent computation the import is checked against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms(x, w, eps):
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if w is None else out * w


class Fork:
    """One model: its config sections and its tensors."""

    def __init__(self, config: dict, tensors: dict):
        self.model, self.t = config["model"], tensors
        self.block = self.model["block"]
        self.L, self.d = self.model["n_layers"], self.model["d_model"]
        attn = self.block.get("sequence_mixer") or self.block["attention"]
        self.H = attn["n_heads"]
        self.Hkv = attn.get("n_kv_heads") or self.H
        self.hd = self.d // self.H
        self.theta = attn["rope"]["theta"]
        norm = self.block["layer_norm"]
        self.eps = norm.get("eps") or 1e-5
        self.layer_norm = norm.get("name") == "default"
        self.head_eps = self.model["lm_head"]["layer_norm"].get("eps") or 1e-5
        self.kind = self.block["name"]

    def norm(self, x, name, eps=None):
        eps = self.eps if eps is None else eps
        w = self.t[name + ".weight"]
        if self.layer_norm:
            return F.layer_norm(x, (x.shape[-1],), w, None, eps)
        return rms(x, w, eps)

    def lin(self, x, name):
        return x @ self.t[name + ".weight"].T

    # -- attention and feed-forward ---------------------------------------------------------------------------
    def rope(self, x):  # x [B, T, h, hd], rotate-half pairing (i, i + hd/2)
        T, hd = x.shape[1], x.shape[-1]
        inv = 1.0 / (self.theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angles = torch.outer(torch.arange(T, dtype=torch.float64), inv)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        cos, sin = cos[None, :, None].to(x.dtype), sin[None, :, None].to(x.dtype)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def qkv(self, x, p):
        B, T, _ = x.shape
        q = self.lin(x, p + "w_q").view(B, T, self.H, self.hd)
        k = self.lin(x, p + "w_k").view(B, T, self.Hkv, self.hd)
        v = self.lin(x, p + "w_v").view(B, T, self.Hkv, self.hd)
        return q, k, v

    def attend(self, q, k, v, depth_k=None, depth_v=None):
        """Causal softmax over the sequence keys, and (MoDA) the same position's depth keys, in one softmax."""
        B, T, H, hd = q.shape
        rep = H // k.shape[2]
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        if depth_k is None:
            return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)
        dk, dv = depth_k.repeat_interleave(rep, 3), depth_v.repeat_interleave(rep, 3)  # [B, T, S, H, hd]
        depth = torch.einsum("bthd,btshd->bhts", q, dk) / math.sqrt(hd)
        p = torch.cat([scores, depth], -1).softmax(-1)
        return torch.einsum("bhts,bshd->bthd", p[..., :T], v) + torch.einsum("bhts,btshd->bthd", p[..., T:], dv)

    def attention(self, x, p):
        q, k, v = self.qkv(x, p)
        out = self.attend(self.rope(q), self.rope(k), v)
        return self.lin(out.reshape(*x.shape[:2], -1), p + "w_out")

    def ffn(self, x, p):
        return self.lin(F.silu(self.lin(x, p + "w1")) * self.lin(x, p + "w3"), p + "w2")

    # -- blocks -------------------------------------------------------------------------------------------------
    def residual_block(self, x, i):
        b, kind, L = f"blocks.{i}.", self.kind, self.L
        attn = lambda h: self.attention(h, b + "attention.")  # noqa: E731
        ffn = lambda h: self.ffn(h, b + "feed_forward.")  # noqa: E731
        if kind == "default":
            h = x + attn(self.norm(x, b + "attention_norm"))
            return h + ffn(self.norm(h, b + "feed_forward_norm"))
        if kind == "default_scaled":
            s = 1.0 / math.sqrt(i + 1)
            h = x + attn(self.norm(x, b + "attention_norm") * s)
            return h + ffn(self.norm(h, b + "feed_forward_norm") * s)
        if kind == "peri_norm":
            h = x + self.norm(attn(self.norm(x, b + "attention_norm")), b + "post_attention_norm")
            return h + self.norm(ffn(self.norm(h, b + "feed_forward_norm")), b + "post_feed_forward_norm")
        if kind == "deepnorm":
            a = (2 * L) ** 0.25
            h = self.norm(a * x + attn(x), b + "attention_norm")
            return self.norm(a * h + ffn(h), b + "feed_forward_norm")
        if kind == "keel":
            a = float(2 * L)
            out = attn(self.norm(x, b + "attention_norm"))
            h = x + out if i == 0 else self.norm(a * x + out, b + "post_attention_norm")
            out = ffn(self.norm(h, b + "feed_forward_norm"))
            return self.norm((h if i == 0 else a * h) + out, b + "post_feed_forward_norm")
        raise AssertionError(kind)

    # HC / mHC connectors on streams [B, T, n, d]
    def hc(self, H, c, branch):
        t = self.t
        normed = rms(H, None, 1e-8)
        alpha = t[c + "dynamic_alpha_scale"] * torch.tanh(normed @ t[c + "dynamic_alpha_proj"]) + t[c + "static_alpha"]
        mixed = torch.einsum("...st,...sd->...td", alpha, H)
        y = branch(mixed[..., 0, :])
        beta = t[c + "static_beta"] + t[c + "dynamic_beta_scale"] * torch.tanh(normed @ t[c + "dynamic_beta_proj"])
        return mixed[..., 1:, :] + y.unsqueeze(-2) * beta.unsqueeze(-1)

    @staticmethod
    def sinkhorn_log(z, iters):
        n = z.shape[-1]
        u, v = torch.zeros_like(z[..., 0]), torch.zeros_like(z[..., 0, :])
        for _ in range(iters):
            u = -math.log(n) - torch.logsumexp(z + v.unsqueeze(-2), dim=-1)
            v = -math.log(n) - torch.logsumexp(z + u.unsqueeze(-1), dim=-2)
        return torch.exp(z + u.unsqueeze(-1) + v.unsqueeze(-2)) * n

    def mhc(self, H, c, branch):
        t, n, hc = self.t, H.shape[-2], self.block["hyper_connections"]
        normed = rms(H.reshape(*H.shape[:-2], -1), None, 1e-8)
        pre = torch.sigmoid(t[c + "pre_gate"] * (normed @ t[c + "pre_dynamic_proj"]) + t[c + "pre_bias"])
        post = 2 * torch.sigmoid(t[c + "post_gate"] * (normed @ t[c + "post_dynamic_proj"]) + t[c + "post_bias"])
        res = t[c + "residual_gate"] * (normed @ t[c + "residual_dynamic_proj"]).reshape(*normed.shape[:-1], n, n)
        h_res = self.sinkhorn_log(res + t[c + "residual_bias"], hc.get("sinkhorn_iters", 20))
        y = branch(torch.einsum("...s,...sd->...d", pre, H))
        return torch.einsum("...st,...sd->...td", h_res, H) + y.unsqueeze(-2) * post.unsqueeze(-1)

    def liger(self, H, c, branch):
        t, n, hc = self.t, H.shape[-2], self.block["hyper_connections"]
        eps = hc.get("liger_sinkhorn_eps", 1e-6)
        x = H.reshape(*H.shape[:-2], -1)
        mix = (x @ t[c + "phi"]) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hc.get("liger_rms_eps", 1e-6))
        b = t[c + "b"]
        pre = torch.sigmoid(mix[..., :n] * t[c + "alpha_pre"] + b[:n])
        post = torch.sigmoid(mix[..., n:2 * n] * t[c + "alpha_post"] + b[n:2 * n]) * 2.0
        logits = mix[..., 2 * n:].reshape(*mix.shape[:-1], n, n) * t[c + "alpha_res"] + b[2 * n:].view(n, n)
        m = logits.softmax(-1) + eps
        m = m / (m.sum(-2, keepdim=True) + eps)
        for _ in range(hc.get("sinkhorn_iters", 20) - 1):
            m = m / (m.sum(-1, keepdim=True) + eps)
            m = m / (m.sum(-2, keepdim=True) + eps)
        y = branch((H * pre.unsqueeze(-1)).sum(-2))
        return torch.einsum("...oi,...ic->...oc", m, H) + post.unsqueeze(-1) * y.unsqueeze(-2)

    def hyper_forward(self, x):
        hc = self.block.get("hyper_connections") or {}
        kind = hc.get("kind", "hc" if self.kind == "hc" else "mhc")
        connect = {"hc": self.hc, "mhc": self.mhc, "liger_mhc": self.liger}[kind]
        n = hc.get("num_residual_streams", 4)
        H = x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1])
        for i in range(self.L):
            b = f"blocks.{i}."
            H = connect(H, b + "attention_hyper_connection.",
                        lambda u, b=b: self.attention(self.norm(u, b + "attention_norm"), b + "attention."))
            H = connect(H, b + "feed_forward_hyper_connection.",
                        lambda u, b=b: self.ffn(self.norm(u, b + "feed_forward_norm"), b + "feed_forward."))
        collapse = hc.get("collapse", "auto")
        mode = ("mean" if kind == "liger_mhc" else "sum") if collapse == "auto" else collapse
        w = self.t["lm_head.norm.weight"]
        if mode == "mean":
            return rms(H.mean(-2), w, self.head_eps)
        return rms(H, w, self.head_eps).sum(-2)

    # AttnRes
    @staticmethod
    def mix(query, sources, w, out_w, eps):
        v = torch.stack(sources)
        p = (rms(v, w, eps) * query.reshape(-1)).sum(-1).softmax(0)
        return rms((p.unsqueeze(-1) * v).sum(0), out_w, eps)

    def attnres_forward(self, x):
        size, t, eps = self.block.get("attnres_block_size") or 1, self.t, 1e-5  # the res norms' default eps
        states, prefix = None, x
        for i in range(self.L):
            b = f"blocks.{i}."
            if states is None:
                h_in, states, prefix = self.norm(x, b + "attention_norm"), [x], None
            else:
                residuals = [*states, prefix]
                if (2 * i) % size == 0:
                    states, prefix = residuals, None
                h_in = self.mix(t[b + "attn_res_proj.weight"], residuals, t[b + "attn_res_norm.weight"],
                                t[b + "attention_norm.weight"], eps)
            out = self.attention(h_in, b + "attention.")
            prefix = out if prefix is None else prefix + out
            residuals = [*states, prefix]
            if (2 * i + 1) % size == 0:
                states, prefix = residuals, None
            h_in = self.mix(t[b + "mlp_res_proj.weight"], residuals, t[b + "mlp_res_norm.weight"],
                            t[b + "feed_forward_norm.weight"], eps)
            out = self.ffn(h_in, b + "feed_forward.")
            prefix = out if prefix is None else prefix + out
        return self.mix(t["res_proj.weight"], [*states, prefix], t["res_norm.weight"], t["lm_head.norm.weight"], eps)

    # MoDA
    def moda_forward(self, x):
        post = self.kind == "post_norm_moda"
        B, T, _ = x.shape
        slots_k, slots_v = [], []  # each [B, T, n_kv, hd]
        for i in range(self.L):
            b = f"blocks.{i}."
            a_in = x if post else self.norm(x, b + "attention_norm")
            q, k, v = self.qkv(a_in, b + "attention.attention.")
            dk = torch.stack(slots_k, 2) if slots_k else None
            dv = torch.stack(slots_v, 2) if slots_v else None
            out = self.attend(self.rope(q), self.rope(k), v, dk, dv)
            out = self.lin(out.reshape(B, T, -1), b + "attention.attention.w_out")
            slots_k.append(k), slots_v.append(v)
            h = self.norm(x + out, b + "attention_norm") if post else x + out
            f_in = h if post else self.norm(h, b + "feed_forward_norm")
            if b + "feed_forward.kv_proj.weight" in self.t:
                kv = self.lin(f_in, b + "feed_forward.kv_proj").view(B, T, 2, self.Hkv, self.hd)
                slots_k.append(kv[:, :, 0]), slots_v.append(kv[:, :, 1])
            out = self.ffn(f_in, b + "feed_forward.feed_forward.")
            x = self.norm(h + out, b + "feed_forward_norm") if post else h + out
        return rms(x, self.t["lm_head.norm.weight"], self.head_eps)

    def forward(self, tokens):
        x = self.t["embeddings.weight"][tokens]
        if self.kind in ("hc", "mhc"):
            final = self.hyper_forward(x)
        elif self.kind == "attnres":
            final = self.attnres_forward(x)
        elif self.kind in ("moda", "post_norm_moda"):
            final = self.moda_forward(x)
        else:
            for i in range(self.L):
                x = self.residual_block(x, i)
            final = rms(x, self.t["lm_head.norm.weight"], self.head_eps)
        return final @ self.t["lm_head.w_out.weight"].T


def fork_logits(config: dict, tensors: dict, tokens: torch.Tensor) -> torch.Tensor:
    return Fork(config, tensors).forward(tokens)
