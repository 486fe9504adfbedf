"""The user's own corpora (`data prepare --input`): formats, local tokenizers, sharded token files,
resume after a killed worker, and the vocabulary and token-budget checks."""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from depthtools.config import ModelConfig, TrainConfig
from depthtools.data import ByteTokenizer, load_split, load_tokenizer, prepare_inputs, read_meta
from depthtools.data.budget import check_vocab, epochs_problem
from depthtools.data.shards import ShardedTokens, verify
from depthtools.errors import DepthToolsError
from depthtools.train.batches import TrainBatches, windows

from tiny_models import prepare_tiny

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the depth of a model is the number of blocks and its width the size of each state".split()


def _texts(n: int, seed: int = 0) -> list[str]:
    """Documents with non-ASCII text, newlines, a literal special token, and one exact duplicate pair."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = [WORDS[j] for j in rng.integers(0, len(WORDS), size=int(rng.integers(3, 60)))]
        extra = ["Grüße 東京 🌍", "line one\nline two", "a literal <|endoftext|> and </s>", ""][i % 4]
        out.append(f"doc {i}: " + " ".join(words) + (" " + extra if extra else ""))
    out.append(out[0])  # a duplicate: the text-hash split puts both copies on the same side
    return out


def _write_inputs(folder: Path, texts: list[str]) -> dict[str, list[str]]:
    """The same kinds of files users bring: jsonl, jsonl.gz, jsonl.zst, parquet, a datasets folder, text files."""
    folder.mkdir(parents=True)
    parts = np.array_split(np.arange(len(texts)), 6)
    groups = {name: [texts[i] for i in idx] for name, idx in zip(["jsonl", "gz", "zst", "parquet", "arrow", "text"], parts)}
    lines = lambda ts, src: "".join(json.dumps({"text": t, "meta": {"src": src}, "id": k}) + "\n" for k, t in enumerate(ts))  # noqa: E731
    (folder / "a.jsonl").write_text(lines(groups["jsonl"], "web"), encoding="utf-8")
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines(groups["gz"], "web"))
    with pa.output_stream(str(folder / "c.jsonl.zst"), compression="zstd") as f:
        f.write(lines(groups["zst"], "code").encode("utf-8"))
    pq.write_table(pa.table({"text": groups["parquet"], "meta": [{"src": "books"}] * len(groups["parquet"])}),
                   folder / "d.parquet", row_group_size=7)
    hf = folder / "hf"  # what datasets' save_to_disk writes: IPC stream files + state.json + dataset_info.json
    hf.mkdir()
    table = pa.table({"text": groups["arrow"], "meta": [{"src": "books"}] * len(groups["arrow"])})
    with pa.ipc.new_stream(str(hf / "data-00000-of-00001.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                               "_fingerprint": "x", "_split": None}))
    (hf / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string", "_type": "Value"}}}))
    txt = folder / "txt"
    txt.mkdir()
    for k, t in enumerate(groups["text"]):
        (txt / f"{k:03d}.txt").write_text(t, encoding="utf-8")
    return groups


def _documents(tok, data_dir: Path, split: str) -> list[str]:
    """Decode a split document by document (the separator precedes each)."""
    ids = np.asarray(load_split(data_dir, split), dtype=np.int64)
    if not len(ids):
        return []
    starts = np.flatnonzero(ids == tok.sep_id)
    assert starts.size and starts[0] == 0, "a separator must precede every document"
    ends = list(starts[1:]) + [len(ids)]
    return [tok.decode(ids[s + 1:e]) for s, e in zip(starts, ends)]


def _tiny_tokenizer(path: Path, texts: list[str], sep: str = "</s>", vocab_size: int = 400) -> Path:
    """A byte-level BPE trained here with `tokenizers` and saved as a plain tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", sep],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def _word_tokenizer(path: Path, size: int) -> Path:
    """A word-level tokenizer with `size` ids (WORDS get the top ids), to exercise large vocabularies."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - len(WORDS) - 2)}
    vocab.update({w: size - len(WORDS) - 2 + k for k, w in enumerate(WORDS)})
    vocab["[UNK]"] = size - 2
    vocab["<|endoftext|>"] = size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def _inputs(folder: Path) -> list[str]:
    return [str(folder / "a.jsonl"), str(folder / "*.jsonl.*"), str(folder / "d.parquet"), str(folder / "hf"),
            str(folder / "txt")]


# ---------------------------------------------------------------- formats and round trips


def test_every_format_round_trips_token_exact_into_fixed_size_shards(tmp_path):
    texts = _texts(120)
    _write_inputs(tmp_path / "in", texts)
    out = prepare_inputs(_inputs(tmp_path / "in"), out_dir=tmp_path / "data", name="mine", val_fraction=0.2,
                         shard_tokens=2048, unit_bytes=1500, workers=2)
    meta = read_meta(out)
    tok = load_tokenizer(out)
    assert isinstance(tok, ByteTokenizer) and meta["dtype"] == "uint16" and meta["tokenizer"]["vocab_size"] == 256
    train, val = _documents(tok, out, "train"), _documents(tok, out, "val")
    assert sorted(train + val) == sorted(texts)  # every document once, byte-exact
    assert val and (texts[0] in train) != (texts[0] in val) and (train + val).count(texts[0]) == 2
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 2 and all(s["tokens"] == 2048 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 2048
    assert meta["splits"]["train"]["documents"] == len(train) == sum(s["documents"] for s in shards)
    ids = np.asarray(load_split(out, "train"))
    for s, shard in enumerate(shards):  # the .idx files point at every document's separator
        starts = np.fromfile(out / shard["index"], dtype=np.uint64).astype(np.int64) + 2048 * s
        assert (ids[starts] == tok.sep_id).all()
    assert int((ids == 0).sum()) == len(train)
    assert verify(out) == []  # every shard's sha256 matches the manifest
    assert meta["settings"]["tokenizer"] == tok.fingerprint() and meta["data_fingerprint"]
    # a second call with the same settings does nothing
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert prepare_inputs(_inputs(tmp_path / "in"), out_dir=tmp_path / "data", name="mine", val_fraction=0.2,
                          shard_tokens=2048, unit_bytes=1500) == out
    assert (out / "meta.json").stat().st_mtime_ns == stamp


def test_domain_field_gives_per_domain_validation_splits(tmp_path):
    texts = _texts(150, seed=1)
    groups = _write_inputs(tmp_path / "in", texts)
    inputs = [str(tmp_path / "in" / n) for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "hf")]
    out = prepare_inputs(inputs, out_dir=tmp_path / "data", name="dom", domain_field="meta.src", val_fraction=0.3,
                         unit_bytes=4000)
    meta = read_meta(out)
    tok = ByteTokenizer()
    by_source = {"web": groups["jsonl"] + groups["gz"], "code": groups["zst"], "books": groups["parquet"] + groups["arrow"]}
    assert set(meta["domains"]) <= set(by_source) and len(meta["domains"]) >= 2
    val = _documents(tok, out, "val")
    for domain in meta["domains"]:
        docs = _documents(tok, out, f"val_{domain}")
        assert docs and set(docs) <= set(by_source[domain]) and set(docs) <= set(val)
    assert sum(meta["splits"][f"val_{d}"]["tokens"] for d in meta["domains"]) == meta["splits"]["val"]["tokens"]


def test_local_tokenizer_json_round_trips_and_is_recorded(tmp_path):
    texts = _texts(80, seed=2)
    _write_inputs(tmp_path / "in", texts)
    path = _tiny_tokenizer(tmp_path / "tok", texts)
    out = prepare_inputs(_inputs(tmp_path / "in"), out_dir=tmp_path / "data", tokenizer=str(path), val_fraction=0.25,
                         shard_tokens=1024, unit_bytes=3000, workers=2)
    meta = read_meta(out)
    tok = load_tokenizer(out)
    assert out.name == "in-tok-" + str(tok.vocab_size)
    assert meta["tokenizer"]["sep_token"] == "</s>" and meta["tokenizer"]["sep_id"] == tok.sep_id == 1
    assert meta["tokenizer"]["vocab_size"] == tok.vocab_size <= 400 and meta["dtype"] == "uint16"
    from depthtools.data.tokenizer import BPETokenizer

    assert meta["tokenizer"]["fingerprint"] == BPETokenizer.from_file(path).fingerprint()
    assert sorted(_documents(tok, out, "train") + _documents(tok, out, "val")) == sorted(texts)
    # literal special tokens inside a text are text, not separators
    assert tok.sep_id not in tok.encode("a literal </s> here")


def test_meta_naming_a_tokenizer_file_outside_its_folder_is_refused(tmp_path):
    """A run copies meta.json's tokenizer.file into its cell: '../x' or 'a/b' would read and write outside."""
    import json

    texts = _texts(40, seed=3)
    _write_inputs(tmp_path / "in", texts)
    path = _tiny_tokenizer(tmp_path / "tok", texts)
    out = prepare_inputs(_inputs(tmp_path / "in"), out_dir=tmp_path / "data", tokenizer=str(path), val_fraction=0.25,
                         shard_tokens=1024, unit_bytes=3000, workers=1)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert read_meta(out)["tokenizer"]["file"] == meta["tokenizer"]["file"]  # the real name passes
    for bad in ("../x.json", "sub/tokenizer.json", "/etc/passwd", ".hidden", 7):
        meta["tokenizer"]["file"] = bad
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(DepthToolsError, match="tokenizer.file") as err:
            read_meta(out)
        assert "\n" not in str(err.value)


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    texts = [" ".join(WORDS[i % len(WORDS):] + WORDS[:i % len(WORDS)]) for i in range(40)]
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "w.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    path = _word_tokenizer(tmp_path / "big", 70_000)
    out = prepare_inputs([str(folder / "w.jsonl")], out_dir=tmp_path / "data", tokenizer=str(path), val_fraction=0.1)
    meta = read_meta(out)
    ids = load_split(out, "train")
    assert meta["dtype"] == "uint32" and ids.dtype == np.uint32 and int(np.asarray(ids).max()) > 65535
    assert meta["tokenizer"]["sep_id"] == 69_999
    tok = load_tokenizer(out)
    assert sorted(_documents(tok, out, "train") + _documents(tok, out, "val")) == sorted(texts)


def test_datasets_save_to_disk_folder_is_read_without_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = _texts(40, seed=3)
    datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(str(tmp_path / "saved"))
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:10]}),
                               "test": datasets.Dataset.from_dict({"text": ["held out elsewhere"]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    out = prepare_inputs([str(tmp_path / "saved")], out_dir=tmp_path / "data", val_fraction=0.2)
    tok = ByteTokenizer()
    assert sorted(_documents(tok, out, "train") + _documents(tok, out, "val")) == sorted(texts)
    out2 = prepare_inputs([str(tmp_path / "dict")], out_dir=tmp_path / "data", name="dict", val_fraction=0.0)
    assert sorted(_documents(tok, out2, "train")) == sorted(texts[:10])  # a DatasetDict stands for its train split


def test_bad_inputs_are_one_line_errors(tmp_path, monkeypatch):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "x.jsonl").write_text(json.dumps({"content": "hi"}) + "\n")
    with pytest.raises(DepthToolsError, match="no field 'text'.*content.*--text-field"):
        prepare_inputs([str(folder / "x.jsonl")], out_dir=tmp_path / "data")
    assert prepare_inputs([str(folder / "x.jsonl")], out_dir=tmp_path / "data", text_field="content", val_fraction=0)
    with pytest.raises(DepthToolsError, match="no file matches"):
        prepare_inputs([str(folder / "*.parquet")], out_dir=tmp_path / "data")
    with pytest.raises(DepthToolsError, match="no such file"):
        prepare_inputs([str(folder / "missing.jsonl")], out_dir=tmp_path / "data")
    (folder / "y.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DepthToolsError, match="y.jsonl.*not a JSON line"):
        prepare_inputs([str(folder / "y.jsonl")], out_dir=tmp_path / "data", name="y")
    with pytest.raises(DepthToolsError, match="tokenizer file .* not found"):
        prepare_inputs([str(folder / "x.jsonl")], out_dir=tmp_path / "data", tokenizer=str(tmp_path / "no" / "tokenizer.json"))
    # .zst without any zstd codec names the package to install
    with pa.output_stream(str(folder / "z.jsonl.zst"), compression="zstd") as f:
        f.write(b'{"text": "hi"}\n')
    from depthtools.data import inputs as inputs_mod

    monkeypatch.setattr(inputs_mod, "pyarrow_zstd", lambda: False)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(DepthToolsError, match="pip install zstandard"):
        prepare_inputs([str(folder / "z.jsonl.zst")], out_dir=tmp_path / "data", name="z")


def test_jsonl_byte_ranges_cover_every_line_once(tmp_path):
    """Units cut an uncompressed jsonl file at arbitrary bytes; each line is read by exactly one unit."""
    from depthtools.data.inputs import FieldReader, expand_inputs, plan_units, read_unit

    texts = [("x" * (k % 13)) + f" line {k} ü" for k in range(300)]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" + ("\n" if k % 50 == 0 else "") for k, t in enumerate(texts)))
    for unit_bytes in (1, 7, 64, 1000, 10**9):
        units = plan_units(expand_inputs([str(path)]), unit_bytes)
        got = [t for u in units for t, _d in read_unit(u, FieldReader("text", None))]
        assert got == texts, unit_bytes


# ---------------------------------------------------------------- resume after a kill


def _cli_prepare(inputs: list[str], out: Path, extra=()) -> list[str]:
    args = [sys.executable, "-m", "cli", "data", "prepare", "--out", str(out), "--name", "big", "--val-fraction", "0.1",
            "--shard-tokens", "4096", "--unit-mb", "0.002"]
    for i in inputs:
        args += ["--input", i]
    return args + list(extra)


def test_killed_worker_then_rerun_gives_the_uninterrupted_result(tmp_path):
    psutil = pytest.importorskip("psutil")
    texts = _texts(400, seed=4)
    _write_inputs(tmp_path / "in", texts)
    tok_path = _tiny_tokenizer(tmp_path / "tok", texts)
    inputs = _inputs(tmp_path / "in")
    extra = ["--tokenizer", str(tok_path), "--workers", "2"]
    env = {**os.environ, "DEPTHTOOLS_PREPARE_UNIT_DELAY": "0.3", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(_cli_prepare(inputs, tmp_path / "killed", extra), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    work = tmp_path / "killed" / ".big.partial" / "work"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(work.glob("u*.json"))) < 3:
        time.sleep(0.05)
    done_before = len(list(work.glob("u*.json")))
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert done_before >= 3 and workers, "the preparation ended before a worker could be killed"
    os.kill(workers[0].pid, signal.SIGKILL)
    _stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "worker process died" in stderr and "run the same command again" in stderr
    assert not (tmp_path / "killed" / "big").exists()
    # re-run: continues from the finished units (here in-process, one worker)
    lines = []
    out = prepare_inputs(inputs, out_dir=tmp_path / "killed", name="big", tokenizer=str(tok_path), val_fraction=0.1,
                         shard_tokens=4096, unit_bytes=int(0.002 * 2**20), log=lines.append)
    assert any(f"continuing: {n} unit(s) already done" in line for line in lines for n in range(done_before, 10**4))
    assert not (tmp_path / "killed" / ".big.partial").exists()
    # an uninterrupted run elsewhere gives the very same bytes
    subprocess.run(_cli_prepare(inputs, tmp_path / "clean", extra), cwd=ROOT, env={**env, "DEPTHTOOLS_PREPARE_UNIT_DELAY": ""},
                   check=True, capture_output=True)
    a, b = read_meta(out), read_meta(tmp_path / "clean" / "big")
    assert a["splits"] == b["splits"] and a["data_fingerprint"] == b["data_fingerprint"]
    for split in a["splits"].values():
        for shard in split["shards"]:
            assert (out / shard["file"]).read_bytes() == (tmp_path / "clean" / "big" / shard["file"]).read_bytes()
    tok = load_tokenizer(out)
    assert sorted(_documents(tok, out, "train") + _documents(tok, out, "val")) == sorted(texts)


# ---------------------------------------------------------------- the trainer reads shards


def test_sharded_split_reads_as_its_concatenation_for_any_world_size(tmp_path):
    texts = _texts(200, seed=5)
    _write_inputs(tmp_path / "in", texts)
    out = prepare_inputs(_inputs(tmp_path / "in"), out_dir=tmp_path / "data", name="s", shard_tokens=1500,
                         val_fraction=0.05, unit_bytes=2000)
    tokens = load_split(out, "train")
    assert isinstance(tokens, ShardedTokens) and len(tokens.maps) > 3
    flat = np.concatenate([np.fromfile(out / s["file"], dtype=np.uint16) for s in read_meta(out)["splits"]["train"]["shards"]])
    assert len(tokens) == len(flat)
    offsets = np.array([0, 1499, 1500, 2990, len(flat) - 33])  # windows across shard boundaries
    assert torch.equal(windows(tokens, offsets, 32), windows(flat, offsets, 32))
    assert np.array_equal(tokens[1490:1510], flat[1490:1510]) and tokens[-1] == flat[-1]
    one = TrainBatches(tokens, 8, 32, seed=3, device=torch.device("cpu"))
    ref = TrainBatches(flat, 8, 32, seed=3, device=torch.device("cpu"))
    ranks = [TrainBatches(tokens, 8, 32, seed=3, device=torch.device("cpu"), rank=r, world_size=4) for r in range(4)]
    for step in (0, 1, 17):
        x, y = one.batch(step)
        assert torch.equal(x, ref.batch(step)[0])
        assert torch.equal(torch.cat([r.batch(step)[0] for r in ranks]), x)  # same global batch at world size 4


def test_training_on_a_sharded_dataset_and_its_vocabulary_checks(tmp_path, caplog):
    from depthtools.train import train_cell

    texts = _texts(300, seed=6)
    _write_inputs(tmp_path / "in", texts)
    out = prepare_inputs(_inputs(tmp_path / "in"), out_dir=tmp_path / "data", name="t", shard_tokens=4096,
                         val_fraction=0.1)
    small = dict(d_model=32, n_layer=2, n_heads=2, max_seq_len=32)
    fast = dict(batch_size=4, seq_len=32, eval_tokens=256, eval_every=0, log_every=1, depth_stats_every=0,
                checkpoint_every=0, threads=1)
    with pytest.raises(DepthToolsError, match=r"vocab_size=512 does not match the byte tokenizer .* \(256 tokens\)"):
        train_cell(ModelConfig(vocab_size=512, **small), TrainConfig(tokens=256, **fast), out, tmp_path / "c0")
    with pytest.raises(DepthToolsError, match="vocab_size=200 does not match"):
        train_cell(ModelConfig(vocab_size=200, **small), TrainConfig(tokens=256, **fast), out, tmp_path / "c1")
    summary = train_cell(ModelConfig(vocab_size=256, **small), TrainConfig(tokens=3 * 128, **fast), out, tmp_path / "c2")
    assert summary["steps"] == 3 and np.isfinite(summary["val_loss"])


def test_vocabulary_rule_allows_padding_only():
    record = {"name": "neox", "vocab_size": 50277}
    for ok in (50277, 50280, 50304):
        check_vocab(ok, record, "data/x")
    for bad in (50276, 50305, 8192):
        with pytest.raises(DepthToolsError, match="50,277..50,304"):
            check_vocab(bad, record, "data/x")
    with pytest.raises(DepthToolsError, match=r"vocab_size=50,280 .* bpe8k .* \(8,192 tokens\).*--vocab-size 8192"):
        check_vocab(50280, {"name": "bpe8k", "vocab_size": 8192}, "data/default-bpe8k")


# ---------------------------------------------------------------- honest budgets


def test_budget_above_max_epochs_is_refused_with_the_numbers(tmp_path, caplog):
    from depthtools.train import train_cell

    data = prepare_tiny(tmp_path / "data")
    n = read_meta(data)["splits"]["train"]["tokens"]
    small = ModelConfig(vocab_size=256, d_model=32, n_layer=2, n_heads=2, max_seq_len=32)
    fast = dict(batch_size=4, seq_len=32, eval_tokens=256, eval_every=0, log_every=1, depth_stats_every=0,
                checkpoint_every=0, threads=1)
    budget = 4 * 32 * (3 * n // 128 + 1)  # about three epochs, whole steps
    with pytest.raises(DepthToolsError, match=rf"token budget {budget:,} is 3\.\d epochs of the {n:,} train tokens.*"
                                              r"max_epochs=2.*needs at least [\d,]+ train tokens"):
        train_cell(small, TrainConfig(tokens=budget, max_epochs=2, **fast), data, tmp_path / "c")
    assert not (tmp_path / "c" / "model.safetensors").exists()
    assert epochs_problem(budget, n, None, "d")[0] == "warning"
    train_cell(small, TrainConfig(tokens=4 * 32 * 2, max_epochs=5, **fast), data, tmp_path / "ok")
    from depthtools.train.loop import check_inputs  # what prepare_run checks before building anything

    with caplog.at_level(logging.WARNING):
        check_inputs(small, TrainConfig(tokens=budget, **fast), read_meta(data), data, "warned")
    assert any("warned: token budget" in r.getMessage() and "corpus repeats" in r.getMessage() for r in caplog.records)
    assert "max_epochs" not in TrainConfig().to_dict()  # unset: config.json and run fingerprints as before


def _depthbench_spec(tmp_path: Path) -> Path:
    """The depthbench-400m grid spec (recipe and data as the preset says) with one of its cells (planning all 50 takes a minute)."""
    from depthtools.grid import grid_spec, plan_grid, save_grid
    from depthtools.presets import get_preset

    preset = get_preset("depthbench-400m")
    cells = plan_grid(**{**preset.plan, "arch": ["preln"], "layers": [16]})
    return save_grid(grid_spec(cells, name=preset.name, train=preset.train, data=preset.data, plan=preset.plan),
                     tmp_path / "grid.json")


def test_depthbench_preset_refuses_too_little_data_and_says_what_it_needs(tmp_path):
    """grid plan / grid train of depthbench-400m without its data, then against a (much too small) 50,280-token dataset."""
    from typer.testing import CliRunner

    from cli.core_cmd import _check_plan_data
    from cli.main import app
    from depthtools.grid import load_grid

    runner = CliRunner()
    spec_path = _depthbench_spec(tmp_path)
    spec = json.loads(spec_path.read_text())
    assert load_grid(spec_path)["train"]["max_epochs"] == 1
    train = runner.invoke(app, ["grid", "train", str(spec_path), "--data-root", str(tmp_path / "none"),
                                "--root", str(tmp_path / "ck")])
    assert train.exit_code == 2 and "it needs FineWeb-Edu" in train.output, train.output
    assert "depthtools data prepare --input" in train.output
    _check_plan_data(spec, tmp_path / "none")  # planning before the data exists is fine (it prints a note)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "w.jsonl").write_text("".join(json.dumps({"text": " ".join(WORDS)}) + "\n" for _ in range(50)))
    prepare_inputs([str(folder / "w.jsonl")], out_dir=tmp_path / "root", name="fineweb-edu-olmo",
                   tokenizer=str(_word_tokenizer(tmp_path / "olmo", 50280)), val_fraction=0.1)
    with pytest.raises(DepthToolsError, match=r"preln_L16: token budget [\d,]+ is [\d,.]+ epochs of the \d+ train tokens"
                                              r".*max_epochs=1: it needs at least [\d,]+ train tokens; prepare it with: "
                                              r"depthtools data prepare --input"):
        _check_plan_data(spec, tmp_path / "root")
    result = runner.invoke(app, ["grid", "train", str(spec_path), "--data-root", str(tmp_path / "root"),
                                 "--root", str(tmp_path / "ck")])
    assert result.exit_code == 2 and "epochs of the" in result.output and "max_epochs=1" in result.output, result.output
    assert not (tmp_path / "ck" / "depthbench-400m" / "preln_L16").exists()
    # a grid planned from a byte dataset takes its vocabulary; a contradicting --vocab-size is refused
    byte = prepare_inputs([str(folder / "w.jsonl")], out_dir=tmp_path / "root", name="b", val_fraction=0.1)
    ok = runner.invoke(app, ["grid", "plan", "--arch", "preln", "--budget", "200k", "--layers", "2", "--n-heads", "2",
                             "--data", str(byte), "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)[0]["model"]["vocab_size"] == 256
    bad = runner.invoke(app, ["grid", "plan", "--arch", "preln", "--budget", "2M", "--layers", "2", "--n-heads", "2",
                              "--vocab-size", "50280", "--data", str(byte), "--tolerance", "0.5"])
    assert bad.exit_code == 2 and "vocab_size=50,280 does not match the byte tokenizer" in bad.output, bad.output


def test_data_preparation_does_not_import_torch():
    """`data prepare` and its worker processes import depthtools.data, which needs no torch: importing
    torch and TransformerLens there cost ~4 CPU-seconds per process before any text was read (issue 21's
    throughput measurement). Checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys, depthtools, depthtools.data, depthtools.data.inputs, depthtools.data.shards; "
            "print(sorted(m for m in ('torch', 'transformer_lens') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
