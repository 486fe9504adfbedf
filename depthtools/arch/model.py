"""`DepthModel`: one decoder-only LM for every architecture, with the depth-state contract.

Read top to bottom: a `Plan` says which block runs at each depth position; `Block` holds one
block's parameters; `DepthModel` embeds tokens into a state z_0, applies blocks position by
position through the architecture's `ResidualScheme`, and reads logits from any state with
`head(state) = unembed(ln_final(readout(state)))`. `run` can start from a cached state at any
depth, so sweeps never recompute a shared prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from torch import nn
from transformer_lens import HookedRootModule
from transformer_lens.config import TransformerLensConfig
from transformer_lens.hook_points import HookPoint

from depthtools.arch.backbone import backbone, rotary_dim, softcap
from depthtools.arch.layers import Attention, SwiGLU, make_norm, rope_tables
from depthtools.arch.moe import MoE
from depthtools.arch.registry import get_arch, validate_model_config
from depthtools.arch.scheme import ResidualScheme, State
from depthtools.arch.tl_cache import DepthCache
from depthtools.arch.torch_private import global_module_hooks, is_hooked
from depthtools.errors import DepthToolsError

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig


@dataclass(frozen=True)
class Plan:
    """An intervention on depth: which block runs where, which positions are bypassed.

    order:   block index run at each position (None = 0..L-1). A swap exchanges two entries.
    skip:    positions whose block is bypassed (the scheme's skip rule, `skip_rule` or default).
    replace: position -> function State -> State run instead of the block (mean/linear ablation).
    """

    order: tuple[int, ...] | None = None
    skip: frozenset[int] = frozenset()
    replace: Mapping[int, Callable[[State], State]] = field(default_factory=dict)
    skip_rule: str | None = None

    @classmethod
    def skipping(cls, *positions: int, rule: str | None = None) -> "Plan":
        return cls(skip=frozenset(positions), skip_rule=rule)

    @classmethod
    def swapping(cls, i: int, j: int, n_layer: int) -> "Plan":
        order = list(range(n_layer))
        order[i], order[j] = order[j], order[i]
        return cls(order=tuple(order))

    def block_at(self, position: int) -> int:
        return position if self.order is None else self.order[position]

    def first_change(self, n_layer: int) -> int:
        """Earliest position where this plan differs from the intact model (n_layer if none)."""
        changed = [p for p in range(n_layer) if self.block_at(p) != p]
        changed += list(self.skip) + list(self.replace)
        return min(changed, default=n_layer)

    def validate(self, n_layer: int) -> None:
        if self.order is not None and sorted(self.order) != list(range(n_layer)):
            raise DepthToolsError(f"plan order must be a permutation of 0..{n_layer - 1}, got {self.order}")
        bad = [p for p in [*self.skip, *self.replace] if not 0 <= p < n_layer]
        if bad:
            raise DepthToolsError(f"plan positions {sorted(bad)} out of range 0..{n_layer - 1}")


class Block(nn.Module):
    """One block's parameters: attention and SwiGLU sublayers plus the scheme's extras.

    The hook points are TransformerLens' names; which tensors they carry is documented by the
    architecture (for the additive family: resid_pre + attn_out = resid_mid exactly).
    """

    hook_out_is_single_residual_stream = True

    def __init__(self, cfg: ModelConfig, index: int, scheme: ResidualScheme):
        super().__init__()
        self.index = index
        self.attn = Attention(cfg, index)
        self.mlp = MoE(cfg, SwiGLU) if backbone(cfg).is_moe(index) else SwiGLU(cfg)
        self.hook_resid_pre, self.hook_resid_mid, self.hook_resid_post = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_out, self.hook_mlp_out = HookPoint(), HookPoint()
        scheme.build_block(self)
        self.hook_out_is_single_residual_stream = scheme.single_stream


class DepthModel(HookedRootModule):
    """Decoder-only LM: RoPE, SwiGLU, RMSNorm, untied embeddings, any residual scheme.

    The contract (docs/design.md §3): `embed`, `block_step`, `readout`, `geometry`, `head`, `run`,
    `run_states`. `forward(tokens)` = `run(tokens)` = logits [B,T,V].
    """

    def __init__(self, cfg: ModelConfig, seed: int | None = None):
        super().__init__()
        cfg = validate_model_config(cfg)  # a config built before the registry loaded is checked (and named) here
        spec = get_arch(cfg.arch)
        if seed is not None:
            torch.manual_seed(seed)
        self.config = cfg
        bb = self.backbone = backbone(cfg)  # the Pre-LN options (defaults for every other architecture)
        self.cfg = TransformerLensConfig(  # what TransformerLens tools read
            d_model=cfg.d_model, d_head=cfg.head_dim, n_layers=cfg.n_layer, n_ctx=cfg.max_seq_len,
            n_heads=cfg.n_heads, d_mlp=cfg.d_ff, d_vocab=cfg.vocab_size, n_key_value_heads=cfg.n_kv_heads,
            normalization_type="RMS" if bb.norm == "rms" else "LN", uses_rms_norm=bb.norm == "rms",
            eps=cfg.norm_eps, gated_mlp=bb.mlp == "gated", act_fn={"gelu_tanh": "gelu_new"}.get(bb.mlp_act, bb.mlp_act),
            positional_embedding_type="rotary" if bb.positions == "rope" else "standard", device="cpu",
        )
        self.scheme = spec.build_scheme(cfg)
        self.compiled = None  # depthtools.arch.compiled.CompiledRegions while training compiled
        self.stream = None  # depthtools.arch.stream.Streamer: weights streamed block by block, or over devices
        self.config = self.scheme.recorded_config()  # cfg with changed-default options written out
        self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.hook_embed = HookPoint()
        if bb.positions == "learned":  # absolute positions (GPT-2); TransformerLens' hook_pos_embed
            self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model)
            self.hook_pos_embed = HookPoint()
        self.blocks = nn.ModuleList(Block(cfg, i, self.scheme) for i in range(cfg.n_layer))
        self.ln_final = make_norm(cfg, hooked=True)
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab_size, bias=bb.head_bias)
        if cfg.tie_embeddings:
            self.unembed.weight = self.tok_embed.weight
        cos, sin = rope_tables(rotary_dim(cfg), cfg.max_seq_len, cfg.rope_theta, bb.rope)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("_b_U", torch.zeros(cfg.vocab_size), persistent=False)
        self._init_weights()
        self.setup()

    # -- init ---------------------------------------------------------------------------------
    def _init_weights(self) -> None:
        """Truncated normal (std 0.02, ±3 std) for every matrix; norms 1; then the scheme's rules."""
        std = self.config.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
        self.scheme.init_weights(self)

    # -- TransformerLens compatibility --------------------------------------------------------
    @property
    def W_U(self) -> torch.Tensor:  # [d_model, d_vocab]
        """The unembedding, NOT folded with ln_final's gain: TransformerLens' functions on this model's
        cache apply the whole final norm (gain included; see tl_cache.py), so x_normed @ W_U + b_U
        = unembed(x_normed) on every path."""
        return self.unembed.weight.T

    @property
    def b_U(self) -> torch.Tensor:
        """[d_vocab] zeros, or a final LayerNorm's bias folded through the unembedding (GPT-2, NeoX):
        ln_final(x) @ W_U = (ln_final(x) - bias) @ W_U + b_U, as TransformerLens folds it (tl_cache.py),
        plus the unembedding's own bias where it has one (`head_bias`: Phi)."""
        bias = getattr(self.ln_final, "bias", None)
        folded = self._b_U if bias is None else bias @ self.W_U
        return folded if self.unembed.bias is None else folded + self.unembed.bias

    @property
    def n_layer(self) -> int:
        return self.config.n_layer

    def tokens_to_residual_directions(self, tokens) -> torch.Tensor:
        """[..., d_model] unembedding direction of each token id (TransformerLens' logit_attrs reads it)."""
        if isinstance(tokens, str):
            raise DepthToolsError("this model has no tokenizer: pass token ids, not strings")
        return self.W_U.T[torch.as_tensor(tokens, device=self.W_U.device)]

    def to_single_token(self, string: str) -> int:
        raise DepthToolsError(f"this model has no tokenizer: pass the token id of {string!r}, not the string")

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """[d_model] sum of the output biases (attention b_O, MLP b_out, times the branch factor) written into
        the stream before block `layer`'s attention (mlp_input: before its MLP), as TransformerLens defines
        it (its get_full_resid_decomposition reads it); zeros for bias-free models."""
        total = self.W_U.new_zeros(self.config.d_model)
        for index, block in enumerate(self.blocks[: layer + (1 if mlp_input else 0)]):
            parts = [("attn", block.attn.w_o.bias)]
            if include_mlp_biases and index < layer:
                parts.append(("mlp", getattr(getattr(block.mlp, "w2", None), "bias", None)))  # none on an MoE
            for sublayer, bias in parts:
                if bias is not None:
                    total = total + bias * self.scheme.tl_branch_scale(block, sublayer)
        return total

    def run_with_cache(self, *args, return_cache_object: bool = True, remove_batch_dim: bool = False, **kwargs):
        """As HookedRootModule's, but returns a TransformerLens `ActivationCache` by default: a `DepthCache`,
        whose functions are exact on this architecture or refuse with the reason (tl_cache.py)."""
        out, cache = super().run_with_cache(*args, remove_batch_dim=remove_batch_dim, **kwargs)
        if return_cache_object:
            cache = DepthCache(cache, self, has_batch_dim=not remove_batch_dim)
        return out, cache

    # -- the depth-state contract -------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> State:
        """z_0: the initial depth state for tokens [B,T]."""
        if tokens.dim() != 2:
            raise DepthToolsError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.config.max_seq_len:
            raise DepthToolsError(
                f"sequence length {tokens.shape[1]} exceeds the model's context {self.config.max_seq_len}"
            )
        # The id-range check reads two values back from the device; on CUDA it would stall every training
        # step, so it runs on CPU only (the trainer checks the data's vocabulary once, before training).
        if tokens.device.type == "cpu" and tokens.numel() and (
                int(tokens.max()) >= self.config.vocab_size or int(tokens.min()) < 0):
            raise DepthToolsError(
                f"token ids must lie in 0..{self.config.vocab_size - 1} (wrong tokenizer?); "
                f"got {int(tokens.min())}..{int(tokens.max())}"
            )
        x = self.tok_embed(tokens)
        if self.backbone.embed_scale != 1.0:  # Gemma: √d, at the embedding's own precision
            x = x * torch.tensor(self.backbone.embed_scale, dtype=x.dtype)
        x = self.hook_embed(x)
        if self.backbone.positions == "learned":
            positions = self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
            x = x + self.hook_pos_embed(positions.expand_as(x))  # [B,T,d] as TransformerLens hooks it
        return self.scheme.embed_state(x)

    def block_step(self, position: int, state: State, block: int | None = None) -> State:
        """Apply block `block` (default: the one built for `position`) at depth `position`.

        With compiled regions attached (`depthtools.arch.compiled.enable`, the trainer's --compile), a
        training step (autograd recording) of an unhooked block at its own position runs compiled;
        everything else (hooks, plans that move blocks, no_grad evaluation and analyses) runs eagerly."""
        running = self.blocks[position if block is None else block]
        home = self.blocks[position]
        if self.stream is not None:  # materialise the block (streamed weights), run it on its device
            return self.stream.step(position, running, state, home)
        compiled = self.compiled
        if (compiled is not None and running is home and torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and compiled.unhooked(running)):
            return compiled.step(position, running, state, (self.rope_cos, self.rope_sin))
        return self.scheme.step(position, running, state, home, (self.rope_cos, self.rope_sin))

    def readout(self, state: State) -> torch.Tensor:
        """[B,T,d]: what the final norm reads if the network stopped at this state."""
        return self.scheme.readout(state)

    def geometry(self, state: State) -> torch.Tensor:
        """[B,T,k]: the depth state as a vector for similarity/angle metrics."""
        return self.scheme.geometry(state)

    def head(self, state: State) -> torch.Tensor:
        """Logits [B,T,V] = unembed(ln_final(readout(state))) — the lens at any depth (soft-capped where
        the model's own logits are, Gemma-2's final_softcap; a scheme may norm before it collapses:
        `ResidualScheme.final_hidden`)."""
        return softcap(self.unembed(self.scheme.final_hidden(state, self.ln_final)), self.backbone.final_softcap)

    def hidden_logits(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [..., V] of final-hidden rows x [..., d] (`ResidualScheme.final_hidden`, already through the
        final norm): unembed(x), soft-capped where the model's own logits are. The logit lens and task probes
        read through this, so they decode a few gathered rows with the model's own head.

        `out`: a [..., V] tensor of x's dtype and device to write them into (returned), so a probe decoding
        many plans or depths reuses one block of memory instead of a fresh one per call (on CPU a 200 MB block
        is paged in and zeroed again every time: `headmetrics.LogitsBuffer`). Taken only where it gives the
        module's own numbers bit for bit -- a plain bias-free nn.Linear without hooks (a streamed head's
        weights arrive through its pre-hook), outside autograd -- else ignored."""
        unembed, cap = self.unembed, self.backbone.final_softcap
        if out is None or type(unembed) is not nn.Linear or unembed.bias is not None or is_hooked(unembed) or \
                global_module_hooks() or out.dtype != x.dtype or x.dtype != unembed.weight.dtype or \
                out.device != x.device or (torch.is_grad_enabled() and (x.requires_grad or
                                                                        unembed.weight.requires_grad)):
            return softcap(unembed(x), cap)
        torch.matmul(x, unembed.weight.t(), out=out)  # what F.linear computes for a bias-free layer: one mm
        return out.div_(cap).tanh_().mul_(cap) if cap else out  # `softcap`'s ops in its order, in place

    def readout_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of readout vectors x [..., d]: unembed(ln_final(x)), soft-capped where the model's
        own logits are (Gemma-2's final_softcap). Every lens reads through this."""
        return softcap(self.unembed(self.ln_final(x)), self.backbone.final_softcap)

    def apply_position(self, position: int, state: State, plan: Plan | None = None) -> State:
        """One depth step under a plan: replace, skip, or run the planned block."""
        if plan is not None:
            if position in plan.replace:
                return plan.replace[position](state)
            if position in plan.skip:
                if self.stream is not None:  # a skip rule may read the bypassed block's parameters (HC)
                    return self.stream.skip(position, state, plan.skip_rule)
                return self.scheme.skip(position, state, plan.skip_rule)
            return self.block_step(position, state, plan.block_at(position))
        return self.block_step(position, state)

    def run_states(
        self,
        tokens: torch.Tensor | None = None,
        plan: Plan | None = None,
        start: int = 0,
        from_state: State | None = None,
        stop: int | None = None,
    ) -> list[State]:
        """States z_start..z_stop (inclusive), from tokens or from a cached state at `start`."""
        stop = self.n_layer if stop is None else stop
        if plan is not None:
            plan.validate(self.n_layer)
        if from_state is None:
            if tokens is None:
                raise DepthToolsError("run needs tokens or from_state")
            if start != 0:
                raise DepthToolsError("start > 0 needs from_state (the cached state at that depth)")
            from_state = self.embed(tokens)
        if not 0 <= start <= stop <= self.n_layer:
            raise DepthToolsError(f"need 0 <= start <= stop <= {self.n_layer}, got start={start}, stop={stop}")
        states = [from_state]
        for position in range(start, stop):
            states.append(self.apply_position(position, states[-1], plan))
        return states

    def run(
        self,
        tokens: torch.Tensor | None = None,
        plan: Plan | None = None,
        start: int = 0,
        from_state: State | None = None,
    ) -> torch.Tensor:
        """Logits [B,T,V] of the network under `plan`, optionally from the cached state at `start`."""
        return self.head(self.run_states(tokens, plan, start, from_state)[-1])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.run(tokens)

    # -- sizes --------------------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Exact parameter counts: total, embedding (input + output), non-embedding."""
        total = sum(p.numel() for p in self.parameters())
        embedding = self.tok_embed.weight.numel()
        if not self.config.tie_embeddings:
            embedding += self.unembed.weight.numel()
        return {"total": total, "embedding": embedding, "non_embedding": total - embedding}
