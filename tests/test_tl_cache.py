"""TransformerLens' ActivationCache functions on every registered architecture: each either reproduces the
model's own stream / logits (float32, 1e-4) or raises one clear error naming the architecture and why.

The models are float32, moved off their init, with norm gains and branch gains far from 1 (a missing
gain fold is caught). Expected refusals are spelled out per architecture below, not read from the
code under test; every registered architecture must appear.
"""

import pytest
import torch
import torch.nn.functional as F

from depthtools.arch import DepthModel, list_archs
from depthtools.arch.backbone import softcap
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

from tiny_models import one_thread  # noqa: F401  (fixture)

VOCAB, L, B, T = 61, 4, 2, 9
TOL = dict(atol=1e-4, rtol=1e-4)

FUNCTIONS = ("accumulated_resid", "logit_lens", "decompose_resid", "apply_ln_to_stack", "logit_attrs",
             "stack_head_results", "compute_head_results", "get_full_resid_decomposition", "get_neuron_results",
             "stack_neuron_results", "stack_activation")
DECOMPOSITIONS = {"decompose_resid", "stack_head_results", "stack_neuron_results", "get_full_resid_decomposition"}
NOT_ONE_STREAM = {"accumulated_resid", "logit_lens", "stack_activation"} | DECOMPOSITIONS
OUTPUT_NORM = {"stack_head_results", "compute_head_results", "get_neuron_results", "stack_neuron_results",
               "get_full_resid_decomposition"}
# function -> refused (and apply_ln_to_stack at a block norm: "block_norm"), per architecture (L = 4)
REFUSED = {
    **dict.fromkeys(["preln", "lns", "layerscale", "depthmup", "completep", "moda"], set()),
    "rezero": {"block_norm"},  # no pre-norm: there is no norm scale at a block's input
    "periln": OUTPUT_NORM,  # Peri-LN's output norm: sublayer outputs are not linear in heads/neurons
    "postln": DECOMPOSITIONS | {"block_norm"},
    "deepnorm": DECOMPOSITIONS | {"block_norm"},
    "keel": DECOMPOSITIONS,
    "mixln": DECOMPOSITIONS,  # block 0 is Post-LN; the block norm checked below (block 3) is Pre-LN
    **dict.fromkeys(["hc", "mhc", "attnres", "blockattnres", "denseformer"], NOT_ONE_STREAM),
}
REFUSED["denseformer"] = NOT_ONE_STREAM - {"stack_activation"}  # its hook_resid_pre is what each block reads
NORM_INPUT = {"hc": "attn_hc.hook_branch_in", "mhc": "attn_hc.hook_branch_in", "attnres": "hook_attn_in",
              "blockattnres": "hook_attn_in"}  # the tensor a block's attention pre-norm reads (default resid_pre)
MLP_INPUT = {"hc": "mlp_hc.hook_branch_in", "mhc": "mlp_hc.hook_branch_in", "attnres": "hook_mlp_in",
             "blockattnres": "hook_mlp_in"}
ARCHS = [spec.name for spec in list_archs()]
# Imported pretrained families (test_families.py's cases, their config mapped by the importer, random weights):
# "family:<case>" -> refused functions; refusals name the family.
FAMILY_REFUSED = {
    **dict.fromkeys(["llama-bias-gqa", "mistral-window", "qwen2-bias-window", "qwen3-qknorm", "gemma-geglu-mqa",
                     "olmo-clip", "gpt2", "neox-parallel-partial", "phi3-fused-window-partial",
                     "phi-parallel-partial-biased-head"], set()),
    "gemma2-softcap-window": OUTPUT_NORM | {"logit_lens", "logit_attrs"},  # sandwich norms; soft-capped logits
    "gemma3-local-rope": OUTPUT_NORM,
    "olmo2-postnorm": OUTPUT_NORM | {"block_norm"},  # OLMo-2 norms sublayer outputs and has no pre-norm
    # mixture-of-experts MLPs: hook_mlp_out is not one linear map of one hook_post (no per-neuron results)
    **dict.fromkeys(["mixtral-top2-window", "qwen2-moe-shared-dense", "qwen3-moe-normtopk-sparse-step", "olmoe-clip"],
                    {"get_neuron_results", "stack_neuron_results", "get_full_resid_decomposition"}),
}
REFUSED.update({f"family:{case}": refused for case, refused in FAMILY_REFUSED.items()})
CASE_IDS = ARCHS + [f"family:{case}" for case in FAMILY_REFUSED]


def test_every_registered_architecture_and_family_has_expectations():
    from test_families import CASES, FAMILY_OF_CASE

    assert sorted(ARCHS) == sorted(k for k in REFUSED if not k.startswith("family:"))
    assert {FAMILY_OF_CASE[case] for case in FAMILY_REFUSED} == set(FAMILY_OF_CASE.values())
    assert set(FAMILY_REFUSED) <= set(CASES)


def name_of(case_id: str) -> str:
    """What a refusal must name: the architecture, or the imported family."""
    if not case_id.startswith("family:"):
        return case_id
    from test_families import FAMILY_OF_CASE

    return FAMILY_OF_CASE[case_id.split(":", 1)[1]]


def build(arch: str) -> DepthModel:
    if arch.startswith("family:"):  # the importer's config of a family case, L blocks, random weights
        from test_families import hf_config

        from depthtools.interop.families import hf_to_model_config

        hf = hf_config(arch.split(":", 1)[1]).to_dict()
        hf.update({"n_layer": L} if hf["model_type"] == "gpt2" else {"num_hidden_layers": L})
        hf.pop("layer_types", None)  # the family's default pattern for L layers
        cfg = hf_to_model_config(hf, max_seq_len=16).replace(vocab_size=VOCAB)
    else:
        cfg = ModelConfig(arch=arch, vocab_size=VOCAB, d_model=32, n_layer=L, n_heads=4, max_seq_len=16)
    model = DepthModel(cfg, seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
            if name.endswith(("norm.weight", "_gain")) or name == "ln_final.weight":
                p.copy_(torch.empty(p.shape).uniform_(0.3, 1.7, generator=gen))  # far from the unit gain
    return model


@pytest.fixture(scope="module", params=CASE_IDS)
def case(request):
    model = build(request.param)
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        states = model.run_states(tokens)
        torch.testing.assert_close(logits, model(tokens), **TOL)  # hooked (explicit attention): same function
        # what W_U maps the normed stream to: the logits before any final soft-cap (Gemma-2's)
        linear = model.unembed(model.ln_final(model.readout(states[-1])))
        torch.testing.assert_close(softcap(linear, model.backbone.final_softcap), logits, **TOL)
    return request.param, model, tokens, linear, cache, states


def unembed(model, x):
    return x @ model.W_U + model.b_U


def stream(model, cache, states, layer):
    """The stream that TransformerLens' functions decompose at `layer` (the final readout at L)."""
    return model.readout(states[layer])


@pytest.mark.parametrize("function", FUNCTIONS)
def test_cache_function_is_exact_or_refuses(case, function):
    arch, model, tokens, logits, cache, states = case
    if function in REFUSED[arch]:
        with pytest.raises(DepthToolsError, match=rf"\b{name_of(arch)}\b") as error:
            CHECKS[function](arch, model, tokens, logits, cache, states)
        assert "would not be exact" in str(error.value) or "is not in the cache" in str(error.value)
        return
    with torch.no_grad():
        CHECKS[function](arch, model, tokens, logits, cache, states)


def check_accumulated_resid(arch, model, tokens, logits, cache, states):
    raw, labels = cache.accumulated_resid(incl_mid=True, return_labels=True)
    pre = [labels.index(f"{l}_pre") for l in range(L)] + [labels.index("final_post")]
    for depth, index in enumerate(pre):
        torch.testing.assert_close(raw[index], stream(model, cache, states, depth), **TOL)
    normed = cache.accumulated_resid(apply_ln=True)
    torch.testing.assert_close(unembed(model, normed[-1]), logits, **TOL)


def check_logit_lens(arch, model, tokens, logits, cache, states):
    result = cache.logit_lens(positions=None)
    assert result.labels[-1] == "final_post"
    for depth in range(L + 1):  # every entry: the model's own head at that depth
        torch.testing.assert_close(result.values[depth].float(), model.head(states[depth]), **TOL)


def check_decompose_resid(arch, model, tokens, logits, cache, states):
    for layer in range(L + 1):
        parts = cache.decompose_resid(layer=layer)
        torch.testing.assert_close(parts.sum(0), stream(model, cache, states, layer), **TOL)
    for layer in range(L):
        mid = cache.decompose_resid(layer=layer, mlp_input=True).sum(0)
        torch.testing.assert_close(mid, cache[f"blocks.{layer}.hook_resid_mid"], **TOL)
    normed = cache.decompose_resid(apply_ln=True)  # the old cache dropped the final norm's gain here
    torch.testing.assert_close(unembed(model, normed.sum(0)), logits, **TOL)


def norm_input_stack(arch, model, cache, layer, mlp):
    """What the pre-norm of `layer`'s attention (or MLP) reads: decomposed where that is exact."""
    if "decompose_resid" not in REFUSED[arch]:
        return cache.decompose_resid(layer=layer, mlp_input=mlp and not parallel(model))
    hooks = MLP_INPUT if mlp else NORM_INPUT
    mid = mlp and not parallel(model)
    return cache[f"blocks.{layer}.{hooks.get(arch, 'hook_resid_mid' if mid else 'hook_resid_pre')}"][None]


def norm_bias(norm) -> torch.Tensor | float:
    """A LayerNorm's bias (GPT-2, NeoX; 0 without)."""
    bias = getattr(norm, "bias", None)
    return 0.0 if bias is None else bias


def parallel(model) -> bool:
    """A parallel block's MLP reads the block input (hook_resid_pre), not resid_mid (GPT-NeoX)."""
    return model.backbone.parallel


def out_bias(module) -> torch.Tensor | float:
    """An output projection's bias (0 without, or without the projection: a mixture of experts): not a head's or
    neuron's (TransformerLens' convention)."""
    return 0.0 if getattr(module, "bias", None) is None else module.bias


def final_norm_without_bias(model, x):
    """The final norm as a linear map of x given its statistics: centred (LayerNorm), / scale, · gain."""
    from depthtools.arch.backbone import norm_centers, norm_gain

    centred = x - x.mean(-1, keepdim=True) if norm_centers(model.ln_final) else x
    gain = norm_gain(model.ln_final)
    return centred, (centred.pow(2).mean(-1, keepdim=True) + model.ln_final.eps).sqrt(), 1.0 if gain is None else gain


def check_apply_ln_to_stack(arch, model, tokens, logits, cache, states):
    final = stream(model, cache, states, L)[None]
    torch.testing.assert_close(unembed(model, cache.apply_ln_to_stack(final).sum(0)), logits, **TOL)
    torch.testing.assert_close(unembed(model, cache.apply_ln_to_stack(final, recompute_ln=True)[0]), logits, **TOL)
    if "block_norm" in REFUSED[arch]:
        with pytest.raises(DepthToolsError, match=rf"\b{name_of(arch)}\b.*pre-norm"):
            cache.apply_ln_to_stack(norm_input_stack(arch, model, cache, L - 1, False), L - 1)
        return
    layer, block = L - 1, model.blocks[L - 1]
    # a block norm's bias is no component's (TransformerLens folds it into the next biases): added here
    x = cache.apply_ln_to_stack(norm_input_stack(arch, model, cache, layer, False), layer).sum(0)
    x = x + norm_bias(block.attn_norm)
    q = cache[f"blocks.{layer}.attn.hook_q"].flatten(-2)  # the attention's input, through w_q (+ clip, QK-norm)
    attn = block.attn
    torch.testing.assert_close(attn._project(attn.w_q, "q_norm", x, attn.n_heads).flatten(-2), q, **TOL)
    y = cache.apply_ln_to_stack(norm_input_stack(arch, model, cache, layer, True), layer, mlp_input=True).sum(0)
    y = y + norm_bias(block.mlp_norm)
    mlp = block.mlp
    if hasattr(mlp, "router"):  # a mixture of experts: its input, through the router
        torch.testing.assert_close(mlp.router(y), cache[f"blocks.{layer}.mlp.hook_router"], **TOL)
        return
    post = mlp.act(mlp.w1(y)) * (mlp.w3(y) if mlp.gated else 1.0)  # the MLP's input, through w1 (and w3)
    torch.testing.assert_close(post, cache[f"blocks.{layer}.mlp.hook_post"], **TOL)


def check_logit_attrs(arch, model, tokens, logits, cache, states):
    stack = (stream(model, cache, states, L)[None] if "decompose_resid" in REFUSED[arch]
             else cache.decompose_resid())
    targets = torch.roll(tokens, -1, dims=1)
    attrs = cache.logit_attrs(stack, targets)  # [components, B, T]: the unembedding bias b_U is no component's
    torch.testing.assert_close(attrs.sum(0), (logits - model.b_U).gather(-1, targets[..., None])[..., 0], **TOL)
    other = torch.roll(tokens, 1, dims=1)
    diff = cache.logit_attrs(stack, targets, incorrect_tokens=other).sum(0)
    linear = logits - model.b_U
    expected = (linear.gather(-1, targets[..., None]) - linear.gather(-1, other[..., None]))[..., 0]
    torch.testing.assert_close(diff, expected, **TOL)


def check_stack_head_results(arch, model, tokens, logits, cache, states):
    heads, labels = cache.stack_head_results(return_labels=True, incl_remainder=True)
    H = model.config.n_heads
    for layer in range(L):
        torch.testing.assert_close(heads[layer * H:(layer + 1) * H].sum(0) + out_bias(model.blocks[layer].attn.w_o),
                                   cache[f"blocks.{layer}.hook_attn_out"], **TOL)
    torch.testing.assert_close(heads.sum(0), stream(model, cache, states, L), **TOL)
    normed = cache.stack_head_results(incl_remainder=True, apply_ln=True)
    torch.testing.assert_close(unembed(model, normed.sum(0)), logits, **TOL)


def check_compute_head_results(arch, model, tokens, logits, cache, states):
    cache.compute_head_results()
    for layer in range(L):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_result"].sum(-2)
                                   + out_bias(model.blocks[layer].attn.w_o), cache[f"blocks.{layer}.hook_attn_out"], **TOL)


def check_get_full_resid_decomposition(arch, model, tokens, logits, cache, states):
    parts = cache.get_full_resid_decomposition()  # heads, neurons, embed, bias
    torch.testing.assert_close(parts.sum(0), stream(model, cache, states, L), **TOL)
    normed = cache.get_full_resid_decomposition(apply_ln=True, expand_neurons=False)
    torch.testing.assert_close(unembed(model, normed.sum(0)), logits, **TOL)
    direction = model.W_U[:, 5]
    projected = cache.get_full_resid_decomposition(apply_ln=True, project_output_onto=direction)
    torch.testing.assert_close(projected.sum(0), (logits - model.b_U)[..., 5], **TOL)


def check_get_neuron_results(arch, model, tokens, logits, cache, states):
    direction = torch.randn(model.config.d_model, generator=torch.Generator().manual_seed(3))
    for layer in range(L):
        out = cache[f"blocks.{layer}.hook_mlp_out"] - out_bias(getattr(model.blocks[layer].mlp, "w2", None))
        torch.testing.assert_close(cache.get_neuron_results(layer).sum(-2), out, **TOL)
        projected = cache.get_neuron_results(layer, project_output_onto=direction)
        torch.testing.assert_close(projected.sum(-1), out @ direction, **TOL)


def check_stack_neuron_results(arch, model, tokens, logits, cache, states):
    mlp = cache.stack_activation("mlp_out").sum(0) - sum(out_bias(getattr(block.mlp, "w2", None)) for block in model.blocks)
    torch.testing.assert_close(cache.stack_neuron_results(L).sum(0), mlp, **TOL)
    torch.testing.assert_close(cache.stack_neuron_results(L, incl_remainder=True).sum(0),
                               stream(model, cache, states, L), **TOL)
    normed = cache.stack_neuron_results(L, apply_ln=True, project_output_onto=model.W_U).sum(0)
    torch.testing.assert_close(normed, cache.apply_ln_to_stack(mlp[None])[0] @ model.W_U, **TOL)
    final = stream(model, cache, states, L)
    _, scale, gain = final_norm_without_bias(model, final)  # the final norm's scale and gain
    centred, _, _ = final_norm_without_bias(model, mlp)
    torch.testing.assert_close(normed, (centred / scale * gain) @ model.W_U, **TOL)
    projected = cache.stack_neuron_results(L, incl_remainder=True, apply_ln=True, project_output_onto=model.W_U)
    torch.testing.assert_close(projected.sum(0), logits - model.b_U, **TOL)  # b_U: a final LayerNorm's bias
    one = cache.stack_neuron_results(L, incl_remainder=True, apply_ln=True, project_output_onto=model.W_U[:, 7])
    torch.testing.assert_close(one.sum(0), (logits - model.b_U)[..., 7], **TOL)


def check_stack_activation(arch, model, tokens, logits, cache, states):
    resid = cache.stack_activation("resid_pre")
    for layer in range(L):
        torch.testing.assert_close(resid[layer], stream(model, cache, states, layer), **TOL)
    outs = cache.stack_activation("attn_out")
    assert outs.shape == (L, B, T, model.config.d_model)


CHECKS = {name: globals()[f"check_{name}"] for name in FUNCTIONS}


@pytest.mark.parametrize("arch", ["hc", "attnres"])
def test_missing_resid_hooks_raise_the_reason_not_a_bare_key_error(arch):
    model = build(arch)
    _, cache = model.run_with_cache(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(KeyError, match=rf"\b{arch}\b.*(residual streams|no residual stream)"):
        cache["blocks.0.hook_resid_pre"]
    with pytest.raises(KeyError):
        cache["blocks.0.hook_nonexistent"]


def test_model_outputs_and_weights_are_unchanged():
    model = build("preln")
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    state = model.run_states(tokens)[-1]
    expected = F.rms_norm(state, (32,), model.ln_final.weight, model.config.norm_eps) @ model.unembed.weight.T
    assert torch.equal(model.head(state), expected)
    assert torch.equal(model.W_U, model.unembed.weight.T)  # W_U is the real unembedding, not gain-folded
    cache = model.run_with_cache(tokens)[1]
    sliced = cache.apply_slice_to_batch_dim(0)
    with pytest.raises(DepthToolsError, match="tokenizer"):
        sliced.logit_attrs(sliced.decompose_resid(), "hello")
