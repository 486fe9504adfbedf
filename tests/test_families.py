"""Pretrained families imported exactly: for every family, a tiny random model built with transformers' own
config class (eager attention), saved with save_pretrained in float32, imported by depthtools and compared
with transformers: logits, every block's residual stream (output_hidden_states), argmax. Each special
feature is active in some case (bias, QK-norm, binding soft-caps and sliding windows, partial rotary,
parallel residual), and each case checks that switching the feature off in our model changes the logits,
so the comparison exercises it. Also sharded and bfloat16 folders, the family maps' defaults against the
config classes, and bad input (one line, exit 2, nothing written). No hub: everything is built here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.errors import DepthToolsError
from depthtools.interop import from_hf, import_hf
from depthtools.interop.families import FAMILIES, hf_to_model_config

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")

VOCAB, T = 61, 12
runner = CliRunner()
# Largest |ours - transformers| over logits and hidden states accepted per family (float32, T = 12); measured
# gaps are ~1e-6 (docs/pretrained.md), the bound leaves room for RoPE rounding (float64 vs float32 tables).
TOL = 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=32, attn_implementation="eager",
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# case id -> (transformers class names, config kwargs, our options that must matter: option -> value "off")
CASES: dict[str, tuple[str, str, dict, dict]] = {
    "llama-bias-gqa": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, rope_theta=5e5), {}),
    "llama-tied-headdim": ("LlamaConfig", "LlamaForCausalLM",
                           dict(head_dim=16, tie_word_embeddings=True, hidden_act="gelu"), {}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=4),
                       {"sliding_window": 0}),
    "qwen2-bias-window": ("Qwen2Config", "Qwen2ForCausalLM",
                          dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=3, max_window_layers=1),
                          {"sliding_window": 0}),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16),
                     {"qk_norm": "none"}),
    "gemma-geglu-mqa": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16),
                        {"embed_scale": 1.0}),
    "gemma2-softcap-window": ("Gemma2Config", "Gemma2ForCausalLM",
                              dict(num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=0.5, final_logit_softcapping=2.0),
                              {"attn_softcap": 0.0, "final_softcap": 0.0, "sliding_window": 0}),
    "gemma3-local-rope": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                          dict(num_key_value_heads=2, head_dim=16, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
                          {"rope_theta_sliding": 0.0, "sliding_window": 0}),
    "olmo-clip": ("OlmoConfig", "OlmoForCausalLM", dict(clip_qkv=0.3), {"qkv_clip": 0.0}),
    "olmo2-postnorm": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2), {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(), {}),
    "neox-parallel-partial": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(), {"parallel": False,
                                                                            "rotary_fraction": 1.0}),
    "neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                        dict(use_parallel_residual=False, rope_parameters={"rope_theta": 500.0, "rope_type": "default",
                                                                           "partial_rotary_factor": 0.5}),
                        {"parallel": True}),
    "phi3-fused-window-partial": ("Phi3Config", "Phi3ForCausalLM",
                                  dict(num_key_value_heads=2, sliding_window=5,
                                       rope_parameters={"rope_theta": 1e4, "rope_type": "default",
                                                        "partial_rotary_factor": 0.5}),
                                  {"sliding_window": 0, "rotary_fraction": 1.0}),
    "phi-parallel-partial-biased-head": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=2),
                                         {"head_bias": False, "parallel": False, "rotary_fraction": 1.0}),
    "phi-qk-layernorm-tied": ("PhiConfig", "PhiForCausalLM",
                              dict(qk_layernorm=True, tie_word_embeddings=True,
                                   rope_parameters={"rope_theta": 500.0, "rope_type": "default",
                                                    "partial_rotary_factor": 0.25}),
                              {"qk_norm": "none"}),
    "mixtral-top2-window": ("MixtralConfig", "MixtralForCausalLM",
                            dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=5),
                            {"moe_top_k": 1, "sliding_window": 0}),
    "qwen2-moe-shared-dense": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                               dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                    mlp_only_layers=[1]),
                               {"moe_norm_topk": True, "moe_shared_gate": False}),
    "qwen3-moe-normtopk-sparse-step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                                       dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=2),
                                       {"moe_norm_topk": False, "qk_norm": "none"}),
    "olmoe-clip": ("OlmoeConfig", "OlmoeForCausalLM",
                   dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=3, clip_qkv=0.4),
                   {"moe_top_k": 1, "qkv_clip": 0.0}),
}
FAMILY_OF_CASE = {"llama-bias-gqa": "llama", "llama-tied-headdim": "llama", "mistral-window": "mistral",
                  "qwen2-bias-window": "qwen2", "qwen3-qknorm": "qwen3", "gemma-geglu-mqa": "gemma",
                  "gemma2-softcap-window": "gemma2", "gemma3-local-rope": "gemma3_text", "olmo-clip": "olmo",
                  "olmo2-postnorm": "olmo2", "gpt2": "gpt2", "neox-parallel-partial": "gpt_neox",
                  "neox-sequential": "gpt_neox", "phi3-fused-window-partial": "phi3",
                  "phi-parallel-partial-biased-head": "phi", "phi-qk-layernorm-tied": "phi",
                  "mixtral-top2-window": "mixtral", "qwen2-moe-shared-dense": "qwen2_moe",
                  "qwen3-moe-normtopk-sparse-step": "qwen3_moe", "olmoe-clip": "olmoe"}


def hf_config(case: str):
    config_cls, _, kwargs, _ = CASES[case]
    cls = getattr(transformers, config_cls)
    merged = {**COMMON, **kwargs}
    if config_cls == "GPT2Config":  # GPT-2's own key names
        merged = dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=32, n_inner=48,
                      attn_implementation="eager", bos_token_id=1, eos_token_id=2, **kwargs)
    return cls(**merged)


def build_hf(case: str, directory: Path, seed: int = 0, **save) -> torch.nn.Module:
    """A random tiny transformers model of `case`, every weight moved off its init (norm gains too), saved."""
    torch.manual_seed(seed)
    model = getattr(transformers, CASES[case][1])(hf_config(case)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))  # gains far from their init
            else:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True, **save)
    return model


def tokens(n: int = 2, t: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def hf_outputs(model, x):
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
    return out.logits, out.hidden_states


def with_options(model: DepthModel, **changes) -> DepthModel:
    """Our model with some options changed and the same weights (to show a feature matters)."""
    if changes.get("sliding_window") == 0:
        changes["layer_types"] = ""  # no window: no sliding layers
    cfg = model.config.replace(options={**model.config.options, **changes})
    other = DepthModel(cfg).eval()
    other.load_state_dict(model.state_dict(), strict=False)
    return other


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """case -> (folder, transformers model), built once."""
    root = tmp_path_factory.mktemp("families")
    return {case: (root / case, build_hf(case, root / case)) for case in CASES}


def test_every_family_has_a_case():
    from depthtools.arch.backbone import FAMILIES as FAMILY_OPTION_VALUES

    assert set(FAMILY_OF_CASE.values()) == set(FAMILIES) and set(FAMILY_OF_CASE) == set(CASES)
    assert FAMILY_OPTION_VALUES == ("", *FAMILIES)  # the `family` option accepts exactly the imported families


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(built, case):
    folder, hf = built[case]
    ours = from_hf(folder)
    assert ours.config.arch == "preln" and ours.config.options["family"] == FAMILY_OF_CASE[case]
    x = tokens()
    theirs, hidden = hf_outputs(hf, x)
    with torch.no_grad():
        mine = ours(x)
        states = ours.run_states(x)
    assert theirs.abs().max() > 0.3  # a real signal
    gap = (mine - theirs).abs().max().item()
    assert gap <= TOL, gap
    assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
    L = ours.config.n_layer
    assert len(hidden) == L + 1
    for layer in range(L):  # transformers' hidden_states[l] = the stream entering block l
        assert (states[layer] - hidden[layer]).abs().max().item() <= TOL, layer
    with torch.no_grad():  # its last entry is the final norm's output
        assert (ours.ln_final(states[L]) - hidden[L]).abs().max().item() <= TOL
    for option, off in CASES[case][3].items():  # each special feature is active: switching it off matters
        with torch.no_grad():
            changed = (with_options(ours, **{option: off})(x) - theirs).abs().max().item()
        assert changed > 1e-3, (option, changed)


def test_features_land_in_the_options(built):
    opts = {case: from_hf(built[case][0]).config.options for case in CASES}
    assert opts["llama-bias-gqa"]["qkv_bias"] and opts["llama-bias-gqa"]["mlp_bias"]
    assert opts["qwen2-bias-window"]["qkv_bias"] and not opts["qwen2-bias-window"].get("attn_out_bias")
    assert opts["qwen2-bias-window"]["layer_types"] == "fss" and opts["qwen2-bias-window"]["sliding_window"] == 3
    assert opts["qwen3-qknorm"]["qk_norm"] == "head" and opts["qwen3-qknorm"]["head_dim"] == 16
    assert opts["olmo2-postnorm"]["qk_norm"] == "full" and opts["olmo2-postnorm"]["pre_norm"] is False
    assert opts["gemma2-softcap-window"]["layer_types"] == "sfs"
    assert opts["gemma3-local-rope"]["rope_theta_sliding"] == 100.0
    assert opts["neox-parallel-partial"]["parallel"] and opts["neox-parallel-partial"]["rotary_fraction"] == 0.25
    assert opts["gpt2"]["positions"] == "learned" and opts["gpt2"]["mlp_act"] == "gelu_tanh"
    assert opts["olmo-clip"]["norm_gain"] == "none" and opts["olmo-clip"]["qkv_clip"] == 0.3
    phi = opts["phi-parallel-partial-biased-head"]
    assert phi["parallel"] and phi["head_bias"] and phi["rotary_fraction"] == 0.5 and phi["norm"] == "layer"
    assert opts["phi-qk-layernorm-tied"]["qk_norm"] == "head"
    assert opts["qwen2-moe-shared-dense"]["moe_layers"] == "mdm" and opts["qwen2-moe-shared-dense"]["moe_shared_ff"] == 40
    assert opts["qwen2-moe-shared-dense"]["moe_norm_topk"] is False and opts["qwen2-moe-shared-dense"]["moe_ff"] == 24
    assert opts["qwen3-moe-normtopk-sparse-step"]["moe_layers"] == "dmd"
    assert opts["mixtral-top2-window"]["moe_experts"] == 4 and opts["mixtral-top2-window"]["moe_norm_topk"] is True
    assert opts["olmoe-clip"]["moe_top_k"] == 3 and opts["olmoe-clip"]["qk_norm"] == "full"


@pytest.mark.parametrize("case", ["gemma2-softcap-window", "gpt2", "neox-parallel-partial", "qwen3-qknorm",
                                  "qwen2-moe-shared-dense", "phi-qk-layernorm-tied"])
def test_checkpoint_round_trip_is_bit_identical(built, case, tmp_path):
    folder, _ = built[case]
    summary = import_hf(folder, out=tmp_path / "ck")
    again, ours = ck.load(summary["checkpoint"]), from_hf(folder)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(again(x), ours(x))
    assert ck.read_config(tmp_path / "ck")["source"]["format"] == f"huggingface-{FAMILY_OF_CASE[case]}"


def test_sharded_folder(tmp_path):
    hf = build_hf("qwen3-qknorm", tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    x = tokens()
    with torch.no_grad():
        assert (from_hf(tmp_path / "hf")(x) - hf(x).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_folder(tmp_path, dtype):
    """Half-precision weights are read and cast to float32: the same function as transformers' model of those
    weights in float32."""
    build_hf("gemma2-softcap-window", tmp_path / "hf")
    half = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path / "hf", dtype=dtype)
    half.save_pretrained(tmp_path / "half", safe_serialization=True)
    reference = transformers.Gemma2ForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32).eval()
    ours = from_hf(tmp_path / "half")
    assert ours.tok_embed.weight.dtype == torch.float32
    x = tokens()
    with torch.no_grad():
        assert (ours(x) - reference(x).logits).abs().max().item() <= TOL


# -- the maps' defaults are transformers' ------------------------------------------------------------------------
CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
                "olmo": "OlmoConfig", "olmo2": "Olmo2Config", "gpt2": "GPT2Config", "gpt_neox": "GPTNeoXConfig",
                "phi3": "Phi3Config", "phi": "PhiConfig", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
                "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_minimal_config_reads_as_the_config_class_does(family):
    """A config.json holding only the sizes is read with the config class's defaults: the same ModelConfig
    as the full config.json transformers writes for that class."""
    sizes = ({"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4} if family == "gpt2" else
             {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2 if family != "gpt_neox" else 4})
    if family.startswith("gemma"):
        sizes["head_dim"] = 16
    full = getattr(transformers, CONFIG_CLASS[family])(**sizes).to_dict()
    minimal = {"model_type": family, **sizes}
    assert hf_to_model_config(minimal, max_seq_len=64) == hf_to_model_config(full, max_seq_len=64)


# -- refusals and bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,field", [
    ({"model_type": "bert"}, "model_type='bert'"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "rope_scaling.rope_type='proportional'"),
    ({"hidden_act": "gelu_fast"}, "hidden_act='gelu_fast'"),
    ({"model_type": "gemma2", "use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "scale_attn_by_inverse_layer_idx": True},
     "scale_attn_by_inverse_layer_idx=True"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config='gptq'"),
    ({"model_type": "mixtral", "scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"model_type": "qwen3_moe", "n_shared_experts": 2}, "n_shared_experts=2"),
    ({"model_type": "olmoe", "routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 3},
     "num_experts_per_tok=3 (exceeds num_local_experts=2)"),
    ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                       "sliding_attention": {"rope_type": "linear", "factor": 8.0}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
])
def test_inexpressible_configs_are_refused_in_one_line(tmp_path, change, field):
    base = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4)
    (tmp_path / "config.json").write_text(json.dumps({**base, **change}))
    with pytest.raises(DepthToolsError) as err:
        from_hf(tmp_path)
    assert field in str(err.value) and len(str(err.value).splitlines()) == 1


def _cli_import(folder: Path, out: Path):
    return runner.invoke(app, ["import-hf", str(folder), "--out", str(out)])


def test_bad_folders_exit_2_in_one_line_and_write_nothing(tmp_path):
    def refused(folder: Path, needle: str) -> None:
        out = tmp_path / f"out_{folder.name}"
        result = _cli_import(folder, out)
        assert result.exit_code == 2, result.output
        assert needle in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert not out.exists()

    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no config.json")
    folder = tmp_path / "unknown"
    build_hf("olmo-clip", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
    refused(folder, "model_type='falcon'")

    sharded = tmp_path / "sharded"
    build_hf("olmo-clip", sharded, max_shard_size="20KB")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    refused(sharded, shard.name)

    wrong = tmp_path / "wrong"
    build_hf("phi3-fused-window-partial", wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    refused(wrong, "gate_up_proj.weight has shape (96, 32)")

    experts = tmp_path / "experts"  # config.json says 3 experts, the weights hold 4
    build_hf("mixtral-top2-window", experts)
    config = json.loads((experts / "config.json").read_text())
    (experts / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    refused(experts, "hold 4 experts in layer 0 (model.layers.0.block_sparse_moe.experts.*.w1.weight), "
                     "config.json's num_local_experts says 3")

    nan = tmp_path / "nan"
    model = build_hf("gpt2", nan)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    model.save_pretrained(nan, safe_serialization=True)
    refused(nan, "transformer.h.1.mlp.c_fc.weight has 1 non-finite")


def test_export_stays_llama_only(built, tmp_path):
    import_hf(built["gpt2"][0], out=tmp_path / "gpt2")
    result = runner.invoke(app, ["export-hf", "--ckpt", str(tmp_path / "gpt2"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "gpt2" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# -- issue 43 item 4: a tied config whose file holds its own head ------------------------------------------------
@pytest.mark.parametrize("case", ["gpt2", "phi3-fused-window-partial", "qwen3-qknorm", "neox-sequential"])
def test_a_tied_config_with_a_different_head_in_the_file_keeps_the_head_as_transformers_does(case, tmp_path,
                                                                                              monkeypatch):
    """transformers 5.x loads the file's head (it ties only a head the file lacks); so does the import, and it
    says so in one note. A head equal to the embedding stays tied."""
    from safetensors.torch import load_file, save_file

    config_cls, model_cls, kwargs, _ = CASES[case]
    monkeypatch.setitem(CASES, case, (config_cls, model_cls, {**kwargs, "tie_word_embeddings": True}, {}))
    folder = tmp_path / "hf"
    build_hf(case, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    embed = next(k for k in tensors if k.endswith(("embed_tokens.weight", "wte.weight", "embed_in.weight")))
    head = "embed_out.weight" if case.startswith("neox") else "lm_head.weight"
    assert head not in tensors  # transformers saved the tied head once
    tensors[head] = torch.randn(tensors[embed].shape, generator=torch.Generator().manual_seed(3))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    theirs = getattr(transformers, model_cls).from_pretrained(folder).eval()
    assert torch.equal(theirs.get_output_embeddings().weight, tensors[head])  # transformers keeps the file's head
    x = tokens()
    summary = import_hf(folder, out=tmp_path / "ck")
    ours = ck.load(summary["checkpoint"])
    assert not ours.config.tie_embeddings
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() <= TOL
    assert len(summary["notes"]) == 1 and "tie_word_embeddings" in summary["notes"][0]

    tensors[head] = tensors[embed].clone()  # the same head as the embedding: tied, no note
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    summary = import_hf(folder, out=tmp_path / "same")
    assert ck.load(summary["checkpoint"]).config.tie_embeddings and summary["notes"] == []
