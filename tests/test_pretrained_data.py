"""The natural path for an imported model's evaluation data: `import-hf` a folder, `data prepare --input
text.txt --tokenizer <folder>/tokenizer.json`, then a probe with `--data` -- accepted because the import and
data preparation fingerprint one tokenizer the same way (they used to disagree: raw file bytes vs the
canonical JSON). One long text file (one document) still gets a validation split (cut by tokens).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")
runner = CliRunner()
TEXT = " ".join(f"the {w} went to the market and the {w} came back with {n} apples." for n in range(60)
                for w in ("cat", "dog", "bird"))


def hf_folder(root: Path) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer.json (saved pretty-printed, as HF saves it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, max_position_embeddings=64, eos_token_id=0)
    folder = root / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    return folder


def test_import_then_data_prepare_then_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = hf_folder(tmp_path)
    result = runner.invoke(app, ["import-hf", str(folder), "--name", "tiny"])
    assert result.exit_code == 0, result.output
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    result = runner.invoke(app, ["data", "prepare", "--input", str(tmp_path / "text.txt"), "--tokenizer",
                                 str(folder / "tokenizer.json"), "--out", str(tmp_path / "data"), "--name", "d"])
    assert result.exit_code == 0, result.output
    meta = json.loads((tmp_path / "data" / "d" / "meta.json").read_text())
    config = json.loads((tmp_path / "ckpts" / "tiny" / "config.json").read_text())
    assert meta["tokenizer"]["fingerprint"] == config["tokenizer"]["fingerprint"]  # one tokenizer, one fingerprint
    assert meta["splits"]["val"]["tokens"] > 0  # one document, still a validation split
    assert meta["splits"]["train"]["tokens"] > meta["splits"]["val"]["tokens"]
    result = runner.invoke(app, ["lens", "--ckpt", "tiny", "--data", str(tmp_path / "data" / "d"), "--n-tokens", "64",
                                 "--seq-len", "32", "--no-save"])
    assert result.exit_code == 0, result.output


def test_old_import_records_are_accepted(tmp_path, monkeypatch):
    """A checkpoint imported before the shared fingerprint (raw sha256 recorded) is checked by its carried file."""
    import hashlib

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = hf_folder(tmp_path)
    assert runner.invoke(app, ["import-hf", str(folder), "--name", "tiny"]).exit_code == 0
    config_file = tmp_path / "ckpts" / "tiny" / "config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer"]["fingerprint"] = hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    config_file.write_text(json.dumps(config))
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    assert runner.invoke(app, ["data", "prepare", "--input", str(tmp_path / "text.txt"), "--tokenizer",
                               str(folder / "tokenizer.json"), "--out", str(tmp_path / "data"),
                               "--name", "d"]).exit_code == 0
    result = runner.invoke(app, ["lens", "--ckpt", "tiny", "--data", str(tmp_path / "data" / "d"), "--n-tokens", "64",
                                 "--seq-len", "32", "--no-save"])
    assert result.exit_code == 0, result.output


def test_text_option_tokenizes_with_the_models_tokenizer(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from depthtools.analysis.suite import probe_tokens
    from depthtools.checkpoint import load

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = hf_folder(tmp_path)
    assert runner.invoke(app, ["import-hf", str(folder), "--name", "tiny"]).exit_code == 0
    text = tmp_path / "eval.txt"
    text.write_text(TEXT, encoding="utf-8")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected = [0] + tok.encode(TEXT, add_special_tokens=False).ids  # separator first, as data prepare writes it
    windows = probe_tokens(load(tmp_path / "ckpts" / "tiny"), text, n_tokens=96, seq_len=32, seed=1)
    assert windows.shape == (3, 33)
    joined = " ".join(map(str, expected))
    for row in windows.tolist():  # each window is a contiguous run of the file's tokens
        assert " ".join(map(str, row)) in joined
    for command in (["lens"], ["ablate", "--mode", "skip"], ["causal"], ["similarity"], ["contrib"]):
        result = runner.invoke(app, [*command, "--ckpt", "tiny", "--text", str(text), "--n-tokens", "64",
                                     "--seq-len", "32"])
        assert result.exit_code == 0, (command, result.output)
    record = json.loads((tmp_path / "ckpts" / "tiny" / "analysis" / "lens_logit.json").read_text())
    assert record["source"] == {"text": str(text.resolve())}  # where the tokens came from, beside the settings
    both = runner.invoke(app, ["lens", "--ckpt", "tiny", "--text", str(text), "--data", str(tmp_path)])
    assert both.exit_code == 2 and "not both" in both.output
    tuned = runner.invoke(app, ["lens", "--ckpt", "tiny", "--text", str(text), "--tuned", "--seq-len", "32",
                                "--n-tokens", "64"])
    assert tuned.exit_code == 2 and "pass --data DIR" in tuned.output, tuned.output


def test_a_replaced_tokenizer_file_is_refused_wherever_it_is_read(tmp_path, monkeypatch):
    """issue 43 item 8: a checkpoint whose tokenizer.json is not the one its config.json records (a forced
    re-import that failed half-way used to leave one) is refused by --text, export-hf and load_tokenizer, in one
    line; the same tokenizer saved in another layout (compact JSON) is still accepted."""
    from tokenizers import Tokenizer

    from depthtools.data import load_tokenizer
    from depthtools.errors import DepthToolsError
    from depthtools.interop.tokenizer import byte_tokenizer

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = hf_folder(tmp_path)
    assert runner.invoke(app, ["import-hf", str(folder), "--name", "tiny"]).exit_code == 0
    ckpt = tmp_path / "ckpts" / "tiny"
    text = tmp_path / "eval.txt"
    text.write_text(TEXT, encoding="utf-8")
    lens = ["lens", "--ckpt", "tiny", "--text", str(text), "--n-tokens", "64", "--seq-len", "32"]

    (ckpt / "tokenizer.json").write_text(Tokenizer.from_file(str(folder / "tokenizer.json")).to_str())  # compact
    assert runner.invoke(app, lens).exit_code == 0
    assert load_tokenizer(ckpt).vocab_size == 300

    byte_tokenizer().save(str(ckpt / "tokenizer.json"))  # another model's tokenizer (it fits the vocabulary)
    for command in (lens, ["export-hf", "--ckpt", "tiny", str(tmp_path / "out")]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, (command, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "tokenizer.json is not the tokenizer" in lines[0] and "recorded" in lines[0], lines
    assert not (tmp_path / "out").exists()
    with pytest.raises(DepthToolsError, match="is not the tokenizer"):
        load_tokenizer(ckpt)
    result = runner.invoke(app, ["data", "prepare", "--input", str(text), "--tokenizer", str(ckpt / "tokenizer.json"),
                                 "--name", "t", "--out", str(tmp_path / "data")])
    assert result.exit_code == 2 and "is not the tokenizer" in result.stderr, result.output
