"""Bad inputs that used to give a wrong result with exit code 0 (issue 22, "fix first").

Each must now be refused with one line on stderr and exit code 2 (the CLI's DepthToolsError
contract), or, where a library call is the natural level, with a one-line DepthToolsError.
Real files and real small models throughout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

from tiny_models import SMALL, TINY_CORPUS, prepare_tiny

ROOT = Path(__file__).resolve().parents[1]

runner = CliRunner()


def refused(args: list[str], *words: str) -> str:
    """Run the CLI; assert exit 2 with one line on stderr holding every word; return that line."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def save_model(directory: Path, **changes) -> Path:
    return ck.save(DepthModel(ModelConfig(arch="preln", **{**SMALL, **changes}), seed=0), directory)


# -- checkpoint names match whole path components --------------------------------------------------
def test_names_with_a_slash_match_whole_path_components(tmp_path, monkeypatch):
    save_model(tmp_path / "xgridC" / "preln_L2")
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path))
    with pytest.raises(ck.CheckpointError, match="unknown checkpoint 'gridC/preln_L2'"):
        ck.resolve("gridC/preln_L2")
    refused(["info", "--ckpt", "gridC/preln_L2"], "unknown checkpoint", "gridC/preln_L2")
    save_model(tmp_path / "gridC" / "preln_L2")  # the real one: found, and not ambiguous with xgridC
    assert ck.resolve("gridC/preln_L2") == tmp_path / "gridC" / "preln_L2"
    assert ck.resolve("xgridC/preln_L2/") == tmp_path / "xgridC" / "preln_L2"


# -- a head count of 0 is an error, not "use the default" ------------------------------------------
@pytest.mark.parametrize("args", [
    ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "0"],
    ["train", "--arch", "preln", "--layers", "2", "--budget", "100k", "--n-heads", "0", "--preset-recipe", "tiny"],
    ["grid", "plan", "--arch", "preln", "--budget", "100k", "--layers", "2,4", "--n-heads", "0"],
])
def test_zero_heads_is_refused(args, data_dir, tmp_path):
    if args[0] == "train":
        args = [*args, "--data", data_dir, "--out", tmp_path / "cell", "--tokens", "64"]
    refused(args, "--n-heads", "0")
    assert not (tmp_path / "cell").exists()


# -- checkpoints that cannot be a trained model: wrong dtype, non-finite weights or config ---------
def _break_weights(directory: Path, how: str) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = ck.read_tensors(directory / ck.WEIGHTS)
    if how == "int64":
        tensors = {k: v.to(torch.int64) for k, v in tensors.items()}
    elif how == "nan":
        tensors = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}
    elif how == "one_inf":
        tensors["blocks.1.attn.w_q.weight"][3, 5] = float("inf")
    save_file(tensors, str(directory / ck.WEIGHTS))


def _break_config(directory: Path, field: str, value) -> None:
    path = directory / ck.CONFIG
    config = json.loads(path.read_text())
    config["model"][field] = value
    path.write_text(json.dumps(config))  # json writes NaN / Infinity, and reads them back


BROKEN_CHECKPOINTS = [  # (how the checkpoint is broken, words the one line must hold)
    (("weights", "int64"), ["dtype int64", "floating-point", "blocks."]),
    (("weights", "nan"), ["non-finite", "tensor "]),
    (("weights", "one_inf"), ["blocks.1.attn.w_q.weight", "1 non-finite"]),
    (("config", "rope_theta", 0), ["rope_theta", "positive finite", "0"]),
    (("config", "rope_theta", float("nan")), ["rope_theta", "nan"]),
    (("config", "rope_theta", -10.0), ["rope_theta", "-10.0"]),
    (("config", "norm_eps", float("nan")), ["norm_eps", "nan"]),
    (("config", "init_std", float("inf")), ["init_std", "inf"]),
    (("config", "norm_eps", 0.0), ["norm_eps"]),
]


@pytest.mark.parametrize("how,words", BROKEN_CHECKPOINTS, ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else None)
def test_broken_checkpoints_are_refused(how, words, data_dir, tmp_path):
    cell = save_model(tmp_path / "g" / "preln_L2")
    if how[0] == "weights":
        _break_weights(cell, how[1])
    else:
        _break_config(cell, how[1], how[2])
    with pytest.raises(ck.CheckpointError) as err:
        ck.load(cell)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)
    refused(["lens", "--ckpt", cell, "--data", data_dir, "--n-tokens", "64", "--seq-len", "16", "--no-save"], *words)
    assert not (cell / "analysis").exists()


@pytest.mark.parametrize("field,value", [("rope_theta", 0.0), ("rope_theta", float("nan")), ("rope_theta", float("inf")),
                                         ("norm_eps", -1e-5), ("init_std", float("nan")), ("rope_theta", "1e4")])
def test_model_config_refuses_non_finite_or_non_positive_scalars(field, value):
    with pytest.raises(DepthToolsError, match=field):
        ModelConfig(**{**SMALL, field: value})


# -- datasets are never overwritten without --force, and evaluation checks the data it reads -------
FAST = dict(batch_size=8, seq_len=32, lr=1e-2, eval_tokens=512, log_every=2, eval_every=0,
            depth_stats_every=0, checkpoint_every=0, threads=1)
EVAL = ["--n-tokens", "64", "--seq-len", "16"]


def _prepare_args(out: Path, *extra) -> list:
    return ["data", "prepare", "--corpus", "text-dir", "--text-dir", TINY_CORPUS, "--out", out, "--val-fraction", "0.3", *extra]


def test_prepare_refuses_to_overwrite_a_dataset_with_other_settings(tmp_path):
    from depthtools.data import read_meta

    data = prepare_tiny(tmp_path / "data")
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    refused(_prepare_args(tmp_path / "data", "--seed", "7"), str(data), "other settings", "seed: 0 -> 7", "--force")
    refused(_prepare_args(tmp_path / "data", "--val-fraction", "0.5"), "val_fraction: 0.3 -> 0.5", "--force")
    with pytest.raises(DepthToolsError, match=r"other settings \(seed: 0 -> 7\).*force=True"):
        prepare_tiny(tmp_path / "data", seed=7)
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before  # untouched
    same = runner.invoke(app, [str(a) for a in _prepare_args(tmp_path / "data")])  # same settings: a no-op
    assert same.exit_code == 0 and {p.name: p.read_bytes() for p in data.iterdir()} == before
    forced = runner.invoke(app, [str(a) for a in _prepare_args(tmp_path / "data", "--seed", "7", "--force")])
    assert forced.exit_code == 0, forced.output
    assert read_meta(data)["settings"]["seed"] == 7
    mine = tmp_path / "data" / "mine"  # a folder that is not a dataset is not replaced either
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    refused(_prepare_args(tmp_path / "data", "--name", "mine"), str(mine), "no readable dataset", "--force")
    assert (mine / "notes.txt").read_text() == "keep me" and not (mine / "meta.json").exists()


@pytest.fixture(scope="module")
def trained_cell(tmp_path_factory):
    """A real trained cell on its own dataset (which the tests then prepare again)."""
    from depthtools.config import TrainConfig
    from depthtools.train import train_cell

    base = tmp_path_factory.mktemp("fingerprint")
    data = prepare_tiny(base / "data")
    cell = base / "g" / "preln_L2"
    train_cell(ModelConfig(arch="preln", **SMALL), TrainConfig(tokens=4 * 8 * 32, **FAST), data, cell)
    return base, data, cell


EVALUATIONS = [  # every command that evaluates a checkpoint on data: (args, with --ckpt or --grid)
    ["lens", "--ckpt", "{cell}", *EVAL, "--no-save"],
    ["ablate", "--ckpt", "{cell}", *EVAL, "--no-save"],
    ["causal", "--ckpt", "{cell}", *EVAL, "--no-save"],
    ["similarity", "--ckpt", "{cell}", *EVAL, "--no-save"],
    ["analyze", "--grid", "{grid}", *EVAL, "--only", "lens_logit"],
]


def _fill(args: list, cell: Path) -> list:
    return [str(a).format(cell=cell, grid=cell.parent) for a in args]


def test_evaluation_refuses_a_data_folder_prepared_again_since_training(trained_cell, data_dir):
    from depthtools.analysis.suite import eval_tokens

    base, data, cell = trained_cell
    ok = runner.invoke(app, _fill(EVALUATIONS[0], cell))
    assert ok.exit_code == 0, ok.output
    prepare_tiny(base / "data", seed=7, force=True)
    for args in EVALUATIONS:
        refused(_fill(args, cell), str(data), "preln_L2", "data fingerprint", "--data")
    refused([*_fill(EVALUATIONS[0], cell), "--data", data], "data fingerprint")  # naming the same folder
    with pytest.raises(DepthToolsError, match="no longer holds the data"):
        eval_tokens(cell, None, 64, 16)
    assert not (cell / "analysis" / "lens_logit.parquet").exists()
    other = runner.invoke(app, [*_fill(EVALUATIONS[0], cell), "--data", data_dir])  # other data, same tokenizer
    assert other.exit_code == 0, other.output


def test_tokenizer_mismatch_is_refused_in_both_directions(tmp_path, data_dir):
    from depthtools.data import read_meta

    bpe = prepare_tiny(tmp_path / "data", tokenizer="bpe4k")
    cells = {}
    for name, data in (("bpe", bpe), ("byte", data_dir)):
        meta = read_meta(data)
        vocab = max(256, int(meta["tokenizer"]["vocab_size"]))
        model = DepthModel(ModelConfig(arch="preln", **{**SMALL, "vocab_size": vocab}), seed=0)
        cells[name] = ck.save(model, tmp_path / name / "preln_L2", extra={  # the records the trainer writes
            "tokenizer": meta["tokenizer"], "data": {"path": str(data), "data_fingerprint": meta["data_fingerprint"],
                                                     "settings": meta["settings"]}})
    bpe_name = read_meta(bpe)["tokenizer"]["name"]  # "bpe<actual vocabulary>"
    cases = [  # (checkpoint, --data, words)
        (cells["bpe"], data_dir, [f"trained with tokenizer '{bpe_name}'", "'byte'", str(data_dir), "--tokenizer bpe4k"]),
        (cells["byte"], bpe, ["trained with tokenizer 'byte'", f"'{bpe_name}'", str(bpe), "--tokenizer byte"]),
    ]
    for cell, data, words in cases:
        for args in EVALUATIONS[:3]:
            refused([*_fill(args, cell), "--data", data], *words)
        refused(["analyze", "--grid", cell.parent, *EVAL, "--only", "lens_logit", "--data", data], *words)
    for name, data in (("bpe", bpe), ("byte", data_dir)):  # the matching data still works
        ok = runner.invoke(app, [*_fill(EVALUATIONS[0], cells[name]), "--data", data])
        assert ok.exit_code == 0, ok.output


# -- an unreadable latest.json never silently restarts a run from step 0 ----------------------------
class _Stop(Exception):
    pass


def _interrupted(data_dir: Path, out: Path, recipe, at: int):
    """Train until the progress event of step `at`, then stop (as a kill would), leaving train_state/."""
    from depthtools.train import train_cell

    def progress(event):
        if event["event"] == "step" and event["step"] >= at:
            raise _Stop

    with pytest.raises(_Stop):
        train_cell(ModelConfig(arch="preln", **SMALL), recipe, data_dir, out, progress=progress)


def test_unreadable_latest_json_falls_back_to_the_newest_intact_step(data_dir, tmp_path, caplog):
    import torch

    from depthtools.config import TrainConfig
    from depthtools.train import train_cell
    from depthtools.train.state import latest_step

    recipe = TrainConfig(tokens=12 * 8 * 32, **{**FAST, "checkpoint_every": 4})
    out = tmp_path / "cell"
    _interrupted(data_dir, out, recipe, at=6)
    state = out / "train_state"
    assert latest_step(state) == 4
    (state / "latest.json").write_text('{"step": 4, "tens')  # cut short / garbled
    starts = []
    with caplog.at_level("WARNING", logger="depthtools.train.state"):
        summary = train_cell(ModelConfig(arch="preln", **SMALL), recipe, data_dir, out,
                             progress=lambda e: starts.append(e["step"]) if e["event"] == "start" else None)
    assert summary["resumed_from"] == 4 and starts == [4]
    assert any("latest.json" in r.message and "step 4" in r.message for r in caplog.records), caplog.text
    reference = train_cell(ModelConfig(arch="preln", **SMALL), recipe, data_dir, tmp_path / "reference")
    a = ck.read_tensors(out / ck.WEIGHTS)
    b = ck.read_tensors(tmp_path / "reference" / ck.WEIGHTS)
    assert all(torch.equal(a[k], b[k]) for k in b) and summary["val_loss"] == reference["val_loss"]


def test_unreadable_latest_json_without_an_intact_step_is_refused(data_dir, tmp_path):
    from depthtools.config import TrainConfig

    recipe = TrainConfig(tokens=12 * 8 * 32, **{**FAST, "checkpoint_every": 4})
    out = tmp_path / "cell"
    _interrupted(data_dir, out, recipe, at=6)
    state = out / "train_state"
    (state / "latest.json").write_bytes(b"\xff\xfe not json")
    (state / "step_00000004.json").write_text("{")
    before = sorted(p.name for p in state.iterdir())
    refused(["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--data", data_dir,
             "--out", out, "--tokens", 12 * 8 * 32, "--batch-size", "8", "--seq-len", "32", "--lr", "1e-2",
             "--checkpoint-every", "4", "--threads", "1"],
            str(state), "latest.json", "no intact", "--force")
    assert sorted(p.name for p in state.iterdir()) == before and (out / "metrics.jsonl").read_text().strip()  # kept


# -- divergence: a loss far above its running minimum stops the run; resume with a lower LR ---------
def _train_args(data_dir: Path, out: Path, lr: float, *extra, steps: int = 24) -> list:
    return ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--data", data_dir,
            "--out", out, "--tokens", steps * 8 * 32, "--batch-size", "8", "--seq-len", "32", "--lr", lr,
            "--log-every", "2", "--checkpoint-every", "2", "--eval-every", "0", "--threads", "1", *extra]


def test_divergence_stops_the_run_and_a_lower_lr_resumes_it(data_dir, tmp_path, caplog):
    import math

    import torch

    from depthtools.train.state import latest_step

    out = tmp_path / "cell"
    # lr 1 (100x the usual): the loss falls to 5.1 (step 2), then, still finite, climbs to ~14 nats by
    # step 8. Checkpoint 6 holds the weights that produced that climb (steps 7-8 ran on them), so it is
    # dropped: the last good checkpoint is step 4 (its weights gave the window 5-6, within the margin).
    refused(_train_args(data_dir, out, 1.0, steps=60), "diverged", "step 8", "divergence_margin=5",
            "last good checkpoint", "(step 4)", "--resume-with-changed-lr")
    beat = json.loads((out / "heartbeat.json").read_text())
    assert beat["state"] == "failed" and "diverged" in beat["error"]
    assert beat["diverged"]["reason"] == "loss_above_min" and beat["diverged"]["step"] == 8
    assert beat["diverged"]["last_good_step"] == 4 and beat["diverged"]["train_loss"] > beat["diverged"]["min_train_loss"] + 5
    assert latest_step(out / "train_state") == 4 and not (out / "model.safetensors").exists()
    assert sorted(p.name for p in (out / "train_state").iterdir()) == [
        "latest.json", "step_00000004.json", "step_00000004.safetensors"]
    saved = ck.read_tensors(out / "train_state" / "step_00000004.safetensors")
    assert all(torch.isfinite(v).all() for v in saved.values())
    # a lower LR changes the run fingerprint: refused unless asked for, and then recorded
    refused(_train_args(data_dir, out, 0.01, steps=60), "another learning rate", "--resume-with-changed-lr", "--force")
    refused(_train_args(data_dir, out, 0.01, "--seed", "1", "--resume-with-changed-lr", steps=60),
            "more than the learning rate changed")
    result = runner.invoke(app, [str(a) for a in _train_args(data_dir, out, 0.01, "--resume-with-changed-lr", "--json",
                                                             steps=60)])
    assert result.exit_code == 0, (result.output, result.stderr)
    assert "resuming from step 4 with peak lr 0.01 instead of 1.0" in caplog.text  # said on the way (a log line)
    summary = json.loads(result.stdout)
    assert summary["resumed_from"] == 4 and math.isfinite(summary["val_loss"]) and summary["train_loss"] < 4.5
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["lr"] == 0.01
    change = config["train_resolved"]["lr_changes"]
    assert len(change) == 1 and change[0]["step"] == 4 and change[0]["from_lr"] == 1.0 and change[0]["to_lr"] == 0.01
    records = ck.read_metrics(out)
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)) and steps[-1] == 60
    assert [(r["step"], r["lr_changed_from"]) for r in records if "lr_changed_from" in r] == [(6, 1.0)]
    assert not (out / "heartbeat.json").exists()


def test_a_recovering_loss_spike_does_not_stop_a_run(data_dir, tmp_path):
    """lr 0.3 (30x the usual) spikes the tiny model's loss by ~3.5 nats after warmup, then recovers."""
    result = runner.invoke(app, [str(a) for a in _train_args(data_dir, tmp_path / "cell", 0.3, "--json", steps=60)])
    assert result.exit_code == 0, (result.output, result.stderr)
    losses = [r["train_loss"] for r in ck.read_metrics(tmp_path / "cell")]
    assert max(losses[i] - min(losses[:i]) for i in range(1, len(losses))) > 2  # there was a spike
    assert losses[-1] < 4


def test_divergence_margin_is_validated():
    from depthtools.config import TrainConfig

    assert TrainConfig().divergence_margin == 5.0 and TrainConfig(divergence_margin=0).divergence_margin == 0
    for bad in (-1.0, float("nan"), float("inf"), "3"):
        with pytest.raises(DepthToolsError, match="divergence_margin"):
            TrainConfig(divergence_margin=bad)


# -- user strings that reach rich are shown literally, never read as markup ------------------------
def test_brackets_in_names_and_config_fields_are_not_rich_markup(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path))
    refused(["info", "--ckpt", "x[/y]"], "unknown checkpoint", "x[/y]")  # was a MarkupError traceback
    cell = save_model(tmp_path / "g" / "x[red]y")
    config = json.loads((cell / "config.json").read_text())
    config["model"]["arch"] = "[/evil]"
    (cell / "config.json").write_text(json.dumps(config))
    shown = runner.invoke(app, ["info", "--ckpt", "x[red]y"], terminal_width=200)
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert "x[red]y" in shown.stdout and "[/evil]" in shown.stdout  # not swallowed as a style tag


def test_a_one_document_dataset_trains_and_says_it_has_no_val_loss(tmp_path):
    """One document goes to train, none to val: the cell is written and the summary line says why it has
    no val loss (it used to exit 1 formatting None after writing the cell)."""
    from depthtools.data import prepare

    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "only.txt").write_text((ROOT / "README.md").read_text()[:20000])
    data = prepare("text-dir", out_dir=tmp_path / "data", text_dir=tmp_path / "txt", val_fraction=0.3)
    result = runner.invoke(app, ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2",
                                 "--data", str(data), "--tokens", "2048", "--batch-size", "4", "--seq-len", "16",
                                 "--out", str(tmp_path / "cell")])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "no validation split: no val loss" in result.stdout
    assert (tmp_path / "cell" / "eval.json").is_file()


# -- CLI values that are not numbers a run can use ---------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--lr", "nan"], ["learning rates must be positive finite"]),
    (["--lr", "inf"], ["learning rates must be positive finite"]),
    (["--tokens-per-param", "nan", "--tokens", None], ["tokens_per_param must be a positive finite"]),
    (["--budget", "1e400", "--d-model", None], ["not a usable size"]),
    (["--seq-len", "4096", "--tokens", "2048"], ["exceeds the whole token budget"]),
])
def test_unusable_numbers_are_one_line_errors(tmp_path, data_dir, args, words):
    base = {"--arch": "preln", "--layers": "2", "--d-model": "32", "--n-heads": "2", "--data": str(data_dir),
            "--tokens": "4096", "--batch-size": "2", "--seq-len": "16", "--out": str(tmp_path / "cell")}
    for flag, value in zip(args[::2], args[1::2]):
        if value is None:
            base.pop(flag)
        else:
            base[flag] = value
    refused(["train", *[x for kv in base.items() for x in kv]], *words)
    assert not (tmp_path / "cell").exists()  # refused before the cell folder, its lock or a heartbeat exist


def test_styled_table_cells_keep_their_style_and_user_text_stays_literal():
    """table() escapes strings but renders a rich Text as styled: `tasks sample` showed its answers as
    '[bold green]2[/]' (escaped twice over) once every cell was escaped."""
    import io

    from rich.console import Console
    from rich.text import Text

    from cli.main import table

    out = Console(file=io.StringIO(), width=120, record=True, color_system="truecolor")
    out.print(table("t[/x]", ["a[b]", "state"], [["x[red]y", Text("pending", style="dim")]]))
    shown = out.export_text(clear=False)
    assert "t[/x]" in shown and "a[b]" in shown and "x[red]y" in shown and "[dim]" not in shown
    assert "\x1b[2mpending" in out.export_text(styles=True)  # dim, not the literal tag
    sample = runner.invoke(app, ["tasks", "sample", "--task", "chase", "--k", "2", "--n", "2"], terminal_width=200)
    assert sample.exit_code == 0, sample.output
    assert "[bold green]" not in sample.stdout and "\\" not in sample.stdout and "q?" in sample.stdout
