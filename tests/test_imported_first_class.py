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


# -- one separator rule (items 2 and 3) ------------------------------------------------------------------------
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def gemma_tokenizer():
    """A Gemma-style tokenizer.json built locally: SentencePiece-like BPE ("▁" for spaces, byte fallback
    <0x00>..<0xFF>, unk fused), <pad> <eos> <bos> ... as special added tokens at ids 0.., and an ordinary
    vocabulary token "</s>" (as Gemma's id 212: text encodes to it, so it cannot separate documents)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=120, show_progress=False))
    head = json.loads(trained.to_str())
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for token in sorted(head["model"]["vocab"], key=head["model"]["vocab"].get):
        vocab.setdefault(token, len(vocab))
    vocab["</s>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in head["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_SPECIALS])
    return tok


def gemma3_folder(root: Path, n_layer: int = 3, name: str = "gemma") -> Path:
    """A tiny random Gemma-3 (text) folder as save_pretrained writes it, with the Gemma-style tokenizer and
    Gemma's tokenizer_config.json (eos <eos> id 1, bos <bos> id 2)."""
    torch.manual_seed(0)
    tok = gemma_tokenizer()
    cfg = transformers.Gemma3TextConfig(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=n_layer,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        max_position_embeddings=128, sliding_window=8, pad_token_id=0, eos_token_id=1,
                                        bos_token_id=2)
    folder = root / name
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}), encoding="utf-8")
    return folder


def test_gemma_tokenizer_is_accepted_by_data_prepare_with_its_eos(tmp_path):
    folder = gemma3_folder(tmp_path)
    assert gemma_tokenizer().token_to_id("</s>") is not None  # the ordinary token the old rule picked
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    data = prepare(tmp_path / "text.txt", folder / "tokenizer.json", tmp_path / "data", "g")
    meta = json.loads((data / "meta.json").read_text())
    assert (meta["tokenizer"]["sep_id"], meta["tokenizer"]["sep_token"]) == (1, "<eos>")


def test_without_declared_tokens_a_special_candidate_beats_an_ordinary_one(tmp_path):
    """A bare tokenizer.json (no config beside it): the special "<eos>" is chosen over the ordinary "</s>"."""
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_text(gemma_tokenizer().to_str(), encoding="utf-8")
    from depthtools.data.tokenizer import BPETokenizer

    tok = BPETokenizer.from_file(tmp_path / "bare" / "tokenizer.json")
    assert (tok.sep_token, tok.sep_id) == ("<eos>", 1)


@pytest.mark.parametrize("eos", [2, 0])
def test_import_and_data_prepare_choose_one_separator(tmp_path, monkeypatch, eos):
    """SmolLM2-like: <|endoftext|> id 0 and <|im_end|> id 2 are both special; the config declares eos. Both
    routes record the declared one, and --text and --data windows start with it."""
    from depthtools.analysis.suite import eval_tokens
    from depthtools.data import load_split

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = llama_folder(tmp_path, bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), eos_token_id=eos,
                          bos_token_id=1)
    assert invoke("import-hf", folder, "--name", "smol").exit_code == 0
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    data = prepare(tmp_path / "text.txt", folder / "tokenizer.json", tmp_path / "data", "s")
    record = json.loads((tmp_path / "ckpts" / "smol" / "config.json").read_text())["tokenizer"]
    meta = json.loads((data / "meta.json").read_text())["tokenizer"]
    assert record["sep_id"] == meta["sep_id"] == eos
    assert int(load_split(data, "train")[0]) == eos  # --data: every document starts with the separator
    windows = eval_tokens(tmp_path / "ckpts" / "smol", tmp_path / "text.txt", 10**6, 100, cap=True)  # from offset 0
    assert int(windows[0, 0]) == eos  # --text: the same separator first


# -- a GGUF import without a tokenizer knows its vocabulary (item 5) --------------------------------------------
def gguf_without_tokenizer(root: Path, tok) -> Path:
    """A llama GGUF (GGUFWriter) whose tokenizer metadata is `tok`'s vocabulary with llama.cpp's "deepseek-coder"
    pre-tokenizer: the import cannot rebuild it, so it carries no tokenizer.json."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get) + ["[PAD300]", "[PAD301]"]  # llama.cpp pads to the embedding rows
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    path = root / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, 32), (writer.add_block_count, 2),
                       (writer.add_feed_forward_length, 48), (writer.add_head_count, 4), (writer.add_head_count_kv, 4),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_key_length, 8), (writer.add_value_length, 8), (writer.add_rope_dimension_count, 8)):
        add(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-coder")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in json.loads(tok.to_str())["model"]["merges"]])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if module in ("self_attn.q_proj", "self_attn.k_proj"):  # llama.cpp's interleaved RoPE rows
                w = w.reshape(4, 2, w.shape[0] // 8, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            writer.add_tensor(f"blk.{i}.{names[module]}.{kind}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_import_without_tokenizer_refuses_data_of_another_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    tok = bpe(["<|endoftext|>"])
    path = gguf_without_tokenizer(tmp_path, tok)
    result = invoke("import-hf", path, "--name", "g")
    assert result.exit_code == 0 and "no tokenizer was carried" in result.output, result.output
    ckpt = tmp_path / "ckpts" / "g"
    assert not (ckpt / "tokenizer.json").exists()
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    other = bpe(["<|endoftext|>"], vocab_size=290)  # ids that fit the model, another vocabulary
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(other.to_str(), encoding="utf-8")
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    own = prepare(tmp_path / "text.txt", tmp_path / "own" / "tokenizer.json", tmp_path / "data", "own")
    wrong = prepare(tmp_path / "text.txt", tmp_path / "other" / "tokenizer.json", tmp_path / "data", "other")
    result = invoke("lens", "--ckpt", "g", "--data", own, "--n-tokens", "64", "--seq-len", "32", "--no-save")
    assert result.exit_code == 0, result.output  # the model's own vocabulary: accepted
    break_weights(ckpt)
    for data in (wrong, prepare(tmp_path / "text.txt", "byte", tmp_path / "data", "bytes")):
        refused_before_load(invoke("lens", "--ckpt", "g", "--data", data, "--no-save"), "vocabulary of its GGUF file")


# -- a short validation split is said, and capped unless --n-tokens is given (item 4) ---------------------------
def test_short_split_is_capped_by_default_and_said(imported):
    from depthtools.analysis.suite import checkpoint_tokens
    from depthtools.data import load_split

    root, folder, ckpt = imported
    data = prepare(root / "text.txt", folder / "tokenizer.json", root / "data", "d")
    held = len(load_split(data, "val"))
    assert 33 * 2 < held < 4096  # one long text: a few hundred tokens of validation
    capped = checkpoint_tokens(ckpt, data, 4096, 32, cap=True)
    assert tuple(capped.shape) == (held // 33, 33)  # the whole windows the split holds, none twice
    val = torch.from_numpy(load_split(data, "val").astype("int64"))
    assert torch.equal(capped.reshape(-1), val[:capped.numel()])
    result = invoke("lens", "--ckpt", "tiny", "--data", data, "--seq-len", "32", "--no-save")
    assert result.exit_code == 0, result.output
    assert f"holds {held:,} tokens: evaluating on {held // 33} window(s) of 32" in result.output
    result = invoke("lens", "--ckpt", "tiny", "--data", data, "--seq-len", "32", "--n-tokens", "4096", "--no-save")
    assert result.exit_code == 0, result.output
    assert f"holds {held:,} tokens: the 4,096 tokens asked resample it about" in result.output
    assert len(checkpoint_tokens(ckpt, data, 4096, 32)) == 128  # asked for: given, overlapping


def test_import_help_names_the_gguf_extra():
    result = runner.invoke(app, ["import-hf", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert 'pip install -e ".[gguf]"' in result.output, result.output


# -- docs/pretrained.md's recipe, verbatim, on a Gemma-3 folder -------------------------------------------------
DOCS = Path(__file__).resolve().parents[1] / "docs" / "pretrained.md"


def recipe_commands() -> list[list[str]]:
    """The depthtools commands of docs/pretrained.md's opening recipe (its first bash block and the `data
    prepare` line after it, then a probe on that data), as argument lists."""
    import re
    import shlex

    text = DOCS.read_text(encoding="utf-8").split("## GGUF files")[0]
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL).group(1)
    commands = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.startswith("depthtools ")]
    prepare = re.search(r"`(depthtools data prepare [^`]+)`", text).group(1)
    data = re.search(r"`--data (data/[^`]+)`", text).group(1)
    ckpt = commands[0][4]
    return commands + [shlex.split(prepare), ["depthtools", "lens", "--ckpt", ckpt, "--data", data]]


def test_docs_recipe_works_verbatim_for_a_gemma3_folder(tmp_path, monkeypatch):
    commands = recipe_commands()
    folder = commands[0][2]  # the recipe's model folder, e.g. ./pythia-160m
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "checkpoints"))
    gemma3_folder(tmp_path, name=Path(folder).name)
    Path("my_text.txt").write_text(TEXT * 10, encoding="utf-8")  # ~3,300 tokens: a validation split of ~330
    Path("text.txt").write_text(TEXT * 10, encoding="utf-8")
    for command in commands:
        assert command[0] == "depthtools"
        result = runner.invoke(app, command[1:])
        assert result.exit_code == 0, f"{' '.join(command)}:\n{result.output}"
    config = json.loads((tmp_path / "checkpoints" / commands[0][4] / "config.json").read_text())
    assert config["model"]["options"]["family"] == "gemma3_text"
    assert config["tokenizer"]["sep_token"] == "<eos>"


# -- the report of an imported model (item 6) --------------------------------------------------------------------
def section_ids(html: str) -> set[str]:
    import re

    return set(re.findall(r'<section[^>]*id="([^"]+)"', html))


def test_report_of_an_imported_model_is_written_for_it(imported):
    """No training curve, recipe, depth-task or routing section; family and provenance shown; the missing-table
    advice names the checkpoint and --text (not `analyze --grid` over every model); DepthBench's table shown."""
    from depthtools.report import model_report

    root, folder, ckpt = imported
    empty = (model_report([ckpt], root / "empty.html")).read_text(encoding="utf-8")
    assert "depthtools analyze --ckpt tiny --text YOUR_TEXT.txt" in empty  # found by name under $DEPTHTOOLS_CHECKPOINTS
    assert "routing.parquet" not in empty  # a plain residual stream: no routing to miss
    assert "analyze --grid" not in empty
    for args in (["lens"], ["causal", "--protocol", "depthbench"]):
        result = invoke(*args, "--ckpt", "tiny", "--text", root / "text.txt", "--n-tokens", "64", "--seq-len", "32")
        assert result.exit_code == 0, result.output
    html = model_report([ckpt], root / "report.html").read_text(encoding="utf-8")
    ids = section_ids(html)
    assert {"overview", "lens", "depthbench"} <= ids, ids
    assert not ids & {"training", "depth-tasks", "routing"}, ids
    for absent in ("Training recipe", "No training curve", "tasks eval", "<td>preln</td>", ">preln<"):
        assert absent not in html, absent
    assert "Provenance" in html and "huggingface-llama" in html and str(folder.resolve()) in html
    assert 'data-v="llama">llama</td>' in html  # the family, where a trained model shows its architecture
    assert "mean_causal_score" in html  # DepthBench's summaries


def test_report_advice_for_a_gguf_import_without_tokenizer_names_data_prepare(tmp_path, monkeypatch):
    from depthtools.report.data import read_cell

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    assert invoke("import-hf", gguf_without_tokenizer(tmp_path, bpe(["<|endoftext|>"])), "--name", "g").exit_code == 0
    advice = {how for _, how in read_cell(tmp_path / "ckpts" / "g").missing}
    assert len(advice) == 1 and "--data DIR" in advice.pop()


def test_skip_bar_labels_of_a_deep_model_stay_legible():
    import pandas as pd

    from depthtools.report import figures

    skip = pd.DataFrame({"model": "m", "layer": range(30), "delta_ce": [0.1] * 30, "kl_intact_ablated": [0.1] * 30})
    fig = figures.plot_skip_bars(skip, ["m"])
    for ax in fig.axes[:2]:
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert 3 <= len(labels) <= figures.MAX_TICK_LABELS and labels[0] == "0", labels


def test_block_zero_does_not_set_the_contribution_range():
    import pandas as pd

    from depthtools.report import figures

    values = [40.0] + [0.1 + 0.01 * l for l in range(1, 30)]  # block 0 rewrites the (scaled) embedding
    contrib = pd.DataFrame({"model": "m", "metric": "relative_contribution", "unit": "block", "layer": range(30),
                            "rel_depth": [(l + 1) / 30 for l in range(30)], "value": values})
    ax = figures.plot_contributions(contrib, ["m"]).axes[0]
    assert ax.get_ylim()[1] < 1.0  # the other 29 blocks fill the panel
    assert any("block 0 off scale: 40" in t.get_text() for t in ax.texts)


def test_depthbench_says_when_it_resamples_a_short_split(imported):
    root, folder, ckpt = imported
    data = prepare(root / "text.txt", folder / "tokenizer.json", root / "data", "d")
    result = invoke("causal", "--protocol", "depthbench", "--ckpt", "tiny", "--data", data, "--seq-len", "32",
                    "--n-tokens", "2048", "--no-save")
    assert result.exit_code == 0, result.output
    assert "resample it about" in result.output


def test_data_of_another_separator_is_noted(tmp_path, monkeypatch):
    """Data prepared with --sep-token other than the separator the import records (as data prepared before
    the one rule could be): accepted (same tokenizer), with a note that its windows start differently."""
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = llama_folder(tmp_path, bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), eos_token_id=2)
    assert invoke("import-hf", folder, "--name", "smol").exit_code == 0
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    data = prepare(tmp_path / "text.txt", folder / "tokenizer.json", tmp_path / "data", "old", "--sep-token",
                   "<|endoftext|>")
    result = invoke("lens", "--ckpt", "smol", "--data", data, "--seq-len", "32", "--no-save")
    assert result.exit_code == 0, result.output
    assert "separates documents with token 0, but checkpoint smol records 2" in result.output
