"""Hostile and careless grid specs, names and option values (issue 35, items 1, 2, 3, 6, 7 and 11).

Every case is either a correct result or one line on stderr with exit code 2 (a one-line
DepthToolsError at library level), and nothing is created or changed outside what the command
owns: a name is one path component (`depthtools.fsutil.check_name`), a grid spec is checked in one
place before anything is created (`depthtools.grid.check_spec`), list-valued options parse in one
helper (`cli.main.parse_list`), and `data prepare` takes an unquoted glob's words after one --input.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.errors import DepthToolsError

from tiny_models import SMALL, TINY_CORPUS, one_thread  # noqa: F401 (autouse: one torch thread)

runner = CliRunner()


def refused(args: list, *words: str) -> str:
    """Run the CLI; assert exit 2 with one line on stderr holding every word; return that line."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


# -- item 1: a name is one path component ---------------------------------------------------------
GOOD_NAMES = ["preln_L2", "hc_L8_s1", "a", "shakespeare+sympy-bpe8k", "v1.2", "x" * 128, "9lives"]
BAD_NAMES = ["", ".", "..", "../x", "../../victim", "/abs/path", "a/b", "a\\b", ".hidden", "a..b", "x" * 129, "a b",
             "a\nb", "-rf", "_x", "~", "ä"]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_plain_names_pass(name):
    from depthtools.fsutil import check_name

    assert check_name(name, "cell name") == name


@pytest.mark.parametrize("name", BAD_NAMES + [5, None, ["a"]], ids=repr)
def test_names_that_are_not_one_path_component_are_refused(name):
    from depthtools.fsutil import check_name

    with pytest.raises(DepthToolsError, match="cell name") as exc:
        check_name(name, "cell name")
    assert "\n" not in str(exc.value).replace(repr(name), "")


@pytest.fixture(scope="module")
def base_spec(data_dir) -> dict:
    """A one-cell grid spec (preln, 1 block, 512 training tokens) on the session's tiny dataset."""
    from depthtools.grid import grid_spec, plan_grid

    cells = plan_grid(["preln"], budget=30_000, layers=[1], n_heads=2, ffn_multiple=8, tolerance=0.15, max_seq_len=32)
    train = {"tokens": 512, "batch_size": 8, "seq_len": 32, "eval_every": 0, "eval_tokens": 512, "threads": 1}
    return json.loads(json.dumps(grid_spec(cells, name="g", train=train, data={"dir": str(data_dir)})))


def _spec_file(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _finished_victim(directory: Path) -> dict:
    """A finished checkpoint outside the grid's root (weights, config and eval.json), and its files."""
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    ck.save(DepthModel(ModelConfig(arch="preln", **SMALL), seed=0), directory)
    (directory / "eval.json").write_text(json.dumps({"val_loss": 2.5, "step": 100}))
    return tree(directory)


@pytest.mark.parametrize("cell_name", ["../../victim", "../victim", "ABS", "", "sub/cell", ".hidden"])
def test_a_cell_name_cannot_train_outside_the_root_even_with_force(cell_name, base_spec, tmp_path):
    """The data-loss case: `grid train --force` with a cell named ../../victim overwrote a finished checkpoint."""
    victim = tmp_path / "victim"
    before = _finished_victim(victim)
    spec = copy.deepcopy(base_spec)
    spec["cells"][0]["name"] = str(victim) if cell_name == "ABS" else cell_name
    path, root = _spec_file(tmp_path, spec), tmp_path / "ck"  # ck/g/../../victim is the victim
    for command in (["grid", "train", path, "--root", root, "--force"], ["grid", "status", path, "--root", root]):
        refused(command, "cell name", "is not a valid name")
    assert tree(victim) == before
    assert not (tmp_path / "ck").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json", "victim"]


@pytest.mark.parametrize("grid_name", ["../../x", "/abs", "", "a/b", ".."])
def test_a_grid_name_cannot_leave_the_root(grid_name, base_spec, tmp_path):
    spec = {**copy.deepcopy(base_spec), "name": grid_name}
    path, root = _spec_file(tmp_path, spec), tmp_path / "ck" / "inner"
    refused(["grid", "train", path, "--root", root], "grid name", "is not a valid name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


def test_grid_plan_refuses_a_grid_name_that_is_a_path(tmp_path):
    for args in (["--preset", "tiny"], ["--arch", "preln", "--budget", "30k", "--layers", "1", "--n-heads", "2",
                                        "--ffn-multiple", "8", "--tolerance", "0.15"]):
        refused(["grid", "plan", *args, "--name", "../escape", "--out", tmp_path / "s.json"], "--name", "../escape")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["../escape", "/abs/escape", "a/b", ".hidden", ""])
@pytest.mark.parametrize("source", ["corpus", "input"])
def test_data_prepare_name_is_one_folder_under_out(name, source, tmp_path):
    out = tmp_path / "data" / "inner"
    args = (["--corpus", "text-dir", "--text-dir", TINY_CORPUS] if source == "corpus" else ["--input", TINY_CORPUS])
    refused(["data", "prepare", *args, "--out", out, "--name", tmp_path / "abs" if name.startswith("/") else name],
            "dataset name (--name)", "is not a valid name")
    assert not any(tmp_path.iterdir())


def test_import_hf_name_is_one_folder_under_the_checkpoint_root(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from test_interop import hf_llama

    hf_llama(tmp_path / "hf", layers=1)
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ck" / "inner"))
    for name in ("../../escaped", str(tmp_path / "abs"), "a/b"):
        refused(["import-hf", tmp_path / "hf", "--name", name], "checkpoint name (--name)", "is not a valid name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_analysis_table_names_use_the_same_rule(tmp_path):
    import pandas as pd

    from depthtools.analysis import save_table

    for name in ("../x", "", "a/b", ".x"):
        with pytest.raises(DepthToolsError, match="table name"):
            save_table(pd.DataFrame({"a": [1]}), tmp_path, name, {})
    assert not any(tmp_path.iterdir())


# -- items 2, 3 and 6: the grid spec's schema, in one place ----------------------------------------
def _cell(spec: dict) -> dict:
    return spec["cells"][0]


def _set(path: str, value):
    """A mutation that sets spec[path] (dotted; a leading 'cell.' means the first cell, 'model.' its model)."""
    def mutate(spec):
        keys = path.split(".")
        target = spec
        if keys[0] == "cell":
            target, keys = _cell(spec), keys[1:]
        elif keys[0] == "model":
            target, keys = _cell(spec)["model"], keys[1:]
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


def _drop(path: str):
    def mutate(spec):
        keys = path.split(".")
        target = _cell(spec) if keys[0] == "cell" else _cell(spec)["model"] if keys[0] == "model" else spec
        del target[keys[-1]]
    return mutate


def _duplicate(case: bool = False):
    def mutate(spec):
        twin = copy.deepcopy(_cell(spec))
        if case:
            twin["name"] = twin["name"].upper()
        spec["cells"].append(twin)
    return mutate


def _rename_with(field: str, value, name: str):
    def mutate(spec):
        _cell(spec)[field] = value
        _cell(spec)["name"] = name
    return mutate


# (id, mutation of the valid one-cell spec, words of the one line); every one was accepted (trained
# something else than asked, reported a cell `skipped` that never trained) or raised a traceback before.
BAD_SPECS = [
    # item 2: a cell's model against the cell
    ("model {}", _set("cell.model", {}), ["model lacks", "n_layer", "default shape"]),
    ("model without n_layer", _drop("model.n_layer"), ["model lacks ['n_layer']"]),
    ("name L8, cell and model L1", _set("cell.name", "preln_L8"), ["the name states n_layer=8", "n_layer=1", "preln_L1"]),
    ("name+cell L8, model L1", _rename_with("n_layer", 8, "preln_L8"), ["the cell says n_layer=8", "its model has n_layer=1"]),
    ("name hc, model preln", _set("cell.name", "hc_L1"), ["the name states arch=hc", "arch=preln"]),
    ("name alias sandwich, model preln", _set("cell.name", "sandwich_L1"), ["the name states arch=periln"]),
    ("name _s3, seed 0", _set("cell.name", "preln_L1_s3"), ["the name states seed=3", "seed=0"]),
    ("cell arch hc, model preln", _set("cell.arch", "hc"), ["the cell says arch='hc'", "arch='preln'"]),
    ("cell d_model", _set("cell.d_model", 999), ["the cell says d_model=999"]),
    ("cell d_ff", _set("cell.d_ff", 8), ["the cell says d_ff=8"]),
    ("cell params_total", _set("cell.params_total", 1_000_000_000), ["params_total=1,000,000,000", "token budgets"]),
    ("cell arch unknown", _set("cell.arch", "transformerx"), ["unknown architecture 'transformerx'"]),
    # item 3: duplicate cell names
    ("duplicate cell", _duplicate(), ["cell name 'preln_L1' appears twice", "cells[0] and cells[1]"]),
    ("duplicate up to case", _duplicate(case=True), ["appears twice", "differ only in case"]),
    # item 6: types, required and unknown keys, named as keys
    ("data 5", _set("data", 5), ["'data' must be a JSON object or null", "int 5"]),
    ("data string", _set("data", "default"), ["'data' must be a JSON object or null"]),
    ("train string", _set("train", "preln"), ["'train' must be a JSON object or null", "'preln'"]),
    ("plan list", _set("plan", [1]), ["'plan' must be a JSON object"]),
    ("cells object", _set("cells", {}), ["'cells' must be a JSON list"]),
    ("cells empty", _set("cells", []), ["has no cells"]),
    ("no cells", lambda s: s.pop("cells"), ["has no 'cells' list"]),
    ("unknown top key", _set("celss", []), ["unknown key(s) ['celss']"]),
    ("name 5", _set("name", 5), ["'name' must be a string, not int 5"]),
    ("cell a string", _set("cells", ["preln_L1"]), ["cells[0] must be a JSON object, not str"]),
    ("cell unknown field", _set("cell.preln", 1), ["unknown field(s) ['preln']"]),
    ("cell missing n_layer", _drop("cell.n_layer"), ["missing field(s) ['n_layer']"]),
    ("cell n_layer string", _set("cell.n_layer", "1"), ["n_layer must be an integer, not str"]),
    ("cell n_layer bool", _set("cell.n_layer", True), ["n_layer must be an integer, not bool"]),
    ("cell seed -1", _rename_with("seed", -1, "preln_L1"), ["seed must be >= 0"]),
    ("cell model string", _set("cell.model", "preln"), ["model must be a JSON object, not str"]),
    ("model unknown field", _set("model.n_layers", 2), ["unknown ModelConfig field(s) ['n_layers']"]),
    ("model n_layer bool", _set("model.n_layer", True), ["ModelConfig.n_layer must be an integer, not bool"]),
    ("model tie string", _set("model.tie_embeddings", "no"), ["ModelConfig.tie_embeddings must be true or false"]),
    ("model options 5", _set("model.options", 5), ["ModelConfig.options must be a JSON object"]),
    ("model n_kv_heads string", _set("model.n_kv_heads", "2"), ["ModelConfig.n_kv_heads must be an integer or null"]),
    ("train lr string", _set("train.lr", "abc"), ["TrainConfig.lr must be a number"]),
    ("train keep_train_state string", _set("train.keep_train_state", "no"), ["keep_train_state must be true or false"]),
    ("train tokens bool", _set("train.tokens", True), ["TrainConfig.tokens must be an integer or null, not bool"]),
    ("train seed string", _set("train.seed", "0"), ["TrainConfig.seed must be an integer"]),
    ("train lr_overrides 5", _set("train.lr_overrides", 5), ["lr_overrides must be a JSON object"]),
    ("train lr_overrides value", _set("train.lr_overrides", {"preln": "x"}), ["lr_overrides['preln'] must be a number"]),
    ("train threads string", _set("train.threads", "2"), ["TrainConfig.threads must be an integer or null"]),
    ("train unknown field", _set("train.lrr", 1e-3), ["unknown TrainConfig field(s) ['lrr']"]),
    ("data unknown key", _set("data", {"copus": "default"}), ["unknown key(s) ['copus']", "corpus"]),
    ("data dir plus tokenizer", _set("data", {"dir": "x", "tokenizer": "byte"}), ["unknown key(s) ['tokenizer'] with 'dir'"]),
    ("data dir 5", _set("data", {"dir": 5}), ["'dir' must be a string"]),
    ("data corpus 5", _set("data", {"corpus": 5}), ["'corpus' must be a string or a JSON list"]),
    ("data input numbers", _set("data", {"input": [5]}), ["'input' must list strings"]),
    ("data val_fraction string", _set("data", {"corpus": "default", "val_fraction": "0.1"}), ["'val_fraction' must be a number"]),
    ("data name a path", _set("data", {"corpus": "default", "name": "../../x"}), ["'name' (the dataset folder) '../../x' is not a valid name"]),
]


@pytest.mark.parametrize("mutate,words", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_a_malformed_grid_spec_is_one_line_before_anything_is_created(mutate, words, base_spec, tmp_path):
    spec = copy.deepcopy(base_spec)
    mutate(spec)
    path, root = _spec_file(tmp_path, spec), tmp_path / "ck"
    refused(["grid", "train", path, "--root", root, "--data-root", tmp_path / "data"], *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]
    refused(["grid", "status", path, "--root", root], *words)


@pytest.mark.parametrize("mutate,words", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_in_memory_specs_and_single_cells_get_the_same_checks(mutate, words, base_spec, tmp_path):
    """A spec dict from a notebook goes through the same check as a file (load_spec, train_grid), and
    so does one cell as a launcher runs it (run_cell), wherever the mutation reaches that cell."""
    from depthtools.train import train_grid
    from depthtools.train.sweep import load_spec, run_cell

    spec = copy.deepcopy(base_spec)
    mutate(spec)
    with pytest.raises(DepthToolsError) as exc:
        load_spec(spec)
    assert all(w in str(exc.value) for w in words), (words, str(exc.value))
    with pytest.raises(DepthToolsError):
        train_grid(spec, root=tmp_path / "ck", data_root=tmp_path / "data")

    def one_cell(s):
        cells = s.get("cells")
        cell = cells[0] if isinstance(cells, list) and cells else None
        return {"grid": s.get("name", "grid"), "cell": cell, "train": s.get("train"), "data": s.get("data")}

    if one_cell(spec) != one_cell(base_spec) and one_cell(spec)["cell"] is not None:
        with pytest.raises(DepthToolsError):
            run_cell(one_cell(spec), tmp_path / "ck", data_root=tmp_path / "data")
    assert not any(tmp_path.iterdir())


def test_run_cell_refuses_a_grid_name_that_is_a_path(base_spec, tmp_path):
    from depthtools.train.sweep import run_cell

    with pytest.raises(DepthToolsError, match="grid name '../../x' is not a valid name"):
        run_cell({"grid": "../../x", "cell": base_spec["cells"][0], "train": base_spec["train"],
                  "data": base_spec["data"]}, tmp_path / "ck")
    assert not any(tmp_path.iterdir())


GOOD_LABELS = ["wide_L1", "hc4_L1", "baseline", "preln-run.2"]


@pytest.mark.parametrize("label", GOOD_LABELS)
def test_names_that_state_nothing_false_are_kept_as_labels(label, base_spec):
    from depthtools.train.sweep import load_spec

    spec = copy.deepcopy(base_spec)
    spec["cells"][0]["name"] = label
    assert load_spec(spec)["cells"][0].name == label


def test_a_spec_without_name_or_seed_reads_as_before(base_spec):
    from depthtools.train.sweep import load_spec

    spec = copy.deepcopy(base_spec)
    del spec["name"], spec["cells"][0]["seed"]
    loaded = load_spec(spec)
    assert loaded["name"] == "grid" and loaded["cells"][0].seed == 0


def test_duplicate_cells_were_skipped_silently_and_are_now_refused_before_training(base_spec, tmp_path):
    spec = copy.deepcopy(base_spec)
    spec["cells"].append(copy.deepcopy(spec["cells"][0]))
    path = _spec_file(tmp_path, spec)
    refused(["grid", "train", path, "--root", tmp_path / "ck", "--json"], "'preln_L1' appears twice")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("kwargs,words", [
    ({"arch": ["preln", "preln"], "layers": [1]}, "name one twice"),
    ({"arch": [], "layers": [1]}, "no architecture"),
    ({"arch": "preln", "layers": [1, 1]}, "name one depth twice"),
    ({"arch": "preln", "layers": [1.5]}, "layers must be positive integers"),
    ({"arch": "preln", "layers": [True]}, "layers must be positive integers"),
    ({"arch": "preln", "aspect_ratios": [float("nan")]}, "positive finite"),
    ({"arch": "preln", "aspect_ratios": [float("inf")]}, "positive finite"),
    ({"arch": "preln", "layers": [100_000_000]}, "even the narrowest allowed width"),
])
def test_the_planner_refuses_duplicate_or_unusable_axes(kwargs, words):
    from depthtools.grid import plan_grid

    with pytest.raises(DepthToolsError, match=words):
        plan_grid(budget=30_000, n_heads=2, ffn_multiple=8, tolerance=0.15, max_seq_len=32, **kwargs)


# -- item 7: list-valued options --------------------------------------------------------------------
PLAN = ["grid", "plan", "--budget", "30k", "--n-heads", "2", "--ffn-multiple", "8", "--tolerance", "0.15"]
BAD_OPTIONS = [
    (["causal", "--ckpt", "x", "--cuts", "abc"], ["--cuts 'abc'", "'abc' is not an integer"]),
    (["causal", "--ckpt", "x", "--cuts", "8,1.5"], ["--cuts '8,1.5'", "'1.5' is not an integer"]),
    (["causal", "--ckpt", "x", "--cuts", ","], ["--cuts ','", "names no value"]),
    (["causal", "--ckpt", "x", "--cuts", ""], ["--cuts ''", "names no value"]),
    ([*PLAN, "--layers", "abc"], ["--layers 'abc'", "not an integer"]),
    ([*PLAN, "--layers", "1.5"], ["--layers '1.5'", "not an integer"]),
    ([*PLAN, "--layers", ","], ["--layers ','", "names no value"]),
    ([*PLAN, "--layers", "1,1"], ["name one depth twice"]),
    ([*PLAN, "--layers", "0"], ["layers must be positive integers"]),
    ([*PLAN, "--layers", "100000000"], ["preln_L100000000", "even the narrowest allowed width"]),
    ([*PLAN, "--aspect-ratios", "nan"], ["--aspect-ratios 'nan'", "not a finite number"]),
    ([*PLAN, "--aspect-ratios", "inf"], ["--aspect-ratios 'inf'", "not a finite number"]),
    ([*PLAN, "--aspect-ratios", "x,2"], ["--aspect-ratios 'x,2'", "'x' is not a finite number"]),
    ([*PLAN, "--aspect-ratios", "-3"], ["aspect ratios must be positive finite numbers"]),
    ([*PLAN, "--layers", "1", "--arch", ","], ["--arch ','", "names no value"]),
    ([*PLAN, "--layers", "1", "--arch", "preln,preln"], ["name one twice"]),
    ([*PLAN, "--layers", "1", "--seeds", "a"], ["--seeds 'a'", "not an integer"]),
    ([*PLAN, "--layers", "1", "--seeds", ","], ["--seeds ','", "names no value"]),
    ([*PLAN, "--layers", "1", "--seeds", "0,0"], ["seeds must be distinct"]),
    (["grid", "plan", "--preset", "tiny", "--seeds", "x"], ["--seeds 'x'", "not an integer"]),
    (["grid", "train", "--preset", "tiny", "--cells", ","], ["--cells ','", "names no value"]),
    (["grid", "train", "--preset", "tiny", "--cells", ""], ["--cells ''", "names no value"]),
    (["analyze", "--ckpt", "x", "--only", ","], ["--only ','", "names no value"]),
    (["tasks", "eval", "--ckpt", "x", "--tasks", ","], ["--tasks ','", "names no value"]),
]


@pytest.mark.parametrize("args,words", BAD_OPTIONS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_OPTIONS])
def test_list_valued_options_parse_with_one_line_errors(args, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(args, *words)
    assert not any(tmp_path.iterdir())


def test_parse_list_keeps_values_and_skips_empty_items():
    from cli.main import parse_list

    assert parse_list(None, "int", "--x", "1,2") is None
    assert parse_list(" 16, 24,,32 ,", "int", "--x", "1,2") == [16, 24, 32]
    assert parse_list("76,42.7", "float", "--x", "1,2") == [76.0, 42.7]
    assert parse_list("preln, hc", "str", "--x", "a,b") == ["preln", "hc"]


# -- item 11: an unquoted glob after --input -----------------------------------------------------------
def _inputs(folder: Path) -> list[Path]:
    folder.mkdir()
    paths = []
    for i in range(3):
        path = folder / f"part{i}.jsonl"
        path.write_text("".join(json.dumps({"text": f"document {i}.{j}: " + "some words here " * 8}) + "\n"
                                for j in range(6)))
        paths.append(path)
    return paths


def test_an_unquoted_glob_after_one_input_reads_every_file(tmp_path):
    """What the shell passes for `--input shards/*.jsonl`: one --input, then the other files as bare words."""
    from depthtools.data import read_meta

    paths = _inputs(tmp_path / "shards")
    out = tmp_path / "data"
    result = runner.invoke(app, ["data", "prepare", "--input", *map(str, paths), "--out", str(out), "--name", "mine",
                                 "--val-fraction", "0.2"])
    assert result.exit_code == 0, (result.output, result.exception)
    meta = read_meta(out / "mine")
    quoted = runner.invoke(app, ["data", "prepare", "--input", str(tmp_path / "shards" / "*.jsonl"), "--out", str(out),
                                 "--name", "mine", "--val-fraction", "0.2"])
    assert quoted.exit_code == 0 and "already prepared with these settings" in quoted.stderr, quoted.output
    one_file = runner.invoke(app, ["data", "prepare", "--input", str(paths[0]), "--out", str(out), "--name", "one",
                                   "--val-fraction", "0.2"])
    assert one_file.exit_code == 0, one_file.output
    assert meta["splits"]["train"]["tokens"] > 2 * read_meta(out / "one")["splits"]["train"]["tokens"], meta


def test_a_stray_word_says_how_to_quote_a_glob(tmp_path):
    paths = _inputs(tmp_path / "shards")
    result = runner.invoke(app, ["data", "prepare", "--name", "x", *map(str, paths), "--out", str(tmp_path / "data")])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())  # typer draws usage errors in a wrapped box
    assert "unexpected extra argument" in text and "quote it (--input 'shards/*.parquet')" in text, text
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("args,expected", [
    (["--input", "a", "b", "--name", "x"], ["--input", "a", "--input", "b", "--name", "x"]),
    (["-i", "a", "b", "-i", "c", "d"], ["-i", "a", "--input", "b", "-i", "c", "--input", "d"]),
    (["--input=a", "b"], ["--input=a", "--input", "b"]),
    (["--name", "x", "y"], ["--name", "x", "y"]),
    (["--input", "a", "--force", "b"], ["--input", "a", "--force", "b"]),
    (["--input", "a", "--", "b"], ["--input", "a", "--", "b"]),
])
def test_spread_inputs(args, expected):
    from cli.data_cmd import spread_inputs

    assert spread_inputs(args) == expected
