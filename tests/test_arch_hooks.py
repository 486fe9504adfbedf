"""What the rest of the package asks of an architecture through its registration and scheme (issue 46, item 1).

* `--protocol depthbench` reads every per-architecture step from the scheme (`ResidualScheme.depthbench_*`): a
  new architecture joins the protocol by declaring them in its own file. A toy architecture whose state is a
  (stream, depth) pair and which computes Pre-LN gets, with Pre-LN's weights, Pre-LN's DepthBench numbers.
* The options a recipe profile sets are each architecture's own (`ArchSpec.profiles`): for every registered
  architecture and option set, `profiles.apply_model` gives what the tables of profiles.py gave before the move
  (copied below as they were: `OLD_DEPTHBENCH_OPTIONS`, `OLD_MHC_READOUT`).
* Options whose default changed are the architecture's (`ArchSpec.legacy_defaults`); checkpoint.py asks
  `registry.upgrade_options`.
* "Accepts the Pre-LN backbone options" is a registration property (`ArchSpec.backbone_options`), true exactly for
  the architectures whose schema holds those options.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from depthtools.analysis import depthbench as db
from depthtools.arch import ArchSpec, DepthModel, get_arch, list_archs, register, unregister
from depthtools.arch.backbone import OPTIONS as BACKBONE_OPTIONS
from depthtools.arch.layers import make_norm
from depthtools.arch.registry import baseline_config, upgrade_options
from depthtools.arch.scheme import ResidualScheme
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError
from depthtools.profiles import apply_model

from tiny_models import one_thread, tiny, windows  # noqa: F401  (one_thread: autouse fixture)

# -- a new architecture joins the DepthBench protocol from its own scheme ----------------------------------------


class PairState(NamedTuple):
    """The toy's state: the residual stream and a depth counter (a state that is not the stream itself)."""

    h: torch.Tensor
    depth: int


class PairScheme(ResidualScheme):
    """Pre-LN computed on a (stream, depth) pair, declaring DepthBench's residual-family hooks."""

    depthbench_family = "residual"
    depthbench_undefined = {"usefulness_score": "a toy reason"}

    def build_block(self, block):
        block.attn_norm, block.mlp_norm = make_norm(self.cfg), make_norm(self.cfg)

    def embed_state(self, x0):
        return PairState(x0, 0)

    def step(self, position, block, state, home, rope):
        h = state.h + block.attn(block.attn_norm(state.h), *rope)
        return PairState(h + block.mlp(block.mlp_norm(h)), state.depth + 1)

    def skip(self, position, state, rule=None):
        self._check_rule(rule)
        return PairState(state.h, state.depth + 1)

    def readout(self, state):
        return state.h

    def geometry(self, state):
        return state.h

    def written_tensor(self, state):
        return state.h

    def depthbench_block_output(self, state):
        return state.h

    def depthbench_with_input(self, state, x):
        return PairState(x, state.depth)


@pytest.fixture
def pair_arch():
    register(ArchSpec("toypair", "normalisation", "Pre-LN on a (stream, depth) pair", "0", lambda c: 0,
                      "none (a test architecture)", PairScheme))
    try:
        yield "toypair"
    finally:
        unregister("toypair")


def test_a_new_architecture_joins_the_depthbench_protocol_from_its_scheme(pair_arch):
    preln = tiny("preln", n_layer=3)
    cfg = preln.config.replace(arch=pair_arch, options={})
    pair = DepthModel(cfg, seed=0).double().eval()
    pair.load_state_dict(preln.state_dict())
    ids = windows(3, 7)
    assert db.family(pair) == "residual" and db.skip_rule(pair) == "identity"
    got = db.depthbench_metrics(pair, ids, micro_batch_size=2)
    want = db.depthbench_metrics(preln, ids, micro_batch_size=2)
    useful = want.metric.isin(["usefulness_loss_ratio", "global_usefulness_score"])
    assert useful.any() and not got.metric.isin(["usefulness_loss_ratio", "global_usefulness_score"]).any()
    want = want[~useful].reset_index(drop=True)  # usefulness: declared undefined for the toy
    assert got[["metric", "layer", "layer_j"]].equals(want[["metric", "layer", "layer_j"]])
    assert {"jacobian_norm", "causal_score", "kl_to_final"} <= set(got.metric)
    torch.testing.assert_close(torch.tensor(got.value.to_numpy()), torch.tensor(want.value.to_numpy()),
                               rtol=1e-9, atol=1e-12, equal_nan=True)
    with pytest.raises(DepthToolsError, match="DepthBench's usefulness_score is undefined for toypair: a toy reason"):
        db.check_defined(pair, "usefulness_score")


def test_an_architecture_without_depthbench_hooks_is_refused_in_one_line(pair_arch):
    model = tiny("denseformer", n_layer=2)
    assert type(model.scheme).depthbench_family is None
    with pytest.raises(DepthToolsError, match="--protocol depthbench is undefined for denseformer"):
        db.family(model)


# -- recipe profiles: the options before and after the move ------------------------------------------------------

OLD_DEPTHBENCH_OPTIONS = {  # depthtools/profiles.py before issue 46, literally
    "hc": {"readout": "normed_sum"},
    "mhc": {"mhc_init": "uniform", "sinkhorn_iters": 20, "sinkhorn_order": "cols_last"},
    "moda": {"moda_depth_rope": "query"},
    "deepnorm": {"norm": "layernorm"},
    # added after the move (a deliberate change, tests/test_profiles.py): DepthBench's AttnRes res-norm eps
    "attnres": {"mix_eps": 1e-5},
    "blockattnres": {"mix_eps": 1e-5},
}
OLD_MHC_READOUT = {"uniform": "mean"}
GIVEN = [{}, {"mhc_init": "hc_like"}, {"mhc_init": "uniform"}, {"readout": "sum"}, {"sinkhorn_iters": 5},
         {"norm": "rmsnorm"}, {"moda_depth_rope": "none"}, {"n_streams": 2}, {"sinkhorn_order": "rows_last"}]


def old_depthbench_options(arch: str, given: dict) -> dict:
    """profiles.apply_model's options as written before the move."""
    options = {**OLD_DEPTHBENCH_OPTIONS.get(arch, {}), **given}
    if arch == "mhc" and "readout" not in given:
        options["readout"] = OLD_MHC_READOUT.get(options["mhc_init"], "normed_sum")
    return options


def test_profile_options_are_those_of_the_old_tables_for_every_architecture():
    checked = 0
    for spec in list_archs():
        for given in GIVEN:
            try:
                cfg = ModelConfig(arch=spec.name, n_layer=4, options=given)
            except DepthToolsError:
                continue  # an option this architecture does not take
            assert apply_model("depthtools", cfg) == cfg
            under = apply_model("depthbench", cfg)
            assert under.options == old_depthbench_options(spec.name, given), (spec.name, given)
            assert under.norm_eps == 1e-6 and apply_model("depthbench", under) == under  # idempotent
            checked += 1
    assert checked >= len(list_archs()) + 8  # every architecture, and the option sets of hc, mhc, moda, deepnorm
    assert {s.name for s in list_archs() if s.profiles} == set(OLD_DEPTHBENCH_OPTIONS)


# -- legacy defaults ---------------------------------------------------------------------------------------------

def test_upgrade_options_fills_only_what_a_saved_config_predates():
    old = {"arch": "mhc", "n_layer": 2, "options": {"n_streams": 2}}
    assert upgrade_options(old) == {**old, "options": {"n_streams": 2, "sinkhorn_order": "cols_last"}}
    assert old["options"] == {"n_streams": 2}  # the section read is not changed in place
    new = {"arch": "mhc", "options": {"sinkhorn_order": "rows_last"}}
    assert upgrade_options(new) is new
    assert upgrade_options({"arch": "mhc"})["options"] == {"sinkhorn_order": "cols_last"}
    for unchanged in ({"arch": "hc", "options": {}}, {"arch": "mhc", "options": ["x"]}, {"arch": "nope"}, ["mhc"],
                      None, {"options": {}}):
        assert upgrade_options(unchanged) is unchanged
    for spec in list_archs():  # every legacy default is a valid value of an option the architecture takes
        schema = spec.option_schema()
        assert all(k in schema and schema[k].valid(v) for k, v in spec.legacy_defaults.items()), spec.name
    assert get_arch("mhc").legacy_defaults == {"sinkhorn_order": "cols_last"}


# -- Pre-LN backbone options and the reference architecture -------------------------------------------------------

def test_backbone_options_is_declared_exactly_where_the_schema_holds_them():
    for spec in list_archs():
        assert spec.backbone_options == (set(BACKBONE_OPTIONS) <= set(spec.option_schema())), spec.name
    assert [s.name for s in list_archs() if s.backbone_options] == ["preln"]
    with pytest.raises(DepthToolsError, match="layer_types"):  # the cross-option check runs where declared
        ModelConfig(arch="preln", n_layer=2, options={"layer_types": "sss"})


def test_baseline_config_is_the_reference_architecture_of_the_same_shape():
    hc = ModelConfig(arch="hc", n_layer=3, d_model=48, options={"n_streams": 2})
    base = baseline_config(hc)
    assert (base.arch, base.options, base.n_layer, base.d_model) == ("preln", {}, 3, 48)
    preln = ModelConfig(arch="preln", n_layer=3, options={"mlp": "plain"})
    assert baseline_config(preln) is preln
