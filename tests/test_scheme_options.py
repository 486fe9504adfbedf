"""Architecture options (issue 19): every scheme declares its options (kind, default, valid values),
and ModelConfig / DepthModel refuse an unknown key or a bad value for every architecture."""

import dataclasses

import pytest

from depthtools.arch import DepthModel, get_arch, list_archs
from depthtools.arch.scheme import Option
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

ARCHS = [spec.name for spec in list_archs()]
SHAPE = dict(vocab_size=32, d_model=16, n_layer=2, n_heads=2, max_seq_len=8)


def bad_value(option: Option):
    """A value of the wrong kind (or outside the valid ones) for `option`."""
    return {"bool": "yes", "int": 0 if option.low == 1 else "x", "number": float("nan"), "str": "no-such-value",
            "numbers": [1.0, "x"]}[option.kind]


@pytest.mark.parametrize("arch", ARCHS)
def test_unknown_option_is_a_one_line_error_naming_arch_key_and_valid_ones(arch):
    """Before issue 19 only hc/mhc refused unknown keys: preln or keel silently ignored a typo."""
    schema = get_arch(arch).option_schema()
    for build in (lambda: ModelConfig(arch=arch, options={"no_such_option": 1}, **SHAPE),
                  lambda: DepthModel(_with_options(arch, {"no_such_option": 1}))):
        with pytest.raises(DepthToolsError) as err:
            build()
        message = str(err.value)
        assert "\n" not in message and arch in message and "'no_such_option'" in message
        assert all(name in message for name in schema) and (schema or "none" in message)


def _with_options(arch, options):
    """A valid config whose options dict is changed afterwards (DepthModel re-validates it)."""
    cfg = ModelConfig(arch=arch, **SHAPE)
    cfg.options.update(options)
    return cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_declared_options_build_with_their_defaults_and_refuse_bad_values(arch):
    schema = get_arch(arch).option_schema()
    for name, option in schema.items():
        cfg = ModelConfig(arch=arch, options={name: option.default_for(ModelConfig(arch=arch, **SHAPE))}, **SHAPE)
        model = DepthModel(cfg)
        assert getattr(model.scheme.opts, name) == cfg.options[name]
        with pytest.raises(DepthToolsError, match=f"{arch} option {name} must be") as err:
            ModelConfig(arch=arch, options={name: bad_value(option)}, **SHAPE)
        assert "\n" not in str(err.value)
    opts = DepthModel(ModelConfig(arch=arch, **SHAPE)).scheme.opts
    assert set(opts.as_dict()) == set(schema)  # defaults filled in


@pytest.mark.parametrize("arch", ARCHS)
def test_a_scheme_reads_one_frozen_typed_options_object(arch):
    """The options are resolved once, into a frozen dataclass whose fields are the schema's (typed by kind);
    the registry's spec builds the same object, and a scheme cannot change an option after the build."""
    cfg = ModelConfig(arch=arch, **SHAPE)
    schema, opts = get_arch(arch).option_schema(), DepthModel(cfg).scheme.opts
    assert dataclasses.is_dataclass(opts) and get_arch(arch).options(cfg) == opts
    kinds = {"bool": bool, "int": int, "number": float, "str": str, "numbers": tuple}
    assert {f.name: f.type for f in dataclasses.fields(opts)} == {n: kinds[o.kind] for n, o in schema.items()}
    assert opts.as_dict() == {n: o.default_for(cfg) for n, o in schema.items()}
    for name in schema:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(opts, name, None)


def test_option_schemas_of_the_architectures_with_options():
    names = {arch: sorted(get_arch(arch).option_schema()) for arch in ARCHS}
    assert {"n_streams", "head_mixer", "connector_norm_eps", "connector_norm_gain"} <= set(names["hc"])
    assert {"mhc_init", "sinkhorn_iters", "sinkhorn_order"} <= set(names["mhc"])
    assert "attnres_block_size" in names["blockattnres"] and "attnres_block_size" not in names["attnres"]
    assert {"dwa_dilation", "dwa_period"} <= set(names["denseformer"])
    assert {"moda_norm", "moda_depth_rope"} <= set(names["moda"])
    assert names["keel"] == ["keel_alpha"] and names["mixln"] == ["post_fraction"]
    assert names["depthmup"] == names["completep"] == ["base_layers", "depth_exponent"]
    assert {"qkv_bias", "qk_norm", "norm", "norm_gain", "out_norm", "parallel", "positions", "sliding_window",
            "layer_types", "attn_softcap", "final_softcap", "rotary_fraction", "embed_scale"} <= set(names["preln"])
    assert all(not names[arch] or arch == "preln" or "qkv_bias" not in names[arch] for arch in ARCHS)
    # defaults that depend on the shape
    assert get_arch("blockattnres").option_schema()["attnres_block_size"].default_for(
        ModelConfig(arch="blockattnres", n_layer=12)) == 4
    assert get_arch("keel").option_schema()["keel_alpha"].default_for(ModelConfig(arch="keel", n_layer=6)) == 12
    with pytest.raises(DepthToolsError, match=r"mixln option post_fraction must be a finite number in \[0, 1\]"):
        ModelConfig(arch="mixln", options={"post_fraction": 1.5})
    with pytest.raises(DepthToolsError, match="keel option keel_alpha must be a finite number, got 'x'"):
        ModelConfig(arch="keel", options={"keel_alpha": "x"})  # was a ValueError traceback from float()


def test_an_alias_is_stored_as_its_architecture():
    """Before: ModelConfig(arch="sandwich") could not be built (NormFamilyScheme did not know the alias),
    and "full_attnres" built a model whose FLOPs and routing dispatch did not recognise it."""
    cfg = ModelConfig(arch="sandwich", **SHAPE)
    assert cfg.arch == "periln" and DepthModel(cfg).config.arch == "periln"
    assert ModelConfig(arch="full_attnres", **SHAPE).arch == "attnres"
    assert ModelConfig.from_dict({**cfg.to_dict(), "arch": "block_attnres"}).arch == "blockattnres"
    with pytest.raises(DepthToolsError, match="unknown architecture 'nope'"):
        ModelConfig(arch="nope")
