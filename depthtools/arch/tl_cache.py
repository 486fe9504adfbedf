"""`DepthCache`: TransformerLens' `ActivationCache`, exact on every architecture or refusing with the reason.

`DepthModel.run_with_cache` returns one. It is TransformerLens' own class with a few methods wrapped, so
that each function either reproduces the model's own stream / logits or raises one `DepthToolsError`
naming the architecture and why:

* Refusals come from the scheme (`ResidualScheme.tl_limits`): it lists the `TL_CAPABILITIES` (scheme.py)
  its architecture does not meet, with a reason; each function below needs some of them (`NEEDS`).
  E.g. Post-LN's stream is the depth state (accumulated_resid, logit_lens are exact) but not a sum of
  the sublayer outputs (decompose_resid is refused); HC/mHC and AttnRes have no hook_resid_* at all.
  A missing resid hook on such an architecture raises the same reason (a KeyError too) instead of a
  bare KeyError.
* The final norm's gain. TransformerLens' cached-scale normalisation (`apply_ln_to_stack` without
  recompute, so decompose_resid(apply_ln=True), logit_attrs, stack_*_results(apply_ln=True),
  get_full_resid_decomposition(apply_ln=True)) divides by the cached RMS only: it assumes the gain was
  folded into W_U (fold_ln). Folding it into `model.W_U` instead would make the other path wrong:
  accumulated_resid(apply_ln=True) and TL's logit_lens apply the real `ln_final` module (gain
  included) and then W_U, and TL's logit_lens checks `ln_final -> W_U` against the model's logits.
  So W_U stays the real unembedding (= model.unembed) and this cache's cached-scale path applies the
  whole norm, x / scale ⊙ gain: every `apply_ln` result is what the norm itself outputs, on both
  paths, and `@ model.W_U + model.b_U` of its sum gives the logits. `model(tokens)` is untouched.
* Block norms (`apply_ln_to_stack(layer=l < L)`): the norms carry no hook_scale (nothing added to the
  forward); the scale is recomputed from the cached tensor the norm reads (`scheme.tl_norm_site`:
  hook_resid_pre/mid for single-stream blocks, hook_branch_in for HC, hook_attn_in for AttnRes), times
  the norm's gain and LNS' constant factor. Sublayers without a pre-norm are refused.
* The pretrained families (backbone.py): Gemma's (1+w) gains and LayerNorm's centring are applied as the
  norm applies them; a final LayerNorm's bias is not a component's: it is folded into `model.b_U`
  (bias @ W_U, as TransformerLens' fold_ln does), so every normalised stack excludes it on both paths and
  `stack @ W_U + b_U` is still the logits. Attention/MLP output biases are not a head's or neuron's:
  head and neuron results exclude them (TransformerLens' convention) and get_full_resid_decomposition
  adds them as its "bias" component (`model.accumulated_bias`). A final logit soft-cap (Gemma-2) makes
  the logits a nonlinear function of `stack @ W_U`: logit_lens and logit_attrs refuse (capability
  "linear_head"); the normalised stacks themselves stay exact.
* Per-head / per-neuron results use `attn.W_O` [H,hd,d] and `mlp.W_out` [d_ff,d] (layers.py) times the
  scheme's branch factor (`tl_branch_scale`: ReZero/LayerScale gains, depth-μP multipliers), so they
  sum to hook_attn_out / hook_mlp_out.
"""

from __future__ import annotations

import inspect

import torch
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice

from depthtools.arch.backbone import norm_centers, norm_gain
from depthtools.arch.scheme import NormSite
from depthtools.errors import DepthToolsError

# which capabilities (scheme.TL_CAPABILITIES) each ActivationCache function needs to be exact
NEEDS: dict[str, tuple[str, ...]] = {
    "accumulated_resid": ("stream",),
    "logit_lens": ("stream", "linear_head"),
    "logit_attrs": ("linear_head",),
    "decompose_resid": ("sum",),
    "stack_head_results": ("sum", "heads"),
    "compute_head_results": ("heads",),
    "get_neuron_results": ("neurons",),
    "stack_neuron_results": ("sum", "neurons"),
    "get_full_resid_decomposition": ("sum", "heads"),  # + "neurons" with expand_neurons (the default)
}


class NotInCacheError(DepthToolsError, KeyError):
    """A hook this architecture never fires (e.g. hook_resid_pre on HC); a KeyError too."""

    __str__ = BaseException.__str__  # the message, not KeyError's repr of it


def _scaled(x: torch.Tensor, scale) -> torch.Tensor:
    """x times a branch / norm factor (float, [1] or [d] tensor) over its last (d_model) dimension."""
    if isinstance(scale, float) and scale == 1.0:
        return x
    return x * scale


def _fold(projection: torch.Tensor, scale) -> torch.Tensor:
    """A [d] or [d, n] projection with a [d]-wise factor folded in: (x ⊙ s) · p = x · (s ⊙ p)."""
    if isinstance(scale, torch.Tensor) and scale.numel() > 1 and projection.ndim == 2:
        scale = scale[:, None]
    return _scaled(projection, scale)


class DepthCache(ActivationCache):
    """TransformerLens' ActivationCache for a `DepthModel` (see the module docstring)."""

    # -- refusals -----------------------------------------------------------------------------
    def _require(self, function: str, *capabilities: str) -> None:
        limits = self.model.scheme.tl_limits()
        for capability in capabilities or NEEDS[function]:
            if capability in limits:
                raise DepthToolsError(f"cache.{function}() would not be exact: {limits[capability]}")

    def __getitem__(self, key) -> torch.Tensor:
        try:
            return super().__getitem__(key)
        except KeyError as error:
            reason = self.model.scheme.tl_limits().get("stream")
            if reason is None or "hook_resid" not in str(error):
                raise
            raise NotInCacheError(f"{error.args[0]!r} is not in the cache: {reason}") from error

    def apply_slice_to_batch_dim(self, batch_slice) -> "DepthCache":
        sliced = super().apply_slice_to_batch_dim(batch_slice)
        return DepthCache(sliced.cache_dict, self.model, has_batch_dim=sliced.has_batch_dim)

    # -- the stream ---------------------------------------------------------------------------
    def accumulated_resid(self, *args, **kwargs):
        self._require("accumulated_resid")
        return super().accumulated_resid(*args, **kwargs)

    def logit_lens(self, **kwargs):
        self._require("logit_lens")
        return super().logit_lens(**kwargs)

    def logit_attrs(self, *args, **kwargs):
        self._require("logit_attrs")
        return super().logit_attrs(*args, **kwargs)

    def decompose_resid(self, *args, **kwargs):
        self._require("decompose_resid")
        return super().decompose_resid(*args, **kwargs)

    def get_full_resid_decomposition(self, *args, **kwargs):
        bound = inspect.signature(ActivationCache.get_full_resid_decomposition).bind(self, *args, **kwargs)
        bound.apply_defaults()
        needs = NEEDS["get_full_resid_decomposition"] + (("neurons",) if bound.arguments["expand_neurons"] else ())
        self._require("get_full_resid_decomposition", *needs)
        return super().get_full_resid_decomposition(*args, **kwargs)

    # -- heads and neurons --------------------------------------------------------------------
    def _fill_head_results(self) -> None:
        """blocks.{l}.attn.hook_result [.., H, d] = z_h @ W_O[h] · branch factor, for layers not cached yet."""
        model = self.model
        for layer, block in enumerate(model.blocks):
            key = f"blocks.{layer}.attn.hook_result"
            if key not in self.cache_dict:
                z = self[f"blocks.{layer}.attn.hook_z"]
                result = torch.einsum("...hd,hdm->...hm", z, block.attn.W_O.to(z.dtype))
                self.cache_dict[key] = _scaled(result, model.scheme.tl_branch_scale(block, "attn"))

    def compute_head_results(self) -> None:
        self._require("compute_head_results")
        self._fill_head_results()

    def stack_head_results(self, *args, **kwargs):
        self._require("stack_head_results")
        self._fill_head_results()
        return super().stack_head_results(*args, **kwargs)

    def get_neuron_results(self, layer: int, neuron_slice=None, pos_slice=None, project_output_onto=None):
        self._require("get_neuron_results")
        scale = self.model.scheme.tl_branch_scale(self.model.blocks[layer], "mlp")
        if project_output_onto is not None:
            return super().get_neuron_results(layer, neuron_slice, pos_slice, _fold(project_output_onto, scale))
        return _scaled(super().get_neuron_results(layer, neuron_slice, pos_slice), scale)

    def stack_neuron_results(self, layer, pos_slice=None, neuron_slice=None, return_labels=False,
                             incl_remainder=False, apply_ln=False, project_output_onto=None, mlp_input=False):
        self._require("stack_neuron_results")
        if not (apply_ln and project_output_onto is not None):  # per-neuron results + apply_ln_to_stack
            return super().stack_neuron_results(layer, pos_slice, neuron_slice, return_labels, incl_remainder,
                                                apply_ln, project_output_onto, mlp_input)
        # TransformerLens' projected apply_ln divides by the scale only; with the norm's gain folded
        # into the projection, LN(x) · p = (x · (g ⊙ p)) / scale.
        target = self._layer(layer)
        site = self._site(target, mlp_input)
        folded = _fold(project_output_onto, self._gain(site))
        if norm_centers(site.norm):  # LayerNorm: centred(x) · q = x · (q - mean_d(q))
            folded = folded - folded.mean(0, keepdim=True)
        out = super().stack_neuron_results(layer, pos_slice, neuron_slice, return_labels, incl_remainder, False,
                                           folded, mlp_input)
        stack, labels = out if return_labels else (out, None)
        scale = self._get_cached_ln_scale(target, mlp_input, pos_slice if isinstance(pos_slice, Slice)
                                          else Slice(pos_slice))
        stack = stack / (scale if project_output_onto.ndim == 2 else scale[..., 0])
        return (stack, labels) if return_labels else stack

    # -- normalisation ------------------------------------------------------------------------
    def _layer(self, layer: int | None) -> int:
        """TransformerLens' layer index for norms: None / -1 = n_layers (the final norm)."""
        n = self.model.cfg.n_layers
        layer = n if layer is None else layer
        return layer + n + 1 if layer < 0 else layer

    def _site(self, layer: int, mlp_input: bool) -> NormSite:
        """The norm read at TransformerLens layer `layer` (n_layers = the final norm)."""
        model = self.model
        if layer == model.cfg.n_layers:
            return NormSite("ln_final.hook_scale", model.ln_final)
        if not 0 <= layer < model.cfg.n_layers:
            raise DepthToolsError(f"layer {layer} is out of range 0..{model.cfg.n_layers} (n_layers = the final norm)")
        site = model.scheme.tl_norm_site(model.blocks[layer], "mlp" if mlp_input else "attn")
        if isinstance(site, str):
            raise DepthToolsError(f"cache.apply_ln_to_stack(layer={layer}) would not be exact: {site}")
        return site

    @staticmethod
    def _gain(site: NormSite):
        gain = norm_gain(site.norm)  # w, Gemma's 1 + w, or none
        return site.factor if gain is None else _scaled(gain, site.factor)

    def _get_cached_ln_scale(self, layer, mlp_input, pos_slice, batch_slice=None) -> torch.Tensor:
        """The final norm's cached scale, or a block norm's recomputed from the tensor it reads."""
        layer = self._layer(layer)
        if layer == self.model.cfg.n_layers:
            return super()._get_cached_ln_scale(layer, mlp_input, pos_slice, batch_slice)
        site = self._site(layer, mlp_input)
        x = self[site.hook]
        if norm_centers(site.norm):
            x = x - x.mean(-1, keepdim=True)
        scale = pos_slice.apply((x.pow(2).mean(-1, keepdim=True) + site.norm.eps).sqrt(), dim=-2)
        if batch_slice is not None and self.has_batch_dim:
            scale = batch_slice.apply(scale)
        return scale

    def apply_ln_to_stack(self, residual_stack, layer=None, mlp_input=False, pos_slice=None, batch_slice=None,
                          has_batch_dim=True, recompute_ln=False):
        """The norm at `layer` applied to every entry as the model applies it: cached scale AND gain
        (TransformerLens' own omits the gain), or with recompute_ln at the final norm the ln_final module."""
        layer = self._layer(layer)
        site = self._site(layer, mlp_input)
        out = super().apply_ln_to_stack(residual_stack, layer, mlp_input, pos_slice, batch_slice, has_batch_dim,
                                        recompute_ln)
        if recompute_ln and layer == self.model.cfg.n_layers:
            bias = getattr(self.model.ln_final, "bias", None)  # folded into model.b_U instead (see there)
            return out if bias is None else out - bias  # the real ln_final module, gain included
        return _scaled(out, self._gain(site))
