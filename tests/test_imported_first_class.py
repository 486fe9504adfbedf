"""Issue 48: imported models as first-class citizens.

- refusals that need no weights come before the weights are read (each test breaks model.safetensors first:
  a refusal that loaded the model would be a weights error instead);
- one document-separator rule for `import-hf` and `data prepare` (the model's declared eos/bos special token);
- a GGUF import without a tokenizer records its vocabulary's fingerprint and refuses data of another one;
- a split shorter than the default evaluation set is said and capped.
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


def bpe(specials: list[str], vocab_size: int = 300):
    """A byte-level BPE trained on TEXT whose first ids are `specials` (special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    return tok


def llama_folder(root: Path, tok=None, name: str = "hf", **config) -> Path:
    """A tiny random Llama folder (3 layers, d=32) with `tok` as its tokenizer.json."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, max_position_embeddings=64,
                                   **{"eos_token_id": 0, **config})
    folder = root / name
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    if tok is not None:
        (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    return folder


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def prepare(text: Path, tokenizer, out: Path, name: str, *extra: str):
    result = invoke("data", "prepare", "--input", text, "--tokenizer", tokenizer, "--out", out, "--name", name, *extra)
    assert result.exit_code == 0, result.output
    return out / name


def break_weights(ckpt: Path) -> None:
    """A weights file that cannot be loaded: whatever reads it fails with a weights error."""
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")


@pytest.fixture
def imported(tmp_path, monkeypatch):
    """An imported tiny Llama (with its tokenizer) whose weights file is broken, and a text file."""
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = llama_folder(tmp_path, bpe(["<|endoftext|>"]))
    assert invoke("import-hf", folder, "--name", "tiny").exit_code == 0
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    return tmp_path, folder, tmp_path / "ckpts" / "tiny"


def refused_before_load(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    out = result.output
    assert "safetensors" not in out and "weights" not in out, out  # not the broken weights file's error
    for word in words:
        assert word in out, out


def test_data_folder_that_does_not_exist_is_refused_before_load(imported):
    root, _, ckpt = imported
    break_weights(ckpt)
    refused_before_load(invoke("lens", "--ckpt", "tiny", "--data", root / "nowhere", "--no-save"),
                        "is not a directory")


def test_text_without_a_tokenizer_is_refused_before_load(imported):
    root, _, ckpt = imported
    (ckpt / "tokenizer.json").unlink()
    break_weights(ckpt)
    refused_before_load(invoke("lens", "--ckpt", "tiny", "--text", root / "text.txt", "--no-save"),
                        "carries no tokenizer.json")


def test_data_of_another_tokenizer_is_refused_before_load(imported):
    root, _, ckpt = imported
    data = prepare(root / "text.txt", "byte", root / "data", "bytes")
    break_weights(ckpt)
    for command in (["lens"], ["analyze", "--only", "lens_logit"], ["causal", "--protocol", "depthbench"]):
        refused_before_load(invoke(*command, "--ckpt", "tiny", "--data", data, "--no-save")
                            if command[0] != "analyze" else invoke(*command, "--ckpt", "tiny", "--data", data),
                            "tokenized with")


def test_split_shorter_than_one_window_is_refused_before_load(imported):
    root, folder, ckpt = imported
    (root / "short.txt").write_text(TEXT[:2000], encoding="utf-8")
    data = prepare(root / "short.txt", folder / "tokenizer.json", root / "data", "d")
    break_weights(ckpt)
    held = json.loads((data / "meta.json").read_text())["splits"]["val"]["tokens"]
    assert held < 64  # one long text file: a short validation split
    refused_before_load(invoke("causal", "--protocol", "depthbench", "--ckpt", "tiny", "--data", data, "--no-save"),
                        "fewer than one window")
    refused_before_load(invoke("lens", "--ckpt", "tiny", "--data", data, "--seq-len", "64", "--no-save"),
                        "fewer than one window")


def test_tuned_lens_on_text_is_refused_before_load(imported):
    root, _, ckpt = imported
    break_weights(ckpt)
    refused_before_load(invoke("lens", "--tuned", "--ckpt", "tiny", "--text", root / "text.txt", "--no-save"),
                        "train split")


def test_seq_len_beyond_the_context_is_refused_before_load(imported):
    root, _, ckpt = imported
    break_weights(ckpt)
    refused_before_load(invoke("lens", "--ckpt", "tiny", "--text", root / "text.txt", "--seq-len", "65", "--no-save"),
                        "exceeds the context 64")
