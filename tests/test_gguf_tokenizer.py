"""Tokenizers rebuilt from GGUF metadata, for every kind llama.cpp writes: SentencePiece ("llama": scores and
token types) and byte-level BPE with the pre-tokenizers "gpt2", "llama-bpe" (Llama-3) and "qwen2".

Real tokenizers are trained here, offline, on the tiny corpus (sentencepiece's own trainer with Llama-2's
settings; `tokenizers`' BPE trainer with Llama-3's / Qwen2's tokenizer.json layout: split regex, ignore_merges,
NFC), their vocabularies written as GGUF metadata the way convert_hf_to_gguf.py writes them (tokens, scores,
token types, merges, pre, special ids), imported with `import-hf`, and the checkpoint's tokenizer.json must
encode a few thousand characters of real text (the corpus plus unicode, digits, whitespace runs, special
tokens) to the same ids as the original (for SentencePiece: sentencepiece itself and transformers' tokenizer.json
of the same tokenizer.model).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck

from tiny_models import TINY_CORPUS, one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

runner = CliRunner()
CORPUS = "".join(p.read_text(encoding="utf-8") for p in sorted(TINY_CORPUS.glob("*.txt")))
# text the trainers never saw: scripts outside the corpus, decomposed accents (NFC changes them), digit runs,
# tabs / space runs / blank lines / CRLF, contractions, and the special and user-defined tokens
EXTRA = ("Naïve café — “quoted” façade; 日本語のテキスト, Ελληνικά, русский текст; emoji 🙂👍🏽 and e\u0301 A\u030a ﬁ.\n"
         "Digits 1234567 3.14159 2026-12-07 and 0x1F; tabs\t\tand   runs    of spaces\n\n\n   indented line\r\n"
         "CRLF end. I'm, you're, they'll, she'd, WE'VE.  <|im_end|> x<think>y <|begin_of_text|>Hello  ")
TEXT = CORPUS[:4000] + EXTRA + CORPUS[-2000:]
# The split regexes as the original tokenizer.json files spell them (Llama-3's; Qwen2's from transformers)
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
SPECIALS = {"llama-bpe": ["<|begin_of_text|>", "<|end_of_text|>"], "qwen2": ["<|endoftext|>", "<|im_start|>",
                                                                              "<|im_end|>"],
            "gpt2": ["<|endoftext|>"]}


def bpe_original(pre: str, vocab_size: int = 900) -> Tokenizer:
    """A byte-level BPE trained on the corpus in the tokenizer.json layout of the model `pre` names, with its
    special tokens (special) and, for Qwen2, a user-defined added token '<think>' (not special)."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2

    tok = Tokenizer(models.BPE())
    if pre == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = pre_tokenizers.Split(Regex(LLAMA3 if pre == "llama-bpe" else QWEN2), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS[i:i + 500] for i in range(0, len(CORPUS), 500)], trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[pre]])
    if pre == "qwen2":
        tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = pre == "llama-bpe"  # Llama-3's tokenizer.json takes in-vocabulary words whole
    return Tokenizer.from_str(json.dumps(data))


def bpe_metadata(tok: Tokenizer, pre: str) -> dict:
    """GGUF tokenizer metadata as convert_hf_to_gguf's get_vocab_base / SpecialVocab write it: every id's token
    (a hole: [PADn], unused), control for special added tokens, user-defined for the others, 'a b' merges."""
    vocab = tok.get_vocab(with_added_tokens=True)
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(max(reverse) + 1):
        if i not in reverse:
            tokens.append(f"[PAD{i}]"), types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i]), types.append(gguf.TokenType.CONTROL if added[i].special
                                                     else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i]), types.append(gguf.TokenType.NORMAL)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    eos = vocab[SPECIALS[pre][-1 if pre != "llama-bpe" else 1]]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges, "eos": eos}


def train_sentencepiece(vocab_size: int = 800):
    """A SentencePiece BPE model trained with Llama-2's settings (byte fallback, identity normalization, digits
    split, a dummy prefix, extra whitespace kept)."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in CORPUS.splitlines() if line.strip()]), model_writer=model,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return model.getvalue()


def spm_metadata(proto: bytes) -> dict:
    """GGUF metadata as convert_hf_to_gguf's _create_vocab_sentencepiece writes it: pieces, scores, types."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    n = sp.get_piece_size()
    types = [gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i)
             else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i)
             else gguf.TokenType.NORMAL for i in range(n)]
    return {"model": "llama", "pre": "default", "tokens": [sp.id_to_piece(i) for i in range(n)],
            "scores": [sp.get_score(i) for i in range(n)], "types": types, "eos": sp.eos_id(), "bos": sp.bos_id(),
            "unk": sp.unk_id(), "space_prefix": True}


def write_file(path: Path, meta: dict, arch: str = "qwen2") -> None:
    """A tiny model (random weights; only the tokenizer matters here) with the tokenizer metadata `meta`."""
    rng = np.random.default_rng(0)
    n, d, ff = len(meta["tokens"]), 16, 24
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_context_length, 32), (writer.add_embedding_length, d), (writer.add_block_count, 1),
                       (writer.add_feed_forward_length, ff), (writer.add_head_count, 2), (writer.add_head_count_kv, 2),
                       (writer.add_layer_norm_rms_eps, 1e-6)):
        add(value)
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types([int(t) for t in meta["types"]])
    if "scores" in meta:
        writer.add_token_scores(meta["scores"])
    if "merges" in meta:
        writer.add_token_merges(meta["merges"])
    writer.add_eos_token_id(meta["eos"])
    if "bos" in meta:
        writer.add_bos_token_id(meta["bos"])
        writer.add_unk_token_id(meta["unk"])
        writer.add_add_space_prefix(meta["space_prefix"])
    shapes = {"token_embd.weight": (n, d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.ffn_norm.weight": (d,), "blk.0.attn_q.weight": (d, d), "blk.0.attn_k.weight": (d, d),
              "blk.0.attn_v.weight": (d, d), "blk.0.attn_output.weight": (d, d), "blk.0.ffn_gate.weight": (ff, d),
              "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
    if arch == "qwen2":
        for kind in "qkv":
            writer.add_tensor(f"blk.0.attn_{kind}.bias", np.zeros(d, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()


def imported(tmp_path: Path, meta: dict, arch: str = "qwen2"):
    """(the tokenizer.json the import wrote or None, the CLI output)."""
    write_file(tmp_path / "m.gguf", meta, arch)
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 0, result.output
    file = tmp_path / "ck" / "tokenizer.json"
    return (Tokenizer.from_file(str(file)) if file.exists() else None), result.output


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_byte_level_bpe_gives_the_original_ids(pre, tmp_path):
    original = bpe_original(pre)
    ours, _ = imported(tmp_path, bpe_metadata(original, pre))
    assert ours is not None
    expected = ids(original, TEXT)
    assert len(expected) > 1000
    assert ids(ours, TEXT) == expected
    for line in EXTRA.splitlines(keepends=True):  # each piece alone too (starts of text, specials at the edge)
        assert ids(ours, line) == ids(original, line), line
    assert ours.decode(expected, skip_special_tokens=False) == original.decode(expected, skip_special_tokens=False)
    for special in SPECIALS[pre]:
        assert ids(ours, f"a{special}b")[1] == original.token_to_id(special)


def test_the_pre_tokenizer_matters(tmp_path):
    """The three BPE kinds give different ids on this text with one and the same vocabulary: reading a file with
    another kind's pre-tokenizer (or without Llama-3's ignore_merges, or Qwen2's NFC) would fail the test above."""
    from depthtools.interop.gguf_tokenizer import gguf_tokenizer

    meta = bpe_metadata(bpe_original("llama-bpe"), "llama-bpe")
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": meta["tokens"],
            "tokenizer.ggml.merges": meta["merges"], "tokenizer.ggml.token_type": meta["types"]}
    got = {pre: ids(gguf_tokenizer({**base, "tokenizer.ggml.pre": pre}, 10 ** 6)[0], TEXT)
           for pre in ("llama-bpe", "qwen2", "gpt2")}
    assert len({tuple(v) for v in got.values()}) == 3
    nfc = "e\u0301 A\u030a"
    qwen = bpe_original("qwen2")
    plain = json.loads(qwen.to_str())
    plain["normalizer"] = None
    assert ids(Tokenizer.from_str(json.dumps(plain)), nfc) != ids(qwen, nfc)  # and NFC does


def test_sentencepiece_gives_sentencepiece_and_tokenizer_json_ids(tmp_path):
    import sentencepiece as spm

    proto = train_sentencepiece()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.model").write_bytes(proto)
    hf = transformers.LlamaTokenizer.from_pretrained(str(tmp_path / "hf")).backend_tokenizer  # the tokenizer.json
    ours, _ = imported(tmp_path, spm_metadata(proto), arch="llama")
    assert ours is not None
    text = TEXT.replace("<|im_end|>", "").replace("<think>", "").replace("<|begin_of_text|>", "")  # no specials
    expected = sp.encode(text)
    assert len(expected) > 1000 and sp.unk_id() not in expected
    assert ids(hf, text) == expected  # transformers' tokenizer.json of the tokenizer.model agrees on this text
    assert ids(ours, text) == expected
    for line in EXTRA.splitlines(keepends=True):
        assert ids(ours, line) == sp.encode(line), line
    # text starting with a space: sentencepiece (and llama.cpp, and Llama-2's own tokenizer.json) still prepend
    # the dummy '▁'; transformers' Metaspace conversion does not. We follow sentencepiece.
    assert ids(ours, " x") == sp.encode(" x") != ids(hf, " x")
    assert ours.decode(expected) == sp.decode(expected)
    assert any(sp.is_byte(i) for i in expected)  # byte fallback was exercised (CJK, emoji)


def test_sentencepiece_without_a_space_prefix(tmp_path):
    """tokenizer.ggml.add_space_prefix false: no leading '▁' (as sentencepiece with add_dummy_prefix off)."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for line in CORPUS.splitlines() if line.strip()]), model_writer=proto,
        vocab_size=600, model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, character_coverage=1.0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    meta = {**spm_metadata(proto.getvalue()), "space_prefix": False}
    ours, _ = imported(tmp_path, meta, arch="llama")
    text = CORPUS[:3000]
    assert ids(ours, text) == sp.encode(text)
    (tmp_path / "p").mkdir()
    assert ids(ours, "the") != ids(imported(tmp_path / "p", {**meta, "space_prefix": True}, arch="llama")[0], "the")


@pytest.mark.parametrize("edit,why", [
    (dict(pre="deepseek-coder"), "byte-level BPE with pre-tokenizer 'deepseek-coder' cannot be rebuilt exactly"),
    (dict(model="bert"), "tokenizer model 'bert' cannot be rebuilt exactly from GGUF"),
], ids=["other-pre-tokenizer", "wordpiece"])
def test_a_kind_we_cannot_rebuild_imports_the_weights_and_says_why(edit, why, tmp_path):
    (tmp_path / "p").mkdir()
    meta = {**bpe_metadata(bpe_original("gpt2", vocab_size=300), "gpt2"), **edit}
    tok, output = imported(tmp_path / "p", meta)
    assert tok is None and f"no tokenizer was carried: {why}" in " ".join(output.split())  # (wrapped by the table)
    config = ck.read_json(tmp_path / "p" / "ck" / ck.CONFIG)
    assert config["tokenizer"]["format"] == "gguf-vocab"


def test_gemma_sentencepiece_is_not_rebuilt(tmp_path):
    from depthtools.interop.gguf_tokenizer import gguf_tokenizer

    meta = spm_metadata(train_sentencepiece(400))
    tok, why = gguf_tokenizer({"general.architecture": "gemma2", "tokenizer.ggml.model": "llama",
                               "tokenizer.ggml.tokens": meta["tokens"], "tokenizer.ggml.scores": meta["scores"]}, 10 ** 6)
    assert tok is None and "Gemma's SentencePiece vocabulary cannot be rebuilt exactly" in why
    tok, why = gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": meta["tokens"]}, 10 ** 6)
    assert tok is None and "without tokenizer.ggml.scores cannot be rebuilt" in why


@pytest.mark.parametrize("change,needle", [
    (dict(scores=[0.0] * 5), "tokenizer.ggml.scores has 5 entries; a SentencePiece vocabulary needs one number per "
                             "token"),
    (dict(types=[1] * 7), "tokenizer.ggml.token_type has 7 entries; expected one integer per token"),
])
def test_malformed_sentencepiece_metadata_is_one_line(change, needle, tmp_path):
    meta = {**spm_metadata(train_sentencepiece(400)), **change}
    write_file(tmp_path / "m.gguf", meta, "llama")
    result = runner.invoke(app, ["import-hf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "ck")])
    assert result.exit_code == 2, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "ck").exists()


def test_transformers_conversion_is_not_exact_for_qwen2_so_ours_is_built_here():
    """transformers' GGUF tokenizer (GPT2Tokenizer plus the split regex) has no NFC: on decomposed accents it gives
    other ids than Qwen2's tokenizer.json, which our rebuild matches."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from depthtools.interop.gguf_tokenizer import gguf_tokenizer

    original = bpe_original("qwen2")
    meta = bpe_metadata(original, "qwen2")
    theirs, _ = convert_gguf_tokenizer("qwen2", {"tokenizer_type": "gpt2", "pre_tokenizer_type": "qwen2",
                                                 "tokens": meta["tokens"], "merges": meta["merges"],
                                                 "token_type": [int(t) for t in meta["types"]]})
    ours, _ = gguf_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                              "tokenizer.ggml.tokens": meta["tokens"], "tokenizer.ggml.merges": meta["merges"],
                              "tokenizer.ggml.token_type": [int(t) for t in meta["types"]]}, 10 ** 6)
    text = "café e\u0301t\u00e9 A\u030a"
    assert ids(ours, text) == ids(original, text)
    assert ids(theirs, text) != ids(original, text)
    assert torch is not None


def test_llama_bpe_takes_an_in_vocabulary_word_whole():
    """Llama-3's ignore_merges: 'abc' is a token, but the merges alone ('b c' ranks first) give a + bc; llama-bpe
    takes the word whole (as Llama-3's tokenizer.json and llama.cpp do), gpt2 and qwen2 apply the merges."""
    from depthtools.interop import bytes_to_unicode
    from depthtools.interop.gguf_tokenizer import gguf_tokenizer

    alphabet = list(bytes_to_unicode().values())
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [*alphabet, "bc", "ab", "abc"],
            "tokenizer.ggml.merges": ["b c", "a b", "ab c"]}
    got = {pre: gguf_tokenizer({**meta, "tokenizer.ggml.pre": pre}, 10 ** 6)[0].encode("abc").tokens
           for pre in ("llama-bpe", "qwen2", "gpt2")}
    assert got == {"llama-bpe": ["abc"], "qwen2": ["a", "bc"], "gpt2": ["a", "bc"]}
