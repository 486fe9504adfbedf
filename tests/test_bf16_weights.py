"""bf16 weights and AdamW state (TrainConfig.param_dtype, depthtools.train.precision), the `depthbench`
profile's choice: what is cast, that tiny runs of DepthBench's families train, save, load and probe, exact
resume, the profile's CPU line, a device without bf16, bad values, and that default recipes stay float32."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from depthtools import profiles
from depthtools.arch import DepthModel
from depthtools.arch.attnres import DepthMixer
from depthtools.checkpoint import load, read_tensors
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import CheckpointError, DepthToolsError
from depthtools.train import loop as train_loop, precision, train_cell
from depthtools.train.optim import build_optimizer

from tiny_models import SMALL, one_thread  # noqa: F401

TINY = dict(batch_size=2, seq_len=16, eval_every=0, eval_tokens=64, log_every=1, depth_stats_every=2,
            checkpoint_every=0, threads=1)
FAMILIES = ("preln", "hc", "mhc", "attnres", "moda")  # DepthBench's families: residual, HC, mHC, AttnRes, MoDA
BF16 = "BF16"


def _header_dtypes(path: Path) -> dict[str, str]:
    """The dtype of every tensor in a safetensors file, read from its JSON header (not through torch)."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _names_in_modules(model: torch.nn.Module, chosen) -> set[str]:
    """Parameter names of the modules `chosen(module)` picks."""
    names = set()
    for prefix, module in model.named_modules():
        if chosen(module):
            names |= {f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters()}
    return names


def _is_norm(module: torch.nn.Module) -> bool:  # depthtools' RMSNorm / LayerNorm modules (layers.py, backbone.py)
    return type(module).__name__.endswith("Norm") and isinstance(getattr(module, "eps", None), float)


# -- the setting ---------------------------------------------------------------------------------
def test_param_dtype_validates_round_trips_and_defaults_to_float32():
    assert TrainConfig().param_dtype == "float32" and "param_dtype" not in TrainConfig().to_dict()
    cfg = TrainConfig(param_dtype="bfloat16")
    assert TrainConfig.from_json(cfg.to_json()) == cfg and cfg.to_dict()["param_dtype"] == "bfloat16"
    with pytest.raises(DepthToolsError, match=r"^unknown param_dtype 'fp16'; valid: float32, bfloat16, auto$"):
        TrainConfig(param_dtype="fp16")
    with pytest.raises(DepthToolsError, match="param_dtype must be a string"):
        TrainConfig.from_dict({"param_dtype": 16})
    from depthtools.presets import PRESETS

    for name, preset in PRESETS.items():  # every shipped recipe keeps float32 weights
        assert TrainConfig.from_dict(dict(preset.train)).param_dtype == "float32", name
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert precision.resolve_param_dtype(TrainConfig(param_dtype="auto"), cpu) == (torch.float32, None)
    assert precision.resolve_param_dtype(TrainConfig(param_dtype="bfloat16"), cpu) == (torch.bfloat16, None)
    assert precision.resolve_param_dtype(TrainConfig(), cuda) == (torch.float32, None)


def test_cast_follows_depthbench_rule_every_parameter_bf16():
    """DepthBench's rule (OLMo-core `Transformer.apply_ddp`: `self.to(dtype=param_dtype)`, no module kept back):
    every parameter is bf16, the norm gains and the AttnRes mixers' query / key-norm gain included; depthtools'
    non-persistent buffers (RoPE tables) stay float32. AdamW's state is created like each parameter."""
    for arch in FAMILIES + ("blockattnres", "deepnorm"):
        model = precision.cast_params(DepthModel(ModelConfig(arch=arch, **SMALL), seed=0), torch.bfloat16)
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        exempt = set()  # DepthBench keeps no parameter in float32
        assert {n for n, d in dtypes.items() if d == torch.float32} == exempt, arch
        assert all(d == torch.bfloat16 for n, d in dtypes.items() if n not in exempt), arch
        norms = _names_in_modules(model, _is_norm)
        assert norms and all(dtypes[n] == torch.bfloat16 for n in norms), arch  # norms are not exempt
        if arch.endswith("attnres"):
            mixers = _names_in_modules(model, lambda m: isinstance(m, DepthMixer))
            assert any(n.endswith(".query") for n in mixers) and any("key_norm" in n for n in mixers)
            assert all(dtypes[n] == torch.bfloat16 for n in mixers)  # nor the AttnRes projections
        assert model.rope_cos.dtype == torch.float32
        assert precision.param_dtype_name(model) == "bfloat16"
        optimizer, _ = build_optimizer(model, TrainConfig(decay_groups="depthbench"), torch.device("cpu"))
        tokens = torch.randint(0, SMALL["vocab_size"], (2, 9))
        logits = model(tokens[:, :-1])
        loss = train_loop.forward_loss(model, tokens[:, :-1], tokens[:, 1:])
        assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32 and math.isfinite(float(loss.detach()))
        loss.backward()
        optimizer.step()
        for group in optimizer.param_groups:  # no float32 master copy: the state is the parameter's dtype
            for p in group["params"]:
                state = optimizer.state[p]
                assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == p.dtype == torch.bfloat16, arch
    tied = precision.cast_params(DepthModel(ModelConfig(arch="preln", tie_embeddings=True, **SMALL)), torch.bfloat16)
    assert tied.unembed.weight is tied.tok_embed.weight and tied.unembed.weight.dtype == torch.bfloat16


# -- training ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_run_trains_saves_loads_and_probes(arch, data_dir, tmp_path):
    from depthtools.analysis import ablate, logit_lens, sample_windows

    out = tmp_path / arch
    recipe = TrainConfig(tokens=4 * 2 * 16, param_dtype="bfloat16", keep_train_state=True, checkpoint_every=2,
                         **{k: v for k, v in TINY.items() if k != "checkpoint_every"})
    summary = train_cell(ModelConfig(arch=arch, **SMALL), recipe, data_dir, out)
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["val_loss"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert any("depth_grad_norm" in r for r in records)  # the depth probe ran on bf16 states
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["param_dtype"] == "bfloat16" and config["train_resolved"]["param_dtype"] == "bfloat16"
    assert "param_dtype_note" not in config["train_resolved"]
    saved = _header_dtypes(out / "model.safetensors")
    assert set(saved.values()) == {BF16}  # the trained dtype, exactly what the run trained
    latest = json.loads((out / "train_state" / "latest.json").read_text())
    state = read_tensors(out / "train_state" / latest["tensors"])  # the step-2 checkpoint's AdamW state
    optim = {k: v for k, v in state.items() if k.startswith("optim/") and k.rsplit("/", 1)[1] in ("exp_avg", "exp_avg_sq")}
    assert optim and all(v.dtype == state[f"model/{k[len('optim/'):].rsplit('/', 1)[0]}"].dtype == torch.bfloat16
                         for k, v in optim.items())
    model = load(out)  # probes get a float32 model: the exact upcast of the bf16 weights
    weights = read_tensors(out / "model.safetensors")
    params = dict(model.named_parameters())
    assert all(params[k].dtype == torch.float32 and torch.equal(params[k], v.float()) for k, v in weights.items())
    tokens = sample_windows(data_dir, n_tokens=64, seq_len=16)[:2]
    lens = logit_lens(model, tokens)
    skip = ablate(model, tokens, mode="skip")
    assert len(lens) == SMALL["n_layer"] + 1 and lens.select_dtypes("number").notna().all().all()
    assert len(skip) >= SMALL["n_layer"] and skip["delta_ce"].map(math.isfinite).all()


def test_interrupted_bf16_run_resumes_bit_identical(data_dir, tmp_path, monkeypatch):
    model_cfg = ModelConfig(arch="attnres", **SMALL)
    recipe = TrainConfig(tokens=8 * 2 * 16, param_dtype="bfloat16", **{**TINY, "checkpoint_every": 3})
    real = train_loop.train_step

    def interrupted(run, step, probe):
        if step == 5:  # after the step-3 checkpoint, before the run ends
            raise KeyboardInterrupt
        return real(run, step, probe)

    killed = tmp_path / "killed"
    monkeypatch.setattr(train_loop, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_cell(model_cfg, recipe, data_dir, killed)
    monkeypatch.setattr(train_loop, "train_step", real)
    assert not (killed / "eval.json").exists()
    with monkeypatch.context() as patch:  # the bf16 state never resumes into float32 weights ("auto" elsewhere)
        patch.setattr(precision, "bf16_weights_supported", lambda device: False)
        with pytest.raises(CheckpointError, match="holds bfloat16 weights, but this run's param_dtype='bfloat16' "
                                                  "trains float32 on cpu"):
            train_cell(model_cfg, recipe, data_dir, killed)
    resumed = train_cell(model_cfg, recipe, data_dir, killed)
    reference = train_cell(model_cfg, recipe, data_dir, tmp_path / "reference")
    assert resumed["resumed_from"] == 3
    a, b = read_tensors(killed / "model.safetensors"), read_tensors(tmp_path / "reference" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == reference["val_loss"] and resumed["train_loss"] == reference["train_loss"]


# -- the profile, a device without bf16, the CLI ---------------------------------------------------
def test_profile_on_cpu_keeps_float32_and_says_so(data_dir, tmp_path, caplog):
    cfg, train, _ = profiles.apply("depthbench", ModelConfig(arch="attnres", **SMALL), TrainConfig(**TINY), steps=2)
    assert train.param_dtype == "auto"
    with caplog.at_level(logging.WARNING, logger="depthtools.train.loop"):
        train_cell(cfg, train, data_dir, tmp_path / "cell")
    config = json.loads((tmp_path / "cell" / "config.json").read_text())
    assert config["train"]["param_dtype"] == "auto" and config["train_resolved"]["param_dtype"] == "float32"
    lines = [n for n in config["train_resolved"]["profile_notes"] if "bf16 weights" in n]
    assert len(lines) == 1 and "on CPU" in lines[0] and "keeps float32 weights and AdamW state" in lines[0]
    assert caplog.text.count(lines[0]) == 1  # printed once
    assert set(_header_dtypes(tmp_path / "cell" / "model.safetensors").values()) == {"F32"}
    # the line on other devices (depthtools.train.loop.profile_notes passes the resolved dtype)
    assert "bf16 weights and AdamW state as DepthBench" in profiles.weights_note(
        "depthbench", "cuda", "bfloat16", True, "bfloat16")
    assert "has no bf16" in profiles.weights_note("depthbench", "cuda", "float32", False, "float32")


def test_bfloat16_without_bf16_device_trains_float32_with_one_line(data_dir, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(precision, "bf16_weights_supported", lambda device: False)
    with caplog.at_level(logging.WARNING, logger="depthtools.train.loop"):
        summary = train_cell(ModelConfig(arch="preln", **SMALL), TrainConfig(tokens=2 * 2 * 16, param_dtype="bfloat16",
                                                                             **TINY), data_dir, tmp_path / "cell")
    assert math.isfinite(summary["val_loss"])
    resolved = json.loads((tmp_path / "cell" / "config.json").read_text())["train_resolved"]
    assert resolved["param_dtype"] == "float32"
    note = resolved["param_dtype_note"]
    assert "has no bf16" in note and "float32 weights and AdamW state instead" in note and "\n" not in note
    assert caplog.text.count(note) == 1
    assert set(_header_dtypes(tmp_path / "cell" / "model.safetensors").values()) == {"F32"}


def test_default_recipe_and_cli_flag(data_dir, tmp_path):
    from cli.main import app

    base = ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--data", str(data_dir),
            "--tokens", str(2 * 2 * 16), "--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--threads", "1",
            "--device", "cpu"]
    result = CliRunner().invoke(app, base + ["--out", str(tmp_path / "default")])
    assert result.exit_code == 0, (result.output, result.exception)
    config = json.loads((tmp_path / "default" / "config.json").read_text())
    assert "param_dtype" not in config["train"] and "param_dtype" not in config["train_resolved"]  # as before
    assert set(_header_dtypes(tmp_path / "default" / "model.safetensors").values()) == {"F32"}
    result = CliRunner().invoke(app, base + ["--out", str(tmp_path / "bf16"), "--param-dtype", "bfloat16"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["train_resolved"]["param_dtype"] == "bfloat16"
    result = CliRunner().invoke(app, base + ["--out", str(tmp_path / "bad"), "--param-dtype", "half"])
    assert result.exit_code != 0 and "unknown param_dtype 'half'; valid: float32, bfloat16, auto" in result.output
    assert not (tmp_path / "bad" / "model.safetensors").exists()


def test_grid_spec_takes_param_dtype_and_the_profile_fills_auto():
    from depthtools.grid import grid_spec, plan_grid
    from depthtools.train.sweep import load_spec

    cells = plan_grid("preln", 60_000, vocab_size=256, layers=[2], n_heads=2, max_seq_len=32)
    spec = grid_spec(cells, "g", TrainConfig(param_dtype="bfloat16").to_dict())
    assert spec["train"]["param_dtype"] == "bfloat16" and load_spec(spec)["train"]["param_dtype"] == "bfloat16"
    with pytest.raises(DepthToolsError, match="unknown param_dtype 'int8'"):
        load_spec({**spec, "train": {**spec["train"], "param_dtype": "int8"}})
    named = {**spec, "train": {k: v for k, v in spec["train"].items() if k != "param_dtype"} | {"profile": "depthbench"}}
    assert load_spec(named)["train"]["param_dtype"] == "auto"  # filled in by the profile
    explicit = {**spec, "train": {**spec["train"], "profile": "depthbench"}}
    assert load_spec(explicit)["train"]["param_dtype"] == "bfloat16"  # an explicit choice wins
