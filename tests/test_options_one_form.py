"""The Pre-LN options in one form, and model-config validation owned by arch/ (issue 46 item 2).

`Backbone` and `RopeScaling` are generated from the option records (`backbone.OPTIONS`, `rope.ROPE_OPTIONS`), so
their fields, types and defaults are the schema's; depthtools.config imports nothing from arch/, so a config built
before the registry is loaded is checked later by `registry.validate_model_config`, with the same one-line refusal
a config built after gets at construction.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from depthtools.arch.backbone import DEFAULTS, OPTIONS, Backbone, backbone
from depthtools.arch.rope import ROPE_OPTIONS, RopeScaling, rope_field
from depthtools.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"bool": bool, "int": int, "number": float, "str": str, "numbers": tuple}


def test_backbone_fields_are_the_schema_records():
    fields = dataclasses.fields(Backbone)
    assert [f.name for f in fields] == list(OPTIONS)
    for f in fields:
        assert f.default == OPTIONS[f.name].default and f.type is KINDS[OPTIONS[f.name].kind], f.name
    assert {k: getattr(DEFAULTS, k) for k in OPTIONS} == {k: o.default for k, o in OPTIONS.items()}
    assert dataclasses.is_dataclass(Backbone) and Backbone.__module__ == "depthtools.arch.backbone"
    try:
        DEFAULTS.norm = "layer"
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("Backbone is not frozen")


def test_rope_scaling_fields_are_the_rope_records_and_read_the_options():
    assert all(OPTIONS[k] is v for k, v in ROPE_OPTIONS.items())  # spliced in, not copied
    assert [f.name for f in dataclasses.fields(RopeScaling)] == [rope_field(k) for k in ROPE_OPTIONS]
    assert [f.default for f in dataclasses.fields(RopeScaling)] == [o.default for o in ROPE_OPTIONS.values()]
    cfg = ModelConfig(arch="preln", d_model=32, n_heads=4, options={
        "rope_type": "longrope", "rope_factor": 4, "rope_original_context": 8,
        "rope_short_factor": [1, 2], "rope_long_factor": [3, 4], "rotary_fraction": 0.5})
    rope = backbone(cfg).rope
    assert rope == RopeScaling("longrope", 4.0, 8, 1.0, 4.0, 32.0, 1.0, True, 0.0, (1.0, 2.0), (3.0, 4.0))
    assert type(rope.factor) is float and all(type(v) is float for v in rope.long_factor)  # JSON ints read as floats


def _run(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-3:]
    return proc.stdout.strip().splitlines()


BAD = [{"arch": "nope"}, {"d_model": 66, "n_heads": 4}, {"d_model": 12, "n_heads": 4},
       {"options": {"norm": "x"}}, {"options": {"layer_types": "sf"}}, {"arch": "full_attnres", "options": {"x": 1}},
       {"options": {"rope_type": "yarn"}}]


def test_a_config_built_before_the_registry_is_refused_later_with_the_same_line():
    """In a fresh interpreter: ModelConfigs built with no depthtools.arch module loaded pass their shape checks;
    validate_model_config then refuses each with the line a config built after the registry loaded gets at once,
    and stores an alias as the name it stands for."""
    code = f"""
import json, sys
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError
bad = json.loads({json.dumps(json.dumps(BAD))})
early = [ModelConfig(**kw) for kw in bad]  # no registry: shape-only checks pass
alias = ModelConfig(arch="sandwich")
assert alias.arch == "sandwich" and not [m for m in sys.modules if m.startswith("depthtools.arch")]
from depthtools.arch.registry import validate_model_config
def line(f):
    try:
        f()
    except DepthToolsError as exc:
        return str(exc)
    return "accepted"
for kw, cfg in zip(bad, early):
    print(json.dumps([line(lambda: validate_model_config(cfg)), line(lambda: ModelConfig(**kw))]))
print(json.dumps([validate_model_config(alias).arch, ModelConfig(arch="sandwich").arch]))
"""
    rows = [json.loads(r) for r in _run(code)]
    for (late, at_build), kw in zip(rows[:-1], BAD):
        assert late == at_build and late != "accepted" and "\n" not in late, (kw, late, at_build)
    assert rows[-1] == ["periln", "periln"]


def test_backbone_archs_agree_with_the_registrations():
    """`backbone(cfg)` reads the Pre-LN options for BACKBONE_ARCHS; the registry's ArchSpec.backbone_options says
    which architectures accept them. The two must name the same architectures."""
    from depthtools.arch import registry
    from depthtools.arch.backbone import BACKBONE_ARCHS

    flagged = {spec.name for spec in registry.list_archs() if spec.backbone_options}
    assert flagged == set(BACKBONE_ARCHS)
