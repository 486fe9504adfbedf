"""`depthtools import`: what PATH is (OLMo-core run/step folder, HF folder, .gguf), which step of a run, the
tokenizer rule, and the refusals before anything is written (issue 44, items 1, 2 and 5).

The OLMo-core folders here are written as OLMo-core lays them out: `stepN/config.json` and
`stepN/model_and_optim/` saved by torch.distributed.checkpoint, a run killed while saving leaving a step
without its `.metadata` (DCP writes it last) or an unrenamed `stepN-tmp/`. Importing whole models end to end
is tests/test_olmo_core_e2e.py (it needs the config mapping).
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from cli.main import app
from depthtools.errors import CheckpointError, DepthToolsError
from depthtools.interop.formats import detect_format, import_path
from depthtools.interop.olmo_import import choose_step, find_tokenizer, target_folder

runner = CliRunner()
CONFIG = {"model": {"_CLASS_": "olmo_core.nn.transformer.config.TransformerConfig", "d_model": 8},
          "dataset": {"tokenizer": {"identifier": "allenai/gpt-neox-olmo-dolma-v1_5", "vocab_size": 50280,
                                    "eos_token_id": 50279, "pad_token_id": 1}}}


def write_step(run: Path, step: int, config: dict | None = None, metadata: bool = True, name: str | None = None) -> Path:
    """One OLMo-core step folder: config.json and a DCP model_and_optim/ (without .metadata if the save was killed)."""
    folder = run / (name or f"step{step}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"embeddings.weight": torch.full((4, 2), float(step))}, "optim": {"step": step}},
                 checkpoint_id=str(folder / "model_and_optim"))
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    if not metadata:
        (folder / "model_and_optim" / ".metadata").unlink()
    return folder


@pytest.fixture
def run(tmp_path) -> Path:
    """A run killed while saving step 300: steps 100 and 200 complete, 300 without .metadata, 400 still -tmp."""
    folder = tmp_path / "run"
    for step in (100, 200):
        write_step(folder, step)
    write_step(folder, 300, metadata=False)
    write_step(folder, 400, name="step400-tmp")
    return folder


def test_detect_format(tmp_path, run):
    assert detect_format(run) == "olmo-core-run"
    assert detect_format(run / "step200") == "olmo-core-step"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert detect_format(hf) == "huggingface"
    assert detect_format(tmp_path / "m.GGUF") == "gguf"  # the gguf importer refuses a missing file itself
    (tmp_path / "empty").mkdir()
    with pytest.raises(DepthToolsError, match="no config.json.*no stepN/ folders.*no model_and_optim/"):
        detect_format(tmp_path / "empty")
    with pytest.raises(DepthToolsError, match="does not exist"):
        detect_format(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DepthToolsError, match="is a file but not a .gguf file"):
        detect_format(tmp_path / "notes.txt")


def test_latest_complete_step_is_chosen_and_the_passed_over_ones_are_named(run):
    step, notes = choose_step(run)
    assert step.number == 200 and step.path == run / "step200"
    said = " ".join(notes)
    assert "passed over step300" in said and ".metadata missing" in said
    assert "passed over step400-tmp" in said and "imported step200" in said


def test_an_explicit_step_must_exist_and_be_complete(run):
    assert choose_step(run, 100)[0].path == run / "step100"
    with pytest.raises(CheckpointError, match=r"step300: model_and_optim/\.metadata missing: the run was stopped"):
        choose_step(run, 300)
    with pytest.raises(DepthToolsError, match=r"no step999/ folder \(steps: 100, 200, 300\)"):
        choose_step(run, 999)
    with pytest.raises(DepthToolsError, match="does not match the step folder"):
        choose_step(run / "step200", 100)
    with pytest.raises(CheckpointError, match="stepN-tmp folder is a save OLMo-core had not finished"):
        choose_step(run / "step400-tmp")


def test_a_run_with_no_complete_step_is_refused(tmp_path):
    write_step(tmp_path / "r", 5, metadata=False)
    (tmp_path / "r" / "step6").mkdir()
    with pytest.raises(CheckpointError, match=r"no complete step to import \(step5: .*; step6: config.json and"):
        choose_step(tmp_path / "r")


def test_tokenizer_rule(tmp_path, run):
    step = run / "step200"
    carried, why = find_tokenizer(CONFIG, step, None)
    assert carried is None and why.startswith("no tokenizer was carried") and "allenai/gpt-neox-olmo-dolma-v1_5" in why
    (run / "tok.json").write_text("{}")
    local = {**CONFIG, "dataset": {"tokenizer": {"identifier": "tok.json"}}}
    assert find_tokenizer(local, step, None) == (run / "tok.json", None)  # relative to the run folder
    given = tmp_path / "given"
    given.mkdir()
    (given / "tokenizer.json").write_text("{}")
    assert find_tokenizer(CONFIG, step, given) == (given / "tokenizer.json", None)
    with pytest.raises(DepthToolsError, match="--tokenizer .*no such tokenizer file"):
        find_tokenizer(CONFIG, step, tmp_path / "missing.json")
    assert "names none" in find_tokenizer({"model": {}}, step, None)[1]


def test_target_folder_refusals(tmp_path):
    with pytest.raises(DepthToolsError, match="--name"):
        target_folder(None, None, False)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(DepthToolsError, match="holds files but no checkpoint"):
        target_folder(None, busy, True)  # --force never replaces a folder that is not a checkpoint
    hf = tmp_path / "hf"  # a Hugging Face folder: a config.json, but no depthtools checkpoint
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(DepthToolsError, match="holds files but no checkpoint"):
        target_folder(None, hf, True)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text('{"model": {"arch": "preln"}}')
    with pytest.raises(DepthToolsError, match="pass --force"):
        target_folder(None, tmp_path / "ck", False)
    assert target_folder(None, tmp_path / "ck", True) == tmp_path / "ck"


def _refused(args: list, needle: str, out: Path) -> None:
    result = runner.invoke(app, ["import", *map(str, args), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert needle in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


def test_cli_refusals_write_nothing(tmp_path, run):
    _refused([run, "--step", "300"], "model_and_optim/.metadata missing", tmp_path / "o1")
    _refused([run / "step300"], "model_and_optim/.metadata missing", tmp_path / "o2")
    _refused([run, "--step", "7"], "has no step7/ folder", tmp_path / "o3")
    _refused([tmp_path / "empty_or_missing"], "does not exist", tmp_path / "o4")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    _refused([hf, "--step", "3"], "--step applies to OLMo-core checkpoints only", tmp_path / "o5")
    shard = run / "step200" / "model_and_optim" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    _refused([run], "__0_0.distcp is truncated", tmp_path / "o6")
    (run / "step200" / "model_and_optim" / "__0_0.distcp").unlink()
    _refused([run, "--step", "200"], "__0_0.distcp is missing", tmp_path / "o7")
    assert runner.invoke(app, ["import-hf", "--help"]).exit_code == 0


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_cli_refuses_a_metadata_pickle_that_would_run_code(tmp_path, run):
    marker = tmp_path / "pwned"
    (run / "step200" / "model_and_optim" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _refused([run], "builtins.exec", tmp_path / "out")
    assert not marker.exists()


def test_import_path_refuses_olmo_only_options_for_other_formats(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(DepthToolsError, match="--tokenizer applies to OLMo-core checkpoints only"):
        import_path(tmp_path / "hf", out=tmp_path / "o", tokenizer=tmp_path / "t.json")


def test_sweep_refusals_write_nothing(tmp_path, run):
    other = tmp_path / "run2"
    write_step(other, 50)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    result = runner.invoke(app, ["import", str(run), str(other)])
    assert result.exit_code == 2 and "give a grid name (--grid)" in result.output
    _refused([run, hf, "--grid", "g"], "only OLMo-core runs are imported as a grid", tmp_path / "g1")
    _refused([run, other, "--name", "x"], "give --grid NAME", tmp_path / "g2")
    _refused([run, other, "--grid", "../up"], "grid name (--grid)", tmp_path / "g3")
    broken = tmp_path / "run3"
    write_step(broken, 9)
    (broken / "step9" / "model_and_optim" / "__0_0.distcp").unlink()
    _refused([broken, run, "--grid", "g"], "__0_0.distcp is missing", tmp_path / "g4")  # checked before any cell
