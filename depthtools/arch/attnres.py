"""Attention Residuals (Kimi Team 2026, arXiv 2603.15031): Full and Block AttnRes.

Instead of adding every sublayer output to one stream, each SUBLAYER attends over depth. Sublayer s
(2b = attention, 2b+1 = MLP of block b) owns a pseudo-query w_s [d] (zero init) and a key RMSNorm
gain gamma_s (init 1). With sources v_0 = embedding and v_i = raw output of sublayer i-1:

    alpha_i = softmax_i( w_s · RMSNorm_gamma_s(v_i) )        (no 1/sqrt(d) temperature)
    h_s     = Σ_i alpha_i v_i                                  (values are the raw sources)
    v_s+1   = f_s(Norm_s(h_s))                                 (the sublayer's own pre-norm)

and the final output is the same mix with its own query/key norm, then ln_final + unembedding.
Block AttnRes (`blockattnres`) groups sublayers into blocks of S (`attnres_block_size`): the
sources are b_0 = embedding, the completed block sums b_1..b_{n-1} and the running partial sum
of the current block. Sublayer s is a block boundary iff s mod S == 0; there the partial is
pushed into the bank before the mix (DepthBench / paper Fig. 2). Full AttnRes is exactly
S = 1 (every sublayer closes a block of one), so both share this code.

Mixers. Block 0's attention has a single source (the embedding) and no mixer: a mix over one
source is the identity (DepthBench). So there are 2L mixers of 2d parameters: extra = 4·L·d.
Where they live follows DepthBench's swap rule (exchange core weights, the block's MLP-side mixer,
and the mixer that CONSUMES the block's output; the block's own attention-side mixer stays):
  * `blocks.{b}.mlp_res`  — MLP-side mixer, on the Block, travels with it.
  * `scheme.attn_res.{b}` — attention-side mixer of position b+1 in the intact model, i.e. the
    mixer consuming block b's output; `scheme.final_res` consumes block L-1's output.
The state records which block ran last (`consumer`), and the next attention-side mix (or the
final mix / readout) uses that block's consuming mixer — so under a swap it travels with the
block, and in the intact model it is simply the next position's mixer.

Depth state (`SourceBank`): immutable; every step returns a new one. Readout at depth l is the
"next-consumer mix": the mix the next consumer (block l's attention-side mixer, or the final mixer
at l = L) computes over the sources so far; at l = L it is exactly what the logits use.
`final_query_readout` is the optional "final-query lens" (the final mixer over the sources so far).
Geometry = readout.

Computation (performance; same function either way). A run keeps its sources in one append-only
`DepthBank` (bankops.py) shared by its states: each pushed source gets its key dots with every
mixer's query at once, a mix reads n stored dots + one batched matmul over the buffer, and the
sources' gradients are formed lazily, in bulk for several mixes (O(L²) work in few passes instead
of ~10 per-source operations per (mix, source) pair). A step from a cached state that is not the
bank's newest (a sweep) re-pushes that state's sources into a fresh bank (copy-on-branch); a bank
whose mixer parameters changed since it was filled (optimizer step, edits) is not used. When a
`hook_attnres_weights_*` hook is attached, mixes run source by source (bankops' per-source
functions) so the weights can be read and edited. Option fused (True): False uses no bank and runs
the per-source path on the plain-autograd references of every fused Function (reference.py).

Skip rules (`skip_rules`, first = default):
  * "mask" (default): block l's outputs never enter the bank (later softmaxes renormalise over the
    remaining sources); the next mix uses the mixer the intact model would use there. With zero
    queries this is exactly Pre-LN's identity-skip (uniform average, RMSNorm is scale invariant),
    so it is the faithful analogue of "remove the block" — hence the default.
  * "next-output": block l contributes no sources AND the next mix (block l+1's
    attention-side mix, or the final mix) is replaced by the identity on the newest source.
In both, block-boundary bookkeeping (pushing the partial) is positional and still happens.
  * "depthbench" (DepthBench's `depth_probes.skip_block`, what `--protocol depthbench` uses): the block
    returns its input unchanged, running sum included, so a boundary it would close pushes nothing (the
    next boundary pushes the running sum); block 0 returns (embedding, [embedding]), making the embedding
    the running sum too (a second copy of it enters the bank at the next boundary); the next mix is the
    identity on the newest source only if it is a boundary mix (next block's attention closes a block,
    or the final mix), else the intact model's mixer. For Full AttnRes it equals "next-output" except
    when block 0 is skipped (the duplicated embedding source).

Eps (option mix_eps, default 0 = the model's norm_eps, so every norm shares it). With mix_eps > 0, every norm
that reads a mix takes it -- the key norms, the pre-norm of every sublayer but block 0's attention (which reads the
embedding alone), and the final norm -- while block 0's attention norm keeps norm_eps. That is DepthBench's AttnRes:
its fused kernel normalises keys and output at the res norms' eps (OLMo-core's RMSNorm default 1e-5) and only block
0's `attention_norm` uses the block eps (1e-6 in its runs). Under a swap the eps travels with the block's norm
(DepthBench's stays with the position); they differ only when block 0 moves.

Hooks (not a single residual stream: `hook_resid_*` are not used): per block
`hook_attnres_weights_attn|mlp` [B,T,n_sources] (depth-attention maps, editable),
`hook_attn_in|hook_mlp_in` [B,T,d] (the mixed branch input, before the sublayer's pre-norm),
`hook_attn_out|hook_mlp_out` (raw sublayer outputs = the new sources); on the scheme
`hook_attnres_weights_final` (fires on every readout, so once per forward).
Queries are excluded from weight decay (routing parameters, as DepthBench does for HC routing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch import reference
from depthtools.arch.bankops import DepthBank, MixGroups, bank_logits, bank_mix, bank_push, inv_rms, weighted_sum
from depthtools.arch.layers import BufferPool, RMSNorm
from depthtools.arch.scheme import ArchSpec, DepthRouting, NormSite, Option, ResidualScheme, profile_defaults
from depthtools.arch.torch_private import is_hooked, versions
from depthtools.errors import DepthToolsError

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig


@dataclass(frozen=True)
class SourceBank:
    """AttnRes depth state (immutable).

    sources:  completed sources, each [B,T,d] (Full: embedding + every sublayer output so far;
              Block: embedding b_0 + completed block sums).
    partial:  Block AttnRes' running sum of the current block's outputs [B,T,d], or None.
    depth:    positions applied so far (0 = the embedding state).
    consumer: block whose consuming mixer makes the next mix; None = identity on the newest
              source (depth 0, or after a "next-output" skip).
    bank:     the run's `DepthBank` holding `sources` in its first len(sources) slots (the fast
              path; append-only, shared by the states of one run), or None.
    handle:   the autograd handle of the bank's slot len(sources) - 1 (None without gradients).
    """

    sources: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None = None
    depth: int = 0
    consumer: int | None = None
    bank: DepthBank | None = field(default=None, compare=False, repr=False)
    handle: torch.Tensor | None = field(default=None, compare=False, repr=False)


class DepthMixer(nn.Module):
    """One AttnRes mixer: pseudo-query w (zero init) and key RMSNorm gain gamma (init 1).

    The key RMSNorm uses the model's `norm_eps` (default 1e-5, like every other norm here); the public
    reference implementation uses 1e-6. The two differ only for source vectors of RMS ~1e-3 or below;
    `ModelConfig(norm_eps=1e-6)` matches the reference (and changes the block norms' eps too).
    """

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.key_norm = RMSNorm(d_model, eps)
        self.column = -1  # this mixer's row in the bank's query matrix (set by the scheme)

    def forward(self, sources: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...],
                fused: bool = True) -> torch.Tensor:
        """Depth-attention weights [B,T,n] = softmax_i(w · RMSNorm_gamma(v_i)) (fused=False: `reference`)."""
        # w · (gamma ⊙ v_i / rms(v_i)) = (w ⊙ gamma) · v_i · scale_i
        logits = bank_logits if fused else reference.bank_logits
        return logits(self.query * self.key_norm.weight, sources, scales).softmax(-1)


def default_block_size(n_layer: int) -> int:
    """S = 2·ceil(L/8) sublayers: ≈8 blocks (paper: N≈8) made of whole transformer blocks."""
    return 2 * math.ceil(n_layer / 8)


class AttnResScheme(ResidualScheme):
    """Full / Block AttnRes over a bank of sources (see the module docstring)."""

    single_stream = False
    compile_region = "sublayer"  # the depth mixes keep their fused bank (its source count grows with depth)
    kernel_libraries = ("bank",)
    skip_rules = ("mask", "next-output", "depthbench")
    on_request_skip_rules = ("depthbench",)  # run by a skip sweep only when named (its default stays mask + next-output)

    @classmethod
    def option_schema(cls, arch: str) -> dict[str, Option]:
        """blockattnres: attnres_block_size (S in sublayers, default 2·ceil(L/8)); attnres has S = 1."""
        schema = {"attnres_block_size": Option("int", lambda c: default_block_size(c.n_layer), low=1)} \
            if arch == "blockattnres" else {}
        schema["fused"] = Option("bool", True, doc="False: the plain-autograd references (reference.py)")
        schema["mix_eps"] = Option("number", 0.0, low=0, doc="eps of the key norms, of every sublayer norm that "
                                   "follows a mix and of the final norm (0: norm_eps); DepthBench: 1e-5 beside "
                                   "block norms at 1e-6")
        return schema

    def __init__(self, cfg: ModelConfig, block_size: int = 1):
        super().__init__(cfg)
        if not isinstance(block_size, int) or block_size < 1:
            raise DepthToolsError(f"attnres_block_size must be a positive integer (sublayers), got {block_size!r}")
        self.block_size = block_size
        self.fused = self.opts.fused  # False: no DepthBank, plain-autograd references throughout
        # the eps of everything that reads a mix (DepthBench's res norms), see `mix_eps` in the module docstring
        self.mix_eps = float(self.opts.mix_eps) or cfg.norm_eps
        d, eps, L = cfg.d_model, self.mix_eps, cfg.n_layer
        self.attn_res = nn.ModuleList(DepthMixer(d, eps) for _ in range(L - 1))  # consumes block b's output
        self.final_res = DepthMixer(d, eps)  # consumes block L-1's output
        self.hook_attnres_weights_final = HookPoint()  # [B,T,n]
        # bank columns in the intact model's sublayer order: sublayer s (1..2L, 2L = the final mix) mixes
        # with column s - 1, so the mixers reading a source are a suffix of the columns (bankops.source_grad)
        self._mixers: list[DepthMixer | None] = [None] * (2 * L)
        for b, mixer in enumerate([*self.attn_res, self.final_res]):
            mixer.column = 2 * b + 1  # attn_res[b] mixes at sublayer 2(b+1); final_res at 2L
            self._mixers[mixer.column] = mixer
        # bank slots: the embedding + every block boundary (Full: every sublayer but the last)
        self.capacity = 2 + (2 * L) // block_size
        self._grad_pool = BufferPool()  # the banks' gradient buffers, reused from one backward to the next

    # -- construction -------------------------------------------------------------------------
    def build_block(self, block: nn.Module) -> None:
        d, eps = self.cfg.d_model, self.mix_eps
        # block 0's attention reads the embedding alone (no mix): its norm keeps the blocks' norm_eps
        block.attn_norm = RMSNorm(d, self.cfg.norm_eps if block.index == 0 else eps)
        block.mlp_norm = RMSNorm(d, eps)
        block.mlp_res = DepthMixer(d, eps)
        block.mlp_res.column = 2 * block.index  # block b's MLP is sublayer 2b + 1
        self._mixers[block.mlp_res.column] = block.mlp_res
        for name in ("attn", "mlp"):
            setattr(block, f"hook_attnres_weights_{name}", HookPoint())  # [B,T,n]
            setattr(block, f"hook_{name}_in", HookPoint())  # [B,T,d]

    def init_weights(self, model: nn.Module) -> None:
        """The final norm reads the final mix: it takes `mix_eps` (unchanged with the default)."""
        model.ln_final.eps = self.mix_eps

    def no_decay_names(self) -> tuple[str, ...]:
        return ("_res.",)

    def extra_flops(self) -> float:
        """Every mix over n sources: the key logits w·v_i and the sum Σ α_i v_i, 2d each per source.
        Sublayer s ≥ 1 mixes 1 + floor(s/S) banked sources plus the running partial when s mod S ≠ 0,
        the final mix 2 + floor((2L-1)/S); block 0's attention reads one source (no mix). Norms and
        softmax are elementwise (not counted)."""
        L, S = self.cfg.n_layer, self.block_size
        sources = sum(1 + s // S + (s % S != 0) for s in range(1, 2 * L)) + 2 + (2 * L - 1) // S
        return 4.0 * self.cfg.d_model * sources

    # -- the depth-state contract -------------------------------------------------------------
    def embed_state(self, x0: torch.Tensor) -> SourceBank:
        bank, handle = self._new_bank((x0,))
        return SourceBank(sources=(x0,), bank=bank, handle=handle)

    def step(self, position, block, state: SourceBank, home, rope) -> SourceBank:
        state = self._sublayer(2 * position, state, self.consuming_mixer(state), block, "attn", rope)
        state = self._sublayer(2 * position + 1, state, block.mlp_res, block, "mlp", rope)
        return replace(state, depth=position + 1, consumer=block.index)

    def skip(self, position: int, state: SourceBank, rule: str | None = None) -> SourceBank:
        rule = self._check_rule(rule)
        if rule == "depthbench":
            return self._skip_depthbench(position, state)
        for sublayer in (2 * position, 2 * position + 1):  # boundaries are structure: still close blocks
            state = self._close_block(sublayer, state)
        return replace(state, depth=position + 1, consumer=None if rule == "next-output" else position)

    def _skip_depthbench(self, position: int, state: SourceBank) -> SourceBank:
        """DepthBench's `depth_probes.skip_block` in our state: the skipped block returns its input (running sum,
        bank) unchanged, so nothing is pushed even at a boundary the block would have closed (the next boundary
        pushes the running sum instead); block 0 returns (embedding, [embedding]), so the embedding also becomes
        the running sum. The next mix is the identity on its newest source when it is a boundary mix (the next
        block's attention closes a block, or the final mix), else the mixer the intact model uses there."""
        partial = state.sources[0] if position == 0 and state.partial is None else state.partial
        boundary = position == self.cfg.n_layer - 1 or (2 * position + 2) % self.block_size == 0
        return replace(state, partial=partial, depth=position + 1, consumer=None if boundary else position)

    # -- DepthBench's protocol (depthtools.analysis.depthbench): its "attnres" family -----------------
    depthbench_family, depthbench_skip_rule = "attnres", "depthbench"
    depthbench_undefined = MappingProxyType({
        "usefulness_score": "its linear replacement returns one tensor where an AttnRes block returns "
                            "(output, source bank)"})

    def depthbench_state(self, state: SourceBank) -> torch.Tensor:
        """`forward_depth_states`' z_l: the raw mix the next consumer computes at a true boundary (every depth
        for Full AttnRes; Block AttnRes: depth 0, L and l whose attention closes a block, 2l mod S = 0), else
        the running sum the block returns."""
        l, S = state.depth, self.block_size
        if l in (0, self.cfg.n_layer) or (2 * l) % S == 0:
            return self.readout(state)
        return self.depthbench_block_output(state)

    def depthbench_block_output(self, state: SourceBank) -> torch.Tensor:
        """The running sum the block returns (the newest source where none is open; the embedding at 0)."""
        return state.partial if state.partial is not None else state.sources[-1]

    def depthbench_with_input(self, state: SourceBank, x: torch.Tensor) -> SourceBank:
        """The block's input (its running sum, else its newest source) replaced by x; a fresh bank follows."""
        if state.partial is not None:
            return replace(state, partial=x, bank=None, handle=None)
        return replace(state, sources=state.sources[:-1] + (x,), bank=None, handle=None)

    def readout(self, state: SourceBank) -> torch.Tensor:
        """Next-consumer mix [B,T,d]; at depth L the final mix the logits use."""
        return self._mix(state, self.consuming_mixer(state), self.hook_attnres_weights_final)

    def final_query_readout(self, state: SourceBank) -> torch.Tensor:
        """The "final-query lens": the final mixer applied to the sources available so far."""
        return self._mix(state, self.final_res, None)

    def geometry(self, state: SourceBank) -> torch.Tensor:
        return self.readout(state)

    def depth_routing(self, model, tokens, exclude_first):
        """The depth-attention maps (hooks hook_attnres_weights_{attn,mlp} and the scheme's
        hook_attnres_weights_final), token means; Block AttnRes' sources are block sums, placed at
        the depth of their newest sublayer (embedding 0, closed blocks m·S, the partial c)."""
        F64, L, S = torch.float64, self.cfg.n_layer, 2 * self.cfg.n_layer
        names = {f"blocks.{b}.hook_attnres_weights_{side}": 2 * b + k for b in range(L) for k, side in enumerate(("attn", "mlp"))}
        names["scheme.hook_attnres_weights_final"] = S
        cache: dict[int, torch.Tensor] = {}

        def store(tensor, hook):
            cache[names[hook.name]] = tensor.detach()[:, exclude_first:].to(F64).flatten(0, 1).mean(0)  # [n_src]

        with torch.no_grad(), model.hooks(fwd_hooks=[(name, store) for name in names]):
            model.readout(model.run_states(tokens)[-1])
        W = torch.full((S + 1, S + 1), math.nan, dtype=F64)
        notes = []
        for c in range(S + 1):
            weights, size = cache[c], self.block_size
            depths = [0] + [m * size for m in range(1, c // size + 1)] + ([c] if c % size else [])
            if len(depths) != len(weights):
                notes.append(f"consumer {c}: {len(weights)} sources, expected {len(depths)}; placed newest-last")
                depths = list(range(c + 1 - len(weights), c + 1))
            for d, value in zip(depths, weights.tolist()):
                W[c, d] = value
        return DepthRouting([(c, "attn" if c % 2 == 0 else "mlp") for c in range(S)] + [(S, "final")], W, notes)

    def written_tensor(self, state: SourceBank) -> torch.Tensor:
        """The newest source: the running partial sum the last block's outputs went into (Full: its MLP
        output), else the newest banked source (the embedding at depth 0)."""
        return state.sources[-1] if state.partial is None else state.partial

    # -- TransformerLens' cache functions ------------------------------------------------------
    def tl_limits(self) -> dict[str, str]:
        """Per-sublayer head/neuron results are exact (hook_attn_out/hook_mlp_out are the raw sources);
        there is no residual stream to accumulate or decompose."""
        reason = (f"{self.cfg.arch} has no residual stream: every sublayer reads a learned softmax mix over the "
                  "earlier sublayer outputs (hook_attn_in / hook_mlp_in, weights hook_attnres_weights_*), so there "
                  "is no hook_resid_* and the final norm reads the final depth mix; read depths with "
                  "model.readout / run_states (depthtools.analysis.lens) and use depthtools.analysis.contrib "
                  "for its decomposition")
        return {"stream": reason, "sum": reason}

    def tl_norm_site(self, block, sublayer: str):
        return NormSite(f"blocks.{block.index}.hook_{sublayer}_in", getattr(block, f"{sublayer}_norm"))

    # -- pieces -------------------------------------------------------------------------------
    def consuming_mixer(self, state: SourceBank) -> DepthMixer | None:
        """The mixer consuming the output of the block that ran last (None: identity on newest)."""
        if state.consumer is None:
            return None
        return self.final_res if state.consumer == self.cfg.n_layer - 1 else self.attn_res[state.consumer]

    def _sublayer(self, sublayer: int, state: SourceBank, mixer, block, name: str, rope) -> SourceBank:
        """Mix the bank into this sublayer's input, run it, add its output to the partial sum."""
        state = self._close_block(sublayer, state)
        h = getattr(block, f"hook_{name}_in")(self._mix(state, mixer, getattr(block, f"hook_attnres_weights_{name}")))
        norm = getattr(block, f"{name}_norm")
        y = self.run_attn(norm, block.attn, h, rope) if name == "attn" else self.run_mlp(norm, block.mlp, h)
        out = getattr(block, f"hook_{name}_out")(y)
        return replace(state, partial=out if state.partial is None else state.partial + out)

    def _close_block(self, sublayer: int, state: SourceBank) -> SourceBank:
        """At a block boundary (sublayer mod S == 0) push the running partial sum into the bank."""
        if sublayer % self.block_size or state.partial is None:
            return state
        p, sources = state.partial, state.sources + (state.partial,)
        bank = state.bank
        if bank is not None and bank.fill == len(state.sources) and self._bank_current(bank):
            handle = bank_push(bank, state.handle, p)  # the bank's newest state: append in place
        else:
            bank, handle = self._new_bank(sources)  # branching from an older state: copy-on-branch
        return replace(state, sources=sources, partial=None, bank=bank, handle=handle)

    def _mix(self, state: SourceBank, mixer: DepthMixer | None, hook) -> torch.Tensor:
        """Σ_i alpha_i v_i [B,T,d]; alpha from `mixer`, or one-hot on the newest source if None."""
        n = len(state.sources) + (state.partial is not None)
        identity = mixer is None or n == 1  # one-hot on the newest source (a 1-source softmax is this too)
        if hook is None or not is_hooked(hook):
            if identity:
                return state.partial if state.partial is not None else state.sources[-1]
            if state.bank is not None and self._bank_current(state.bank):
                return bank_mix(state.bank, state.handle, len(state.sources), mixer.column, state.partial)
        # per-source path (the depth-attention weights are hooked, or no usable bank)
        sources = state.sources if state.partial is None else state.sources + (state.partial,)
        if identity:
            weights = sources[-1].new_zeros(*sources[-1].shape[:-1], n)
            weights[..., -1] = 1.0
        else:
            weights = mixer(sources, tuple(self._scale(v) for v in sources), self.fused)  # [B,T,n]
        if hook is not None:
            weights = hook(weights)
        return (weighted_sum if self.fused else reference.weighted_sum)(weights, sources)

    # -- the fast path's bank -----------------------------------------------------------------
    def _fingerprint(self) -> tuple | None:
        """Storage and versions of the mixer parameters: the bank's dots are valid while unchanged
        (an optimizer step or any in-place edit bumps a version; .to()/.double() move the storage).
        None when the versions are unknown (`torch_private.versions`' fallback): then no bank is used."""
        params = self.__dict__.get("_mixer_params")
        if params is None:  # flat list once (nn.Module attribute lookups are slow per call)
            params = self.__dict__["_mixer_params"] = [p for m in self._mixers for p in (m.query, m.key_norm.weight)]
        counts = versions(params)
        return None if counts is None else (params[0].data_ptr(), counts)

    def _bank_current(self, bank: DepthBank) -> bool:
        fingerprint = self._fingerprint()
        return fingerprint is not None and bank.fingerprint == fingerprint

    def _new_bank(self, sources: tuple[torch.Tensor, ...]):
        """(bank, handle) holding `sources` (the queries of all mixers as they are now); (None, None)
        with option fused=False or when the mixers' versions are unknown (the per-source path)."""
        fingerprint = self._fingerprint() if self.fused else None
        if fingerprint is None:
            return None, None
        queries = torch.stack([m.query * m.key_norm.weight for m in self._mixers])  # [M,d]
        bank = DepthBank(sources[0], queries, max(self.capacity, len(sources)), self.mix_eps,
                         fingerprint, self._mix_groups(), self._grad_pool, column_floor=self.block_size)
        handle = None
        for v in sources:
            handle = bank_push(bank, handle, v)
        return bank, handle

    def _mix_groups(self) -> MixGroups:
        """The two-phase groups (bankops), from the intact model's mixes: sublayer s (1..2L-1) mixes
        over 1 + floor(s/S) banked sources with column s - 1; the final mix over 1 + floor((2L-1)/S)
        with column 2L - 1."""
        groups = self.__dict__.get("_groups")
        if groups is None:
            L, S = self.cfg.n_layer, self.block_size
            mixes = [(s - 1, 1 + s // S) for s in range(1, 2 * L)]
            groups = self.__dict__["_groups"] = MixGroups(mixes + [(2 * L - 1, 1 + (2 * L - 1) // S)])
        return groups

    def _scale(self, source: torch.Tensor) -> torch.Tensor:
        return inv_rms(source, self.mix_eps)


class FullAttnResScheme(AttnResScheme):
    """Full AttnRes: every sublayer output is its own source (block size S = 1)."""

    def __init__(self, cfg: ModelConfig):
        if "attnres_block_size" in cfg.options:
            raise DepthToolsError("attnres_block_size applies to blockattnres; Full AttnRes has S = 1")
        super().__init__(cfg, block_size=1)


class BlockAttnResScheme(AttnResScheme):
    """Block AttnRes: sources are block sums of S sublayers (option `attnres_block_size`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, block_size=self.options_for(cfg).attnres_block_size)


def _attnres_extra(cfg: ModelConfig) -> int:
    """(2L-1) sublayer mixers + 1 final mixer, 2d each (query + key-norm gain) = 4·L·d."""
    return 4 * cfg.n_layer * cfg.d_model


# DepthBench's res norms (key norms, the norms after a mix, the final norm) keep OLMo-core's RMSNorm eps 1e-5 while
# the profile sets every other norm's to 1e-6 (see `mix_eps` in the module docstring)
_DEPTHBENCH = profile_defaults({"mix_eps": 1e-5})

ARCH_SPECS = [
    ArchSpec(
        "attnres", "cross-layer",
        "Full AttnRes: each sublayer input = softmax_i(w·RMSNorm(v_i)) mix of embedding + all earlier sublayer outputs",
        "4·L·d", _attnres_extra, "Kimi Team 2026, Attention Residuals, arXiv 2603.15031",
        FullAttnResScheme, True, ("full_attnres",), profiles={"depthbench": _DEPTHBENCH},
    ),
    ArchSpec(
        "blockattnres", "cross-layer",
        "Block AttnRes: depth attention over embedding + block sums of S sublayers + running partial "
        "(option attnres_block_size, default 2·ceil(L/8))",
        "4·L·d", _attnres_extra, "Kimi Team 2026, Attention Residuals, arXiv 2603.15031",
        BlockAttnResScheme, True, ("block_attnres",), profiles={"depthbench": _DEPTHBENCH},
    ),
]
