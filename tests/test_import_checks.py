"""`import-hf` checks what it imports with the rules `checkpoint.load` applies (issue 35, item 4).

Each hostile Hugging Face folder is a real one (a transformers LlamaForCausalLM saved with
safetensors) with one thing broken: int64 or NaN/inf weights, a corrupt or oversized tokenizer, a
special id outside the vocabulary. Each must be one line naming the file, exit code 2, and nothing
written: no checkpoint folder, and a forced re-import over a good checkpoint leaves it byte for byte.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_interop import hf_llama
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.errors import DepthToolsError
from depthtools.interop import import_hf
from depthtools.interop.checks import validate_imported_weights, validate_tokenizer

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

runner = CliRunner()
WEIGHTS = "model.safetensors"


def _byte_tokenizer_file(directory: Path, extra: list[str] = ()) -> Path:
    """depthtools' byte tokenizer (ids 0..255) as tokenizer.json, with `extra` added tokens (ids 256...)."""
    from depthtools.interop.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    if extra:
        tok.add_tokens(list(extra))
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


@pytest.fixture(scope="module")
def good_hf(tmp_path_factory) -> Path:
    """A valid tiny Llama folder (vocab 256) with a tokenizer that fits it."""
    directory = tmp_path_factory.mktemp("hf") / "good"
    hf_llama(directory, layers=2)
    _byte_tokenizer_file(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_weights(directory: Path, edit) -> None:
    tensors = load_file(str(directory / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})


def _int64(t):
    t["model.layers.1.mlp.up_proj.weight"] = (t["model.layers.1.mlp.up_proj.weight"] * 100).to(torch.int64)


def _all_nan(t):
    for k in t:
        t[k] = torch.full_like(t[k], float("nan"))


def _one_inf(t):
    t["model.layers.0.self_attn.q_proj.weight"][2, 3] = float("inf")


def _bool(t):
    t["model.norm.weight"] = t["model.norm.weight"] > 0


def _garbage_tokenizer(d):
    (d / "tokenizer.json").write_bytes(b"\x00\xff not json at all")


def _truncated_tokenizer(d):
    raw = (d / "tokenizer.json").read_bytes()
    (d / "tokenizer.json").write_bytes(raw[: len(raw) // 2])


def _json_but_not_a_tokenizer(d):
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "Nonsense"}}))


def _oversized_tokenizer(d):
    _byte_tokenizer_file(d, extra=["<|extra_a|>", "<|extra_b|>"])  # ids 256, 257 > vocab 256


def _corrupt_tokenizer_config(d):
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast",')


def _garbage_sentencepiece(d):
    (d / "tokenizer.model").write_bytes(b"\x12\x34 this is not a sentencepiece model " * 10)


def _eos_outside_vocab(d):
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "eos_token_id": 300}))


def _oversized_vocab_json(d):
    (d / "vocab.json").write_text(json.dumps({"a": 0, "b": 999}))


HOSTILE = [  # (how the folder is broken, words the one line must hold)
    (("weights", _int64), [WEIGHTS, "model.layers.1.mlp.up_proj.weight", "dtype int64", "floating-point"]),
    (("weights", _bool), [WEIGHTS, "model.norm.weight", "dtype bool"]),
    (("weights", _all_nan), [WEIGHTS, "non-finite", "tensor "]),
    (("weights", _one_inf), [WEIGHTS, "model.layers.0.self_attn.q_proj.weight", "1 non-finite"]),
    (("files", _garbage_tokenizer), ["tokenizer.json", "not a valid tokenizer file"]),
    (("files", _truncated_tokenizer), ["tokenizer.json", "not a valid tokenizer file"]),
    (("files", _json_but_not_a_tokenizer), ["tokenizer.json", "not a valid tokenizer file"]),
    (("files", _oversized_tokenizer), ["tokenizer.json", "up to 257", "vocabulary", "256"]),
    (("files", _corrupt_tokenizer_config), ["tokenizer_config.json", "corrupt JSON"]),
    (("files", _garbage_sentencepiece), ["tokenizer.model", "not a valid sentencepiece model"]),
    (("files", _eos_outside_vocab), ["config.json", "eos_token_id=300", "256"]),
    (("files", _oversized_vocab_json), ["vocab.json", "up to 999"]),
]


def _name(value):
    return "-".join(getattr(v, "__name__", str(v)).strip("_") for v in value) if isinstance(value, tuple) else None


@pytest.mark.parametrize("how,words", HOSTILE, ids=_name)
def test_hostile_hf_folders_are_refused_in_one_line_and_nothing_is_written(how, words, good_hf, tmp_path, monkeypatch):
    source = _copy(good_hf, tmp_path / "hf")
    (_edit_weights(source, how[1]) if how[0] == "weights" else how[1](source))
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))

    with pytest.raises(DepthToolsError) as err:
        import_hf(source, name="broken")
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)
    assert not (tmp_path / "ckpts").exists()

    result = runner.invoke(app, ["import-hf", str(source), "--name", "broken"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    assert not (tmp_path / "ckpts").exists()

    # --force over a good checkpoint: refused the same way, and the good one is left byte for byte
    good = import_hf(good_hf, name="kept")["checkpoint"]
    before = {p.name: p.read_bytes() for p in Path(good).iterdir()}
    forced = runner.invoke(app, ["import-hf", str(source), "--name", "kept", "--force"])
    assert forced.exit_code == 2, forced.output
    assert {p.name: p.read_bytes() for p in Path(good).iterdir()} == before


def test_a_good_folder_still_imports_exactly(good_hf, tmp_path):
    """The positive control: same folder unbroken imports, its tokenizer carried, weights bit for bit."""
    summary = import_hf(good_hf, out=tmp_path / "ok")
    assert "tokenizer.json" in summary["tokenizer_files"]
    model = ck.load(tmp_path / "ok")
    hf = load_file(str(good_hf / WEIGHTS))
    assert torch.equal(model.state_dict()["blocks.1.mlp.w3.weight"], hf["model.layers.1.mlp.up_proj.weight"])


def test_a_sharded_checkpoint_names_the_shard_holding_the_bad_tensor(good_hf, tmp_path):
    source = _copy(good_hf, tmp_path / "hf")
    tensors = load_file(str(source / WEIGHTS))
    (source / WEIGHTS).unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    bad = second[0]
    tensors[bad] = tensors[bad].to(torch.int64)
    save_file({k: tensors[k] for k in first}, str(source / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in second}, str(source / "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in first},
                  **{k: "model-00002-of-00002.safetensors" for k in second}}
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(DepthToolsError, match=rf"model-00002-of-00002\.safetensors: tensor {bad} has dtype int64"):
        import_hf(source, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_checks_are_callable_on_their_own(tmp_path):
    """The small functions other importers (other model families) call."""
    validate_imported_weights({"w": torch.ones(2, 2)}, tmp_path / "x.safetensors")
    with pytest.raises(DepthToolsError, match="x.safetensors: tensor w has dtype int32"):
        validate_imported_weights({"w": torch.ones(2, 2, dtype=torch.int32)}, tmp_path / "x.safetensors")
    with pytest.raises(DepthToolsError, match="shard-3: tensor w has 1 non-finite"):
        validate_imported_weights({"w": torch.tensor([1.0, float("nan")])}, lambda name: "shard-3")
    _byte_tokenizer_file(tmp_path)
    validate_tokenizer(tmp_path, 256)
    with pytest.raises(DepthToolsError, match="up to 255"):
        validate_tokenizer(tmp_path, 200)


# -- issue 43 item 2: a forced re-import is all or nothing -------------------------------------------------------
def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_forced_reimport_that_fails_part_way_leaves_the_old_checkpoint_intact(good_hf, tmp_path, monkeypatch):
    """The disk fills up after the new tokenizer is written: the old checkpoint (weights, config, tokenizer) is
    left byte for byte, and no half-built folder stays behind."""
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    old = Path(import_hf(good_hf, name="kept")["checkpoint"])
    before = _snapshot(old)
    other = tmp_path / "other"
    hf_llama(other, layers=3, seed=1)
    _byte_tokenizer_file(other, extra=["<|new|>"])
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 257}))
    tensors = load_file(str(other / WEIGHTS))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[key] = torch.cat([tensors[key], tensors[key][:1]])
    save_file(tensors, str(other / WEIGHTS), metadata={"format": "pt"})

    real = ck.atomic_save_tensors
    seen: list[str] = []

    def full_disk(path, tensors, metadata=None):
        seen.extend(p.name for p in Path(path).parent.iterdir())  # the new tokenizer is already written
        real(path, dict(list(tensors.items())[:1]), metadata)  # a part of the weights lands ...
        raise OSError(errno.ENOSPC, "No space left on device", str(path))  # ... then the disk is full

    monkeypatch.setattr(ck, "atomic_save_tensors", full_disk)
    result = runner.invoke(app, ["import-hf", str(other), "--name", "kept", "--force"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "No space left on device" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "tokenizer.json" in seen
    assert _snapshot(old) == before
    assert sorted(p.name for p in old.parent.iterdir()) == ["kept"]  # no staging folder left

    monkeypatch.setattr(ck, "atomic_save_tensors", real)  # with room on the disk the same import replaces it
    assert runner.invoke(app, ["import-hf", str(other), "--name", "kept", "--force"]).exit_code == 0
    assert ck.load(old).config.n_layer == 3 and json.loads((old / "tokenizer.json").read_text()) != json.loads(
        before["tokenizer.json"])
    assert sorted(p.name for p in old.parent.iterdir()) == ["kept"]


def test_an_import_never_replaces_a_folder_of_other_files(good_hf, tmp_path):
    """An import swaps in a whole folder, so --out naming a folder of other files is refused, even with --force."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for force in ([], ["--force"]):
        result = runner.invoke(app, ["import-hf", str(good_hf), "--out", str(out), *force])
        assert result.exit_code == 2 and "holds no depthtools checkpoint" in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    source = _copy(good_hf, tmp_path / "hf")  # nor the Hugging Face folder itself (its config.json is not ours)
    before = _snapshot(source)
    result = runner.invoke(app, ["import-hf", str(source), "--out", str(source), "--force"])
    assert result.exit_code == 2 and "holds no depthtools checkpoint" in result.stderr, result.output
    assert _snapshot(source) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runner.invoke(app, ["import-hf", str(good_hf), "--out", str(empty)]).exit_code == 0
    assert (empty / "model.safetensors").is_file()


# -- issue 43 items 5, 11: the shard index ------------------------------------------------------------------------
def _sharded(good_hf: Path, folder: Path, outside: Path) -> dict[str, str]:
    """`good_hf` as a two-shard folder; the second shard also saved at `outside` (beside the folder)."""
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((good_hf / name).read_bytes())
    tensors = load_file(str(good_hf / WEIGHTS))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({k: tensors[k] for k in first}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in second}, str(folder / "model-00002-of-00002.safetensors"))
    save_file({k: tensors[k] for k in second}, str(outside))
    return {**{k: "model-00001-of-00002.safetensors" for k in first},
            **{k: "model-00002-of-00002.safetensors" for k in second}}


@pytest.mark.parametrize("how,needle", [
    ("parent", "outside the model folder: '../x.safetensors'"),
    ("absolute", "outside the model folder: '/"),
    ("list", "weight_map must be an object"),
    ("number", "weight_map must be an object"),
])
def test_a_shard_index_is_checked_before_any_shard_is_read(how, needle, good_hf, tmp_path):
    """An index naming a shard outside the folder is refused, as transformers refuses it (not read); a
    weight_map that is not an object of names is one line, not a traceback."""
    folder = tmp_path / "hf"
    weight_map = _sharded(good_hf, folder, tmp_path / "x.safetensors")
    if how == "parent":
        weight_map = {k: ("../x.safetensors" if v.startswith("model-00002") else v) for k, v in weight_map.items()}
    elif how == "absolute":
        weight_map = {k: (str(tmp_path / "x.safetensors") if v.startswith("model-00002") else v)
                      for k, v in weight_map.items()}
    elif how == "list":
        weight_map = sorted(weight_map.items())
    else:
        weight_map = {k: 2 for k in weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = runner.invoke(app, ["import-hf", str(folder), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "model.safetensors.index.json" in lines[0], result.stderr
    assert not (tmp_path / "ck").exists()


def test_a_swap_whose_second_rename_fails_puts_the_old_checkpoint_back(good_hf, tmp_path, monkeypatch):
    """fsutil.replace_dir moves the old folder aside, then the new one in: if that second rename fails, the old
    folder is renamed back, so the checkpoint is never missing."""
    import os

    from depthtools import fsutil

    old = Path(import_hf(good_hf, out=tmp_path / "ck")["checkpoint"])
    before = _snapshot(old)
    real, calls = os.replace, []

    def second_fails(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(dst))
        return real(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", second_fails)
    with pytest.raises(OSError):
        import_hf(good_hf, out=tmp_path / "ck", force=True)
    monkeypatch.setattr(fsutil.os, "replace", real)
    assert _snapshot(old) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
