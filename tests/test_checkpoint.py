"""Checkpoints: safetensors + JSON round trip, atomicity, resolution and clear errors."""

import json

import pytest
import torch

from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig
from depthtools.errors import CheckpointError


def model(arch="preln", **kw):
    return DepthModel(ModelConfig(arch=arch, vocab_size=40, d_model=32, n_layer=2, n_heads=4, **kw), seed=1)


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_gives_bit_identical_logits(tmp_path, tie):
    m = model("keel", tie_embeddings=tie).eval()
    ck.save(m, tmp_path / "g" / "keel_L2", extra={"note": "x"})
    loaded = ck.load(tmp_path / "g" / "keel_L2")
    t = torch.randint(0, 40, (2, 7))
    assert torch.equal(m(t), loaded(t))
    assert (loaded.unembed.weight is loaded.tok_embed.weight) == tie
    config = json.loads((tmp_path / "g" / "keel_L2" / "config.json").read_text())
    assert config["note"] == "x" and config["params"]["total"] == m.param_counts()["total"]
    assert not list((tmp_path / "g" / "keel_L2").glob("*.tmp")), "temporary files left behind"


def test_names_resolve_under_the_checkpoint_root(tmp_path, monkeypatch):
    ck.save(model(), tmp_path / "grid1" / "preln_L2")
    ck.save(model(), tmp_path / "grid2" / "preln_L2")
    ck.save(model("lns"), tmp_path / "grid1" / "lns_L2")
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path))
    assert ck.resolve("lns_L2") == tmp_path / "grid1" / "lns_L2"
    assert ck.resolve("grid2/preln_L2") == tmp_path / "grid2" / "preln_L2"
    with pytest.raises(CheckpointError, match="ambiguous") as err:
        ck.load("preln_L2")
    assert "grid1" in str(err.value) and "grid2" in str(err.value)
    with pytest.raises(CheckpointError, match="unknown checkpoint 'hc_L96'.*available: .*lns_L2"):
        ck.load("hc_L96")


def test_corrupt_weights_are_a_one_line_error(tmp_path):
    directory = ck.save(model(), tmp_path / "c")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: len(weights.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match="corrupt weights file") as err:
        ck.load(directory)
    assert "\n" not in str(err.value)
    (directory / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="corrupt JSON"):
        ck.load(directory)


def test_config_mismatch_is_reported(tmp_path):
    directory = ck.save(model(), tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    config["model"]["d_model"] = 48
    config["model"]["d_ff"] = None
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="do not match config"):
        ck.load(directory)
    config["model"]["arch"] = "periln"
    config["model"]["d_model"] = 32
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="missing .*out_norm"):
        ck.load(directory)


def test_missing_weights_and_no_pickle(tmp_path):
    directory = ck.save(model(), tmp_path / "m")
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing weights file"):
        ck.load(directory)
    # a pickle disguised as safetensors is refused, never unpickled
    import pickle
    (directory / "model.safetensors").write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(CheckpointError, match="corrupt"):
        ck.load(directory)


def test_interrupted_write_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "a.json"
    ck.atomic_write_json(path, {"v": 1})

    class Boom(Exception):
        pass

    def explode(*a, **k):
        raise Boom

    monkeypatch.setattr(ck.os, "replace", explode)
    with pytest.raises(Boom):
        ck.atomic_write_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch,tie", [("preln", True), ("hc", False)])
def test_load_in_a_low_precision_dtype_equals_a_cast_float32_load(tmp_path, dtype, arch, tie):
    """Issue 45: load(dtype=...) (parameters built on the meta device, then the checkpoint's tensors cast
    straight to the dtype) is bit-identical to load() cast with .to(dtype): parameters, RoPE tables and
    logits; every parameter is in the dtype on the CPU; a tied unembedding stays tied."""
    model = DepthModel(ModelConfig(arch=arch, vocab_size=64, d_model=16, n_layer=2, n_heads=2, max_seq_len=16,
                                   tie_embeddings=tie), seed=0)
    ck.save(model, tmp_path / "c")
    cast = ck.load(tmp_path / "c").to(getattr(torch, dtype))
    direct = ck.load(tmp_path / "c", dtype=dtype)
    assert {p.dtype for p in direct.parameters()} == {getattr(torch, dtype)}
    assert all(p.device.type == "cpu" for p in direct.parameters())
    a, b = cast.state_dict(), direct.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(cast.buffers(), direct.buffers()))
    assert (direct.unembed.weight is direct.tok_embed.weight) == tie
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(cast.run(tokens), direct.run(tokens))
