"""`grid plan --from-depthbench FILE...`: DepthBench's configs/*.json as grid cells at exactly their shapes (issue 44,
item 7). The files are written as DepthBench's configs/llama_400m_L*.json are (same keys and values); the reference
is DepthBench's own configs/README.md table, which publishes each shape's total and backbone parameter counts
(in millions, rounded): L16 407M / 284M, L24 405M / 302M, L32 399M / 309M.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from depthtools.errors import DepthToolsError
from depthtools.grid import load_grid
from depthtools.interop.depthbench_configs import depthbench_cells

runner = CliRunner()
# (layers, hidden, intermediate) -> DepthBench README's (total, backbone) in millions
README = {(16, 1216, 3248): (407, 284), (24, 1024, 2736): (405, 302), (32, 896, 2400): (399, 309)}


def depthbench_config(folder: Path, layers: int, hidden: int, intermediate: int, **change) -> Path:
    """A configs/llama_400m_L<n>.json as DepthBench writes it."""
    config = {"architectures": ["LLaMAForCausalLM"], "attention_bias": False, "bos_token_id": None, "eos_token_id": 50279,
              "head_dim": hidden // 16, "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": intermediate,
              "initializer_range": 0.02, "max_sequence_length": 2048, "model_type": "llama",
              "num_attention_heads": 16, "num_hidden_layers": layers, "num_key_value_heads": 16, "pad_token_id": 1,
              "rope_theta": 10000, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 50280, **change}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama_400m_L{layers}.json"
    path.write_text(json.dumps(config))
    return path


def test_cells_have_depthbench_shapes_and_its_published_counts(tmp_path):
    files = [depthbench_config(tmp_path, *shape) for shape in README]
    cells, notes = depthbench_cells(files, ["preln", "hc"])
    assert notes == []
    assert [c.name for c in cells] == ["preln_L16", "preln_L24", "preln_L32", "hc_L16", "hc_L24", "hc_L32"]
    for cell in cells[:3]:
        total, backbone = README[(cell.n_layer, cell.d_model, cell.d_ff)]
        assert round(cell.params_total / 1e6) == total and round(cell.params_non_embedding / 1e6) == backbone
        assert cell.model["max_seq_len"] == 2048 and cell.model["norm_eps"] == 1e-6 and cell.head_dim == cell.d_model // 16
    assert all(c.params_extra > 0 for c in cells[3:])  # HC's stream parameters


def test_cli_writes_a_spec_that_grid_train_accepts(tmp_path):
    files = [str(depthbench_config(tmp_path / "configs", *shape)) for shape in README]
    out = tmp_path / "db.json"
    result = runner.invoke(app, ["grid", "plan", "--from-depthbench", *files, "--arch", "hc", "--name", "db400m",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    spec = load_grid(out)  # the one check every grid spec passes (depthtools.grid.check_spec)
    assert spec["name"] == "db400m" and [c.name for c in spec["cells"]] == ["hc_L16", "hc_L24", "hc_L32"]
    assert spec["plan"]["from_depthbench"] == files


def test_block_settings_are_reported_not_applied(tmp_path):
    file = depthbench_config(tmp_path, 24, 1024, 2736, block_name="attnres", attnres_block_size=1)
    cells, notes = depthbench_cells([file], ["preln"])
    assert cells[0].model["options"] == {}
    assert notes and "attnres_block_size=1, block_name='attnres' not applied" in notes[0]


@pytest.mark.parametrize("change, needle", [
    ({"hidden_size": None}, "hidden_size=None is not int"),
    ({"num_hidden_layers": "24"}, "num_hidden_layers='24' is not int"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not expressible"),
    ({"head_dim": 60}, "head_dim=60 × num_attention_heads=16 is not hidden_size=1024"),
])
def test_bad_files_are_refused_naming_the_key(tmp_path, change, needle):
    file = depthbench_config(tmp_path, 24, 1024, 2736, **change)
    with pytest.raises(DepthToolsError, match=needle.replace("(", r"\(")) as err:
        depthbench_cells([file], ["preln"])
    assert str(file) in str(err.value)


def test_cli_refusals(tmp_path):
    file = depthbench_config(tmp_path, 24, 1024, 2736)
    twice = depthbench_config(tmp_path / "other", 24, 1024, 2736)
    for args, needle in ((["grid", "plan", str(file)], "only with --from-depthbench"),
                         (["grid", "plan", "--from-depthbench", str(file), "--budget", "1M"], "drop --preset, --budget"),
                         (["grid", "plan", "--from-depthbench", str(file), str(twice)], "share depth 24"),
                         (["grid", "plan", "--from-depthbench", str(tmp_path / "missing.json")], "missing.json")):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and needle in result.output, result.output
