"""An imported model of every family through the documented CLI path (docs/pretrained.md): import-hf, data
prepare with the model's own tokenizer, lens, ablate --mode skip, the whole analyze suite and a report
(issue 38's "done when"). Numbers are checked against transformers elsewhere (test_families, test_family_probes);
here every step must succeed and write what it says."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
from test_families import FAMILY_OF_CASE, VOCAB, build_hf
from typer.testing import CliRunner

from cli.main import app

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")
runner = CliRunner()
WORDS = [f"w{i}" for i in range(VOCAB - 1)]  # a word-level tokenizer that fits the tiny vocabulary
TEXT = " ".join(WORDS[(7 * i + i // 5) % len(WORDS)] for i in range(3000))
ONE_PER_FAMILY = {}
for case, family in FAMILY_OF_CASE.items():
    ONE_PER_FAMILY.setdefault(family, case)


def tokenizer_json(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])  # the document separator data prepare writes
    path.write_text(tok.to_str(), encoding="utf-8")


def ok(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


@pytest.mark.parametrize("family", sorted(ONE_PER_FAMILY))
def test_import_then_every_probe_and_a_report(family, tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = tmp_path / "hf"
    build_hf(ONE_PER_FAMILY[family], folder)
    tokenizer_json(folder / "tokenizer.json")
    ok(["import-hf", str(folder), "--name", "m"])
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    ok(["data", "prepare", "--input", str(tmp_path / "text.txt"), "--tokenizer", str(folder / "tokenizer.json"),
        "--out", str(tmp_path / "data"), "--name", "d"])
    data = ["--data", str(tmp_path / "data" / "d"), "--n-tokens", "48", "--seq-len", "12"]
    ok(["lens", "--ckpt", "m", *data])
    ok(["ablate", "--ckpt", "m", "--mode", "skip", *data])
    ok(["analyze", "--ckpt", "m", *data, "--batch-size", "4"])
    analysis = tmp_path / "ckpts" / "m" / "analysis"
    for table in ("lens_logit", "ablate_skip", "causal", "similarity"):
        assert (analysis / f"{table}.parquet").is_file(), table
    out = tmp_path / "report.html"
    ok(["report", "--ckpt", "m", "-o", str(out)])
    html = out.read_text(encoding="utf-8")
    assert "training has not finished" not in html and "<html" in html.lower()


def test_a_gguf_file_through_the_same_path(tmp_path, monkeypatch):
    """A Q8_0 GGUF file (gguf's own writer; tokenizer from its metadata): import-hf, then lens, the analyze suite
    and a report on text tokenized with that tokenizer (--text)."""
    pytest.importorskip("gguf")
    from test_gguf import build, write_gguf

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    write_gguf(build("qwen2"), "qwen2", tmp_path / "m.gguf", qtype="Q8_0")
    ok(["import-hf", str(tmp_path / "m.gguf"), "--name", "g"])
    (tmp_path / "text.txt").write_text("the then in an the " * 400, encoding="utf-8")
    text = ["--text", str(tmp_path / "text.txt"), "--n-tokens", "48", "--seq-len", "12"]
    ok(["lens", "--ckpt", "g", *text])
    ok(["analyze", "--ckpt", "g", *text, "--batch-size", "4"])
    out = tmp_path / "report.html"
    ok(["report", "--ckpt", "g", "-o", str(out)])
    assert out.stat().st_size > 0
