"""Adding an architecture is one scheme file and one registration (issue 36, "Done when").

A toy architecture is written to a temporary module (its scheme class and a single
`depthtools.arch.register(ArchSpec(...))` call), imported, and then every part of the package that
enumerates architectures must pick it up with no other edit: the CLI's `archs --json`, the grid planner
(its closed-form parameter count against a model built on `meta`), the trainer, the probes (logit lens,
skip ablation) and the generated docs table. It is unregistered afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from cli.main import app
from depthtools.analysis import ablate, logit_lens
from depthtools.arch import DepthModel, canonical_name, list_archs, unregister
from depthtools.arch.doc_table import registry_markdown_table
from depthtools.checkpoint import read_metrics
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.grid import count_params, plan_grid
from depthtools.train import train_cell

from tiny_models import SMALL, one_thread, windows  # noqa: F401 (fixture)

NAME = "toygate"

# The whole new architecture: one scheme file, one registration call.
SCHEME_FILE = textwrap.dedent('''
    """Toy gated residual: h + g·f(Norm h), one learnable scalar gate g per sublayer."""
    import torch
    from torch import nn

    from depthtools.arch import ArchSpec, register
    from depthtools.arch.layers import make_norm
    from depthtools.arch.scheme import Option, ResidualScheme


    class ToyGateScheme(ResidualScheme):
        single_stream = True

        @classmethod
        def option_schema(cls, arch):
            return {"gate_init": Option("number", 0.5, doc="initial gate g")}

        def build_block(self, block):
            block.attn_norm, block.mlp_norm = make_norm(self.cfg), make_norm(self.cfg)
            block.attn_gate = nn.Parameter(torch.full((1,), float(self.opts.gate_init)))
            block.mlp_gate = nn.Parameter(torch.full((1,), float(self.opts.gate_init)))

        def step(self, position, block, h, home, rope):
            h = block.hook_resid_pre(h)
            a = block.hook_attn_out(block.attn_gate * block.attn(block.attn_norm(h), *rope))
            h = block.hook_resid_mid(h + a)
            m = block.hook_mlp_out(block.mlp_gate * block.mlp(block.mlp_norm(h)))
            return block.hook_resid_post(h + m)


    register(ArchSpec("toygate", "baseline", "Toy gate: h + g·f(Norm h)", "2·L", lambda c: 2 * c.n_layer,
                      "none (a test architecture)", ToyGateScheme))
''')


@pytest.fixture
def toy_arch(tmp_path):
    """Import the one-file architecture from a temporary module; unregister it afterwards."""
    path = tmp_path / "toygate_arch.py"
    path.write_text(SCHEME_FILE)
    spec = importlib.util.spec_from_file_location("toygate_arch", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toygate_arch"] = module
    try:
        spec.loader.exec_module(module)
        yield NAME
    finally:
        sys.modules.pop("toygate_arch", None)
        if NAME in {s.name for s in list_archs()}:
            unregister(NAME)


def test_registry_and_cli_list_it(toy_arch):
    assert canonical_name(toy_arch) == toy_arch
    result = CliRunner().invoke(app, ["archs", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert rows[toy_arch]["extra_params"] == "2·L" and rows[toy_arch]["cpu_kernels"] == {}
    with pytest.raises(DepthToolsError, match="toygate option gate_init must be a finite number"):
        ModelConfig(arch=toy_arch, options={"gate_init": "big"}, **SMALL)


def test_docs_table_has_its_row(toy_arch):
    rows = [r for r in registry_markdown_table().splitlines() if r.startswith(f"| `{toy_arch}`")]
    assert rows == [f"| `{toy_arch}` | baseline | Toy gate: h + g·f(Norm h) | 2·L | none (a test architecture) |  |"]


def test_planner_counts_its_parameters_on_meta(toy_arch):
    cells = plan_grid([toy_arch, "preln"], "200k", layers=[2, 4], n_heads=2)
    toy = {c.n_layer: c for c in cells if c.arch == toy_arch}
    assert sorted(toy) == [2, 4]
    for L, cell in toy.items():
        assert cell.params_extra == 2 * L and abs(cell.deviation) <= 0.03
        built = DepthModel(cell.model_config(), seed=0).param_counts()  # a real (CPU) model, not the meta count
        assert built == count_params(cell.model_config())
        plain = count_params(cell.model_config().replace(arch="preln", options={}))
        assert built["total"] - plain["total"] == 2 * L


def test_trainer_trains_it(toy_arch, data_dir, tmp_path):
    recipe = TrainConfig(tokens=20 * 8 * 32, batch_size=8, seq_len=32, lr=1e-2, eval_tokens=512, log_every=5,
                         eval_every=0, depth_stats_every=0, checkpoint_every=0, threads=1)
    summary = train_cell(ModelConfig(arch=toy_arch, **SMALL), recipe, data_dir, tmp_path / "cell")
    records = read_metrics(tmp_path / "cell")
    assert records[-1]["step"] == 20 and records[-1]["train_loss"] < records[0]["train_loss"] - 0.5
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < math.log(256)


def test_probes_read_it(toy_arch):
    cfg = ModelConfig(arch=toy_arch, vocab_size=61, d_model=32, n_layer=3, n_heads=4, max_seq_len=24,
                      options={"gate_init": 0.7})
    model, toks = DepthModel(cfg, seed=0).double().eval(), windows()
    assert float(model.blocks[0].attn_gate.detach()) == pytest.approx(0.7)
    lens = logit_lens(model, toks, batch_size=2)
    with torch.no_grad():
        logits = model(toks[:, :-1])[:, 1:]
    ce = F.cross_entropy(logits.flatten(0, 1), toks[:, 2:].flatten()).item()
    assert list(lens["depth"]) == [0, 1, 2, 3] and lens["ce"].iloc[-1] == pytest.approx(ce, rel=1e-10)
    skip = ablate(model, toks, mode="skip", batch_size=2)
    assert list(skip["layer"]) == [0, 1, 2] and set(skip["rule"]) == {"identity"}
    assert (skip["arch"] == toy_arch).all() and (skip["kl_intact_ablated"] > 0).all()
    with torch.no_grad():  # a gate of 0 makes block 1 the identity: skipping it changes nothing
        model.blocks[1].attn_gate.zero_()
        model.blocks[1].mlp_gate.zero_()
    skip = ablate(model, toks, mode="skip", batch_size=2)
    assert skip.set_index("layer").loc[1, "kl_intact_ablated"] == pytest.approx(0, abs=1e-12)


def test_unregister_removes_it(toy_arch):
    unregister(toy_arch)
    assert toy_arch not in {s.name for s in list_archs()} and f"`{toy_arch}`" not in registry_markdown_table()
    with pytest.raises(DepthToolsError, match="unknown architecture 'toygate'"):
        ModelConfig(arch=toy_arch, **SMALL)
