"""OLMo-core / DepthBench config.json + tensors -> depthtools (depthtools/interop/olmo_core.py).

* Upstream exactness: tiny Llama- and OLMo-2-style `Transformer`s built by OLMo-core's own config classes; their
  `state_dict()` and `as_config_dict()` mapped; logits against OLMo-core's own forward, max |diff| <= 1e-5.
* The fork's names: per DepthBench architecture a fixture (tests/fixtures/olmo_core_names/, written by
  make_fixtures.py from reading the fork, without depthtools) lists the tensors of a tiny config; the mapping covers
  exactly that set, and a state dict under those names from our model maps back to bit-identical logits.
* Bad input: one line naming the config key or the tensor.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from depthtools.arch import DepthModel
from depthtools.errors import DepthToolsError
from depthtools.interop.olmo_core import (
    build_from_olmo_core,
    olmo_core_mapping,
    olmo_core_shapes,
    to_olmo_core,
)

from olmo_core_reference import fork_logits
from tiny_models import one_thread  # noqa: F401  (autouse: one intra-op thread)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "olmo_core_names"
ARCHS = ("preln", "periln", "lns", "deepnorm", "keel", "hc", "mhc", "liger_mhc", "attnres", "blockattnres", "moda",
         "moda_post")


def fixture(arch: str) -> dict:
    return json.loads((FIXTURES / f"{arch}.json").read_text())


ROUTING = ("bias_pre", "bias_post", "bias_res", "gate_pre", "gate_post", "gate_res", "alpha_scale", "beta_scale")


def perturbed_model(cfg, seed: int = 0) -> DepthModel:
    """Our model with every parameter moved off its init (zero queries, identity routing hide nothing); mHC's
    biases and gates and HC's scales redrawn at scale 0.5, so no Sinkhorn saturates (a ±8 gap would hide a
    transposed routing matrix below 1e-8)."""
    model = DepthModel(cfg, seed=seed).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTING):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


# -- upstream OLMo-core: exact against its own forward ------------------------------------------------------------
def _olmo_core_logits(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("style", ["llama", "llama_gqa", "olmo2", "head_qk_norm", "head_dim"])
def test_upstream_olmo_core_transformers_import_exactly(style):
    olmo_core = pytest.importorskip("olmo_core.nn.transformer")
    TransformerConfig, BlockType = olmo_core.TransformerConfig, olmo_core.TransformerBlockType
    common = dict(d_model=32, vocab_size=64, n_layers=2, n_heads=4, hidden_size_multiple_of=16)
    if style == "llama":
        config = TransformerConfig.llama_like(**common)
    elif style == "llama_gqa":
        config = TransformerConfig.llama_like(**common, n_kv_heads=2, layer_norm_eps=1e-6, rope_theta=10_000)
    elif style == "olmo2":  # reordered norms, QK-norm over the full projections (olmo2_* presets)
        config = TransformerConfig.llama_like(**common, block_name=BlockType.reordered_norm, qk_norm=True,
                                              layer_norm_eps=1e-6)
    elif style == "head_qk_norm":  # QK-norm per head (the qwen3_* presets' use_head_qk_norm)
        config = TransformerConfig.llama_like(**common, qk_norm=True, use_head_qk_norm=True, n_kv_heads=2)
    else:  # head_dim other than d_model / n_heads
        config = TransformerConfig.llama_like(**common, head_dim=16, n_kv_heads=2)
    torch.manual_seed(0)
    reference = config.build(init_device="cpu")
    reference.init_weights(device=torch.device("cpu"))
    with torch.no_grad():  # norm gains off 1, so a swapped or dropped norm shows
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    reference.eval()
    step_config = json.loads(json.dumps({"model": config.as_config_dict(), "dataset": {"sequence_length": 64}}))
    cfg, state, provenance = build_from_olmo_core(step_config, dict(reference.state_dict()), "tiny-run/step0")
    ours = DepthModel(cfg).eval()
    ours.load_state_dict(state)
    x = tokens(64)
    with torch.no_grad():
        diff = (_olmo_core_logits(reference, x) - ours(x)).abs().max().item()
    assert diff <= 1e-5, diff
    assert cfg.arch == "preln" and provenance["format"] == "olmo-core" and provenance["block_type"] in (
        "default", "reordered_norm")
    if style == "olmo2":
        assert cfg.options["qk_norm"] == "full" and cfg.options["out_norm"] and not cfg.options["pre_norm"]
    if style == "llama_gqa":
        assert cfg.n_kv_heads == 2 and cfg.norm_eps == 1e-6 and cfg.rope_theta == 10_000
    if style == "head_qk_norm":
        assert cfg.options["qk_norm"] == "head"
    if style == "head_dim":
        assert cfg.head_dim == 16


# -- DepthBench's own architectures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_mapping_covers_exactly_the_forks_names(arch):
    data = fixture(arch)
    shapes = olmo_core_shapes(olmo_core_mapping(data["config"]))
    assert {k: list(v) for k, v in shapes.items()} == data["tensors"]


EXPECTED = {  # fixture -> (our arch, the options DepthBench's code implies)
    "preln": ("preln", {}), "periln": ("periln", {}), "lns": ("lns", {}), "keel": ("keel", {}),
    "deepnorm": ("deepnorm", {"norm": "layernorm"}),
    "hc": ("hc", {"readout": "normed_sum", "connector_norm_eps": 1e-8, "n_streams": 4}),
    "mhc": ("mhc", {"readout": "normed_sum", "connector_norm_eps": 1e-8, "mhc_init": "hc_like",
                    "sinkhorn_order": "rows_last"}),
    "liger_mhc": ("mhc", {"readout": "mean", "connector_norm_eps": 1e-6, "mhc_init": "uniform",
                          "sinkhorn_order": "cols_last"}),
    "attnres": ("attnres", {"mix_eps": 1e-5}),  # the fork's res norms at 1e-5, its block norms at 1e-6
    "blockattnres": ("blockattnres", {"attnres_block_size": 2, "mix_eps": 1e-5}),
    "moda": ("moda", {"moda_norm": "pre", "moda_depth_rope": "query"}),
    "moda_post": ("moda", {"moda_norm": "post", "moda_depth_rope": "query"}),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_under_the_forks_names_is_bit_identical(arch):
    data = fixture(arch)
    mapping = olmo_core_mapping(data["config"])
    want_arch, want_options = EXPECTED[arch]
    assert mapping.cfg.arch == want_arch and mapping.cfg.max_seq_len == 64
    assert {k: mapping.cfg.options[k] for k in want_options} == want_options
    model = perturbed_model(mapping.cfg)
    forks = to_olmo_core(model.state_dict(), mapping)
    assert {k: list(v.shape) for k, v in forks.items()} == data["tensors"]
    cfg, state, provenance = build_from_olmo_core(data["config"], forks, "run/step10")
    assert cfg == mapping.cfg and provenance["arch"] == want_arch and provenance["source"] == "run/step10"
    back = DepthModel(cfg).eval()
    back.load_state_dict(state)
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(x), back(x))


def test_liger_phi_parts_and_mhc_residual_orientation():
    """Liger's fused phi/b split into pre | post | res; PyTorch mHC's residual logits are H_res transposed."""
    mapping = olmo_core_mapping(fixture("liger_mhc")["config"])
    model = perturbed_model(mapping.cfg)
    forks = to_olmo_core(model.state_dict(), mapping)
    conn, n = model.blocks[1].attn_hc, 4
    phi = forks["blocks.1.attention_hyper_connection.phi"]
    assert torch.equal(phi[:, :n], conn.phi_pre) and torch.equal(phi[:, 2 * n:], conn.phi_res)
    assert torch.equal(forks["blocks.1.attention_hyper_connection.b"][2 * n:].view(n, n), conn.bias_res)
    mapping = olmo_core_mapping(fixture("mhc")["config"])
    model = perturbed_model(mapping.cfg)
    forks = to_olmo_core(model.state_dict(), mapping)
    conn = model.blocks[0].mlp_hc
    assert torch.equal(forks["blocks.0.feed_forward_hyper_connection.residual_bias"], conn.bias_res.t())
    proj = forks["blocks.0.feed_forward_hyper_connection.residual_dynamic_proj"].view(-1, n, n)
    assert torch.equal(proj[:, 1, 2], conn.phi_res.view(-1, n, n)[:, 2, 1])  # fork [s, t] = ours [t, s]


# -- bad input: one line naming the thing ----------------------------------------------------------------------------
def _set(config: dict, path: str, value) -> dict:
    config = copy.deepcopy(config)
    *parents, last = path.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[last] = value
    return config


@pytest.mark.parametrize("arch, path, value, named", [
    ("preln", "model.block.name", "mystery_block", "model.block.name='mystery_block'"),
    ("preln", "model.block.shiny_new_option", 3, "model.block.shiny_new_option=3"),
    ("preln", "model.block.sequence_mixer.rope.scaling", {"factor": 8}, "model.block.sequence_mixer.rope.scaling"),
    ("preln", "model.block.sequence_mixer.name", "fused", "model.block.sequence_mixer.name='fused'"),
    ("preln", "model.lm_head.layer_norm.eps", 1e-5, "model.lm_head.layer_norm.eps=1e-05"),
    ("deepnorm", "model.lm_head.layer_norm.name", "default", "model.lm_head.layer_norm={"),
    ("preln", "model.block.feed_forward.activation", "gelu", "model.block.feed_forward.activation='gelu'"),
    ("mhc", "model.block.hyper_connections.kind", "mhc_static", "model.block.hyper_connections.kind='mhc_static'"),
    ("mhc", "model.block.hyper_connections.sinkhorn_tau", 0.5, "model.block.hyper_connections.sinkhorn_tau=0.5"),
    ("hc", "model.block.hyper_connections.tanh", False, "model.block.hyper_connections.tanh=False"),
    ("liger_mhc", "model.block.hyper_connections.liger_pre_eps", 1e-3, "liger_pre_eps=0.001"),
    ("attnres", "model.block.attnres_block_size", 0, "model.block.attnres_block_size=0"),
    ("keel", "model.block.sequence_mixer.bias", True, "model.block.sequence_mixer.bias=True"),
    ("moda", "model.block.moda.extra_attn_kv_proj", True, "model.block.moda.extra_attn_kv_proj=True"),
    ("moda", "model.block_overrides", None, "model.block_overrides=None"),
    ("preln", "model.block_overrides", {"1": {}}, "model.block_overrides="),
    ("preln", "model.d_model", None, "model.d_model=None (required)"),
    ("preln", "model.block.feed_forward.hidden_size", 47.5, "model.block.feed_forward.hidden_size=47.5"),
])
def test_unsupported_config_is_one_line_naming_the_key(arch, path, value, named):
    config = _set(fixture(arch)["config"], path, value)
    with pytest.raises(DepthToolsError) as err:
        olmo_core_mapping(config)
    message = str(err.value)
    assert "\n" not in message and named in message, message


def _forks(arch: str) -> tuple[dict, dict]:
    data = fixture(arch)
    mapping = olmo_core_mapping(data["config"])
    return data["config"], to_olmo_core(perturbed_model(mapping.cfg).state_dict(), mapping)


def _refused(config: dict, forks: dict) -> str:
    with pytest.raises(DepthToolsError) as err:
        build_from_olmo_core(config, forks, "run/step1")
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_tensors_are_one_line_naming_the_tensor():
    config, forks = _forks("keel")
    bad = dict(forks, **{"blocks.1.feed_forward.w1.weight": torch.zeros(47, 16)})
    assert "blocks.1.feed_forward.w1.weight has shape (47, 16), the config implies (48, 16)" in _refused(config, bad)
    nan = forks["blocks.2.post_attention_norm.weight"].clone()
    nan[3] = float("nan")
    assert "blocks.2.post_attention_norm.weight has 1 non-finite" in _refused(
        config, dict(forks, **{"blocks.2.post_attention_norm.weight": nan}))
    missing = {k: v for k, v in forks.items() if k != "lm_head.norm.weight"}
    assert "missing ['lm_head.norm.weight']" in _refused(config, missing)
    extra = dict(forks, **{"blocks.0.post_attention_norm.weight": torch.ones(16)})  # KEEL block 0 has none
    assert "unexpected ['blocks.0.post_attention_norm.weight']" in _refused(config, extra)
    ints = dict(forks, **{"embeddings.weight": torch.zeros(32, 16, dtype=torch.int64)})
    assert "embeddings.weight has dtype int64" in _refused(config, ints)


def test_hc_branch_aliases_must_agree_and_may_be_absent():
    config, forks = _forks("hc")
    alias = "blocks.1.attention_hyper_connection.branch.attention.w_q.weight"
    changed = dict(forks, **{alias: forks[alias] + 1})
    assert "branch.attention.w_q.weight and blocks.1.attention.w_q.weight hold the same parameter but differ" in \
        _refused(config, changed)
    without = {k: v for k, v in forks.items() if ".branch." not in k}
    _, state, _ = build_from_olmo_core(config, without, "run/step1")
    _, full, _ = build_from_olmo_core(config, forks, "run/step1")
    assert all(torch.equal(state[k], full[k]) for k in full)


def test_config_without_a_model_section_is_refused():
    with pytest.raises(DepthToolsError, match="`model` section"):
        olmo_core_mapping({"trainer": {}})


# -- the imported model computes the fork's function ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_imported_model_computes_the_forks_forward(arch):
    """Against the fork's forward written out from its code (tests/olmo_core_reference.py), float64: the names,
    transposes, Liger's parts, readouts, eps and depth RoPE all have to be right for these to agree."""
    config = copy.deepcopy(fixture(arch)["config"])
    if arch == "liger_mhc":  # exact without Liger's Sinkhorn eps (depthtools' Sinkhorn has none; see the next test)
        config["model"]["block"]["hyper_connections"]["liger_sinkhorn_eps"] = 0.0
    mapping = olmo_core_mapping(config)
    forks = to_olmo_core(perturbed_model(mapping.cfg).double().state_dict(), mapping)
    cfg, state, _ = build_from_olmo_core(config, forks, "run/step1")
    ours = DepthModel(cfg).double().eval()
    ours.load_state_dict(state)
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        diff = (ours(x) - fork_logits(config, forks, x)).abs().max().item()
    assert diff < 1e-8, diff


def test_liger_sinkhorn_eps_is_the_one_recorded_difference():
    config = fixture("liger_mhc")["config"]
    mapping = olmo_core_mapping(config)
    assert any("liger_sinkhorn_eps=1e-06" in note for note in mapping.notes)
    forks = to_olmo_core(perturbed_model(mapping.cfg).double().state_dict(), mapping)
    cfg, state, provenance = build_from_olmo_core(config, forks, "run/step1")
    assert provenance["notes"] == list(mapping.notes)
    ours = DepthModel(cfg).double().eval()
    ours.load_state_dict(state)
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        diff = (ours(x) - fork_logits(config, forks, x)).abs().max().item()
    assert 0 < diff < 1e-4, diff


def test_older_fork_configs_read_as_the_fork_reads_them():
    """`attention` instead of `sequence_mixer`; HC/mHC as a `default` block with `hyper_connections` (the fork's
    TransformerBlockConfig.__post_init__ maps it to hc/mhc); AttnRes as a `default` block with a block size."""
    for arch, want in (("hc", "hc"), ("liger_mhc", "mhc"), ("attnres", "attnres"), ("blockattnres", "blockattnres")):
        config = copy.deepcopy(fixture(arch)["config"])
        block = config["model"]["block"]
        block["name"] = "default"
        block["attention"] = block.pop("sequence_mixer")
        mapping = olmo_core_mapping(config)
        assert mapping.cfg.arch == want
        assert {k: list(v) for k, v in olmo_core_shapes(mapping).items()} == fixture(arch)["tensors"]
