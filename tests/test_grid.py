"""Iso-parameter grid planner: exact counts, tolerance, DepthBench's rule, clean failures."""


import pytest

from depthtools.arch import DepthModel
from depthtools.errors import DepthToolsError
from depthtools.grid import count_params, grid_spec, load_grid, parse_count, plan_grid, save_grid


def test_parse_count():
    assert parse_count("405.4M") == 405_400_000
    assert parse_count("200k") == 200_000 and parse_count("2e6") == 2_000_000 and parse_count(1600) == 1600
    with pytest.raises(DepthToolsError, match="cannot read"):
        parse_count("lots")


def test_depthbench_rule_reproduces_the_paper_shapes():
    cells = plan_grid("preln", "405.4M", vocab_size=50280, layers=[16, 24, 32], n_heads=16,
                      head_dim_multiple=2, ffn_multiple=16)
    shapes = [(c.n_layer, c.d_model, c.head_dim, c.d_ff) for c in cells]
    # L24 is the reference model itself (d=1024, d_ff = ceil(8/3·1024 / 16)·16 = 2736)
    assert shapes == [(16, 1216, 76, 3248), (24, 1024, 64, 2736), (32, 896, 56, 2400)]
    assert all(abs(c.deviation) <= 0.03 for c in cells)
    assert cells[1].params_total == 405_406_720
    assert [round(c.aspect_ratio, 1) for c in cells] == [76.0, 42.7, 28.0]  # website's AR range


@pytest.mark.parametrize("arch", ["preln", "keel", "periln", "rezero"])
def test_cells_within_tolerance_and_counts_equal_instantiated_models(arch):
    cells = plan_grid(arch, "300k", vocab_size=256, layers=[2, 4, 8], n_heads=2, tolerance=0.06)
    for cell in cells:
        assert abs(cell.deviation) <= 0.06
        model = DepthModel(cell.model_config())
        assert cell.params_total == sum(p.numel() for p in model.parameters())
        assert cell.params_non_embedding == cell.params_total - 2 * 256 * cell.d_model
        assert cell.name == f"{arch}_L{cell.n_layer}" and cell.d_model % 2 == 0


def test_width_is_the_closest_allowed_to_the_budget():
    cell = plan_grid("preln", "300k", vocab_size=256, layers=[4], n_heads=2, tolerance=0.1)[0]
    budget = 300_000
    for other in (cell.d_model - 4, cell.d_model + 4):
        cfg = cell.model_config().replace(d_model=other, d_ff=None)
        from depthtools.config import default_d_ff
        cfg = cfg.replace(d_ff=default_d_ff(other, 16))
        assert abs(count_params(cfg)["total"] - budget) >= abs(cell.params_total - budget)


def test_non_embedding_basis_and_fixed_head_dim():
    cells = plan_grid("preln", "1M", vocab_size=256, layers=[4, 8], basis="non_embedding",
                      n_heads=None, head_dim=16, tolerance=0.15)
    for c in cells:
        assert c.head_dim == 16 and c.n_heads == c.d_model // 16
        assert c.deviation == pytest.approx((c.params_non_embedding - 1_000_000) / 1_000_000)


def test_aspect_ratios_choose_depths():
    cells = plan_grid("preln", "405.4M", vocab_size=50280, aspect_ratios=[76, 28], n_heads=16)
    assert [c.n_layer for c in cells] == [16, 32]


def test_impossible_requests_fail_cleanly():
    with pytest.raises(DepthToolsError, match="no shape for preln_L64"):
        plan_grid("preln", "50k", vocab_size=256, layers=[64], n_heads=16)
    with pytest.raises(DepthToolsError, match="unknown architecture 'transformerx'"):
        plan_grid("transformerx", "1M", layers=[2])
    with pytest.raises(DepthToolsError, match="exactly one of layers or aspect_ratios"):
        plan_grid("preln", "1M")
    with pytest.raises(DepthToolsError, match="positive"):
        plan_grid("preln", "1M", layers=[0])


def test_grid_spec_round_trip(tmp_path):
    cells = plan_grid(["preln", "lns"], "300k", vocab_size=256, layers=[2, 4], n_heads=2, tolerance=0.06)
    path = save_grid(grid_spec(cells, name="g", train={"lr": 1e-3}), tmp_path / "grid.json")
    spec = load_grid(path)
    assert spec["cells"] == cells and spec["train"] == {"lr": 1e-3}
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DepthToolsError, match="not valid"):
        load_grid(tmp_path / "bad.json")
    with pytest.raises(DepthToolsError, match="not found"):
        load_grid(tmp_path / "missing.json")
