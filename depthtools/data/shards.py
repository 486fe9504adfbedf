"""Sharded datasets from the user's corpora: streamed, parallel, resumable tokenization.

    prepare_inputs(["fineweb/*.parquet"], out_dir="data", tokenizer="gpt-neox/tokenizer.json", workers=8)
    -> data/<name>/{train,val,val_<domain>}/NNNNN.bin (+ .idx), tokenizer.json, meta.json

Layout: each split is a folder of fixed-size token shards (`shard_tokens` tokens each, the last one
shorter), flat ids as uint16 when the vocabulary fits (<= 65,536 tokens), else uint32. As in the
single-file layout the tokenizer's separator precedes every document, and documents run on across
shard boundaries, so the shards read in order ARE the split (`load_split` maps them as one array);
`NNNNN.idx` holds the start offsets (uint64, within the shard) of the documents that begin in it.
meta.json is the manifest: per shard its tokens, documents and sha256, per split the sha256 of all
its tokens, the tokenizer's name, vocabulary size, separator and fingerprint, and the inputs.

Split: a document goes to validation when a seeded hash of its TEXT falls below val_fraction, so
the split does not depend on file names, file order or the number of workers, and an exact
duplicate never sits on both sides. `val_<domain>` groups validation documents by --domain-field.

Streaming and parallelism: the inputs are cut into work units (`depthtools.data.inputs`); worker
processes tokenize units in batches of records and append their tokens to per-unit part files, so
memory stays flat in corpus size. A unit is finished when its record (counts, checksums) is written
after its part files; re-running with the same settings skips finished units (an interrupted or
killed preparation continues), then assembles the shards from the parts in unit order — so the
result is identical for any number of workers and any number of interruptions. Work lives in a
hidden sibling `.<name>.partial/`, and the finished dataset replaces `<name>/` in one rename.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from depthtools.data.inputs import (
    UNIT_BYTES,
    FieldReader,
    Unit,
    expand_inputs,
    plan_units,
    read_unit,
    sources_state,
    zstd_without_checksum,
)
from depthtools.data.prepare import (
    FINGERPRINT_SCOPE,
    FORMAT_SHARDS,
    changed_data_files,
    check_overwrite,
    data_fingerprint,
    dataset_lock,
    is_prepared,
)
from depthtools.data.sharded_tokens import ShardedTokens, load_sharded  # noqa: F401  (re-exported)
from depthtools.data.tokenizer import (
    BPE_SIZES,
    TOKENIZER_SPECS,
    BPETokenizer,
    ByteTokenizer,
    file_tokenizer_name,
    is_tokenizer_file,
)
from depthtools.errors import DepthToolsError
from depthtools.fsutil import AtomicFile, atomic_write_json, check_dir_target, check_name, replace_dir

SHARD_TOKENS = 100_000_000  # as nanoGPT's FineWeb script: 200 MB per uint16 shard
MAX_DOMAINS = 256
BATCH_CHARS = 1 << 20  # characters of text per encode call
BPE_SAMPLE_BYTES = 256 * 2**20  # bpe4k/bpe8k are trained on at most this much of the train split
_DELAY_ENV = "DEPTHTOOLS_PREPARE_UNIT_DELAY"  # testing aid: seconds each unit waits (to kill a run midway)


# ---------------------------------------------------------------- the tokenizer a worker uses


def _tokenizer_from_record(record: dict):
    if record["kind"] == "byte":
        return ByteTokenizer()

    return BPETokenizer(Tokenizer.from_str(record["json"]), name=record["name"], sep_token=record["sep_token"])


def _tokenizer_record(tok) -> dict:
    if isinstance(tok, ByteTokenizer):
        return {"kind": "byte"}
    return {"kind": "file", "json": tok.to_json(), "name": tok.name, "sep_token": tok.sep_token}


_WORKER: dict = {}


def _init_worker(tok_record: dict) -> None:
    _WORKER["tok"] = _tokenizer_from_record(tok_record)


def val_threshold(val_fraction: float) -> int:
    return int(val_fraction * 2**64)


def is_val(text_bytes: bytes, seed: int, threshold: int) -> bool:
    """Whether a document is held out: blake2b(seed, text) as a uint64 below val_fraction * 2^64."""
    digest = hashlib.blake2b(text_bytes, digest_size=8, key=f"depthtools-split-{seed}".encode()).digest()
    return int.from_bytes(digest, "little") < threshold


class _PartWriter:
    """Appends one split's tokens of one unit to `<stem>.bin` (+ document starts, + val domains)."""

    def __init__(self, stem: Path, dtype):
        self.stem, self.dtype = stem, dtype
        self.bin = self.idx = self.dom = None
        try:  # each file becomes visible (renamed into place, fsynced) only when close() commits it
            self.bin = AtomicFile(f"{stem}.bin")
            self.idx = AtomicFile(f"{stem}.idx")
            self.dom = AtomicFile(f"{stem}.dom")
        except BaseException:
            self.discard()
            raise
        self.sha = hashlib.sha256()
        self.tokens = self.documents = self.bytes = 0

    def add(self, pieces: list[np.ndarray], domains: list[int], n_bytes: int) -> None:
        if not pieces:
            return
        lengths = np.array([len(p) for p in pieces], dtype=np.uint64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64) + np.uint64(self.tokens)
        data = np.concatenate(pieces).astype(self.dtype, copy=False)
        self.bin.write(data.tobytes())
        self.sha.update(data.tobytes())
        self.idx.write(starts.tobytes())
        self.dom.write(np.asarray(domains, dtype=np.uint16).tobytes())
        self.tokens += int(data.size)
        self.documents += len(pieces)
        self.bytes += n_bytes

    def close(self) -> dict:
        for f in (self.bin, self.idx, self.dom):
            f.commit()
        return {"tokens": self.tokens, "documents": self.documents, "bytes": self.bytes, "sha256": self.sha.hexdigest()}

    def discard(self) -> None:
        """Remove the temporary files (a unit that failed leaves nothing behind)."""
        for f in (self.bin, self.idx, self.dom):
            if f is not None:
                f.discard()


def tokenize_unit(index: int, unit: Unit, work: str, text_field: str, domain_field: str | None, seed: int,
                  val_fraction: float, tok=None) -> dict:
    """Tokenize one unit into `work/u<index>.{train,val}.{bin,idx,dom}` and write its record `u<index>.json` last."""
    tok = tok or _WORKER["tok"]
    delay = float(os.environ.get(_DELAY_ENV) or 0)
    if delay:
        time.sleep(delay)
    t0 = time.perf_counter()
    work = Path(work)
    threshold = val_threshold(val_fraction)
    strip_nul = tok.sep_id == 0 and tok.name == "byte"  # NUL is the byte tokenizer's separator
    sep = np.array([tok.sep_id], dtype=tok.dtype)
    writers: dict[str, _PartWriter] = {}
    try:  # a unit that fails (bad input, full disk) leaves no temporary file behind
        for split in ("train", "val"):
            writers[split] = _PartWriter(work / f"u{index:06d}.{split}", tok.dtype)
        domains: dict[str, int] = {}
        train_domains: dict[str, int] = {}
        fields = FieldReader(text_field, domain_field)
        batch: list[tuple[str, str, bytes, bool]] = []
        chars = 0

        def flush() -> None:
            nonlocal batch, chars
            if not batch:
                return
            encoded = tok.encode_batch([t for t, _d, _b, _v in batch])
            for split in ("train", "val"):
                pick = [i for i, item in enumerate(batch) if item[3] == (split == "val")]
                pieces = [np.concatenate([sep, encoded[i].astype(tok.dtype, copy=False)]) for i in pick]
                doms = [domains.setdefault(batch[i][1], len(domains)) for i in pick]
                writers[split].add(pieces, doms, sum(len(batch[i][2]) for i in pick))
            batch, chars = [], 0

        documents = 0
        for text, domain in read_unit(unit, fields):
            if strip_nul:
                text = text.replace("\0", "")
            try:
                raw = text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates (JSON "\ud800"): no tokenizer can take them
                raw = text.encode("utf-8", errors="replace")
                text = raw.decode("utf-8")
            held_out = val_fraction > 0 and is_val(raw, seed, threshold)
            if not held_out:
                train_domains[domain] = train_domains.get(domain, 0) + 1
            batch.append((text, domain, raw, held_out))
            documents += 1
            chars += len(text)
            if chars >= BATCH_CHARS or len(batch) >= 4096:
                flush()
            if len(domains) > MAX_DOMAINS:
                raise DepthToolsError(f"{unit.path}: --domain-field {domain_field!r} has more than {MAX_DOMAINS} "
                                      "values; pick a coarser field (each domain gets its own validation split)")
        flush()
        parts = {s: w.close() for s, w in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    record = {"unit": index, "input": unit.to_dict(), "documents": documents, "domains": list(domains),
              "train_domain_documents": train_domains, "parts": parts, "seconds": time.perf_counter() - t0}
    _atomic_json(work / f"u{index:06d}.json", record)
    return record


def _run_unit(args: tuple) -> dict:
    return tokenize_unit(*args)


def unit_done(work: Path, index: int) -> dict | None:
    """The record of a finished unit whose part files are all there with the recorded sizes, else None."""
    try:
        record = json.loads((work / f"u{index:06d}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for split, part in record.get("parts", {}).items():
        stem = work / f"u{index:06d}.{split}"
        try:
            itemsize = (stem.with_name(stem.name + ".bin").stat().st_size // part["tokens"]) if part["tokens"] else 0
            if part["tokens"] and itemsize not in (2, 4):
                return None
            if (stem.with_name(stem.name + ".idx").stat().st_size != 8 * part["documents"]
                    or stem.with_name(stem.name + ".dom").stat().st_size != 2 * part["documents"]):
                return None
        except (OSError, KeyError, TypeError, ZeroDivisionError):
            return None
    return record


# ---------------------------------------------------------------- the whole preparation


def prepare_inputs(
    inputs: list[str | os.PathLike],
    out_dir: str | os.PathLike = "data",
    tokenizer: str = "byte",
    text_field: str = "text",
    domain_field: str | None = None,
    val_fraction: float = 0.005,
    seed: int = 0,
    name: str | None = None,
    workers: int = 1,
    shard_tokens: int = SHARD_TOKENS,
    sep_token: str | None = None,
    unit_bytes: int = UNIT_BYTES,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Tokenize the user's corpora (`--input`) into a sharded dataset folder and return it.

    `tokenizer`: "byte", "bpe4k"/"bpe8k" (trained on up to 256 MB of the train split) or a path to a
    local `tokenizers` file. Idempotent like `prepare`: the same settings return the finished folder
    at once; other settings in an existing folder are refused unless force=True. An interrupted run
    (Ctrl-C, a killed worker, a crash) continues from its finished units when called again.
    """
    log = log or (lambda _msg: None)
    if name is not None:  # one folder under out_dir, checked before anything
        check_name(name, "dataset name (--name)")
    if not 0.0 <= val_fraction < 1.0:
        raise DepthToolsError(f"val_fraction {val_fraction} must be in [0, 1)")
    if workers < 1:
        raise DepthToolsError(f"--workers must be >= 1, got {workers}")
    if shard_tokens < 1024:
        raise DepthToolsError(f"--shard-tokens must be >= 1024, got {shard_tokens}")
    check_dir_target(out_dir, "data folder (--out)")
    sources = expand_inputs(list(inputs))
    _note_unchecked(sources, log)
    units = plan_units(sources, unit_bytes)
    tok = resolve_tokenizer(tokenizer, sep_token, units, text_field, domain_field, seed, val_fraction, log)
    n_files = sum(len(f) for _k, f in sources)
    target = Path(out_dir) / (name or default_name(sources, tok))
    settings = {"format": FORMAT_SHARDS,
                "files": [[k, [str(f.resolve()) for f in files]] for k, files in sources],
                "inputs_state": sources_state(sources), "text_field": text_field, "domain_field": domain_field,
                "tokenizer": tok.fingerprint(), "sep_token": getattr(tok, "sep_token", None) if tok.name != "byte" else None,
                "val_fraction": val_fraction, "seed": seed, "shard_tokens": shard_tokens}
    partial = target.with_name(f".{target.name}.partial")
    if is_prepared(target, settings):
        shutil.rmtree(partial, ignore_errors=True)  # left by a run stopped right after its final rename
        log(f"{target}: already prepared with these settings")
        return target
    with dataset_lock(target, log):
        if is_prepared(target, settings):  # prepared by the process that held the lock a moment ago
            log(f"{target}: already prepared with these settings")
            return target
        if not force:
            check_overwrite(target, settings)
        _start_partial(partial, {**settings, "unit_bytes": unit_bytes}, log)  # the units depend on it, the result not
        try:
            meta = _prepare_in(partial, target, units, sources, tok, settings, text_field, domain_field, seed,
                               val_fraction, workers, shard_tokens, n_files, log)
        except _WorkerDied:
            raise  # the finished units are kept: running the same command again continues from them
        except DepthToolsError:
            # Bad input (a damaged file, no text at all, too many domains): fixing it changes the inputs'
            # fingerprint, which discards this partial work anyway; so it goes now, not as a hidden folder.
            shutil.rmtree(partial, ignore_errors=True)
            raise
        log(f"{target}: " + ", ".join(f"{k} {v['tokens']:,} tokens in {len(v['shards'])} shard(s)"
                                      for k, v in meta["splits"].items() if k in ("train", "val"))
            + f"; {meta['seconds']:.1f}s")
    return target


def _note_unchecked(sources, log) -> None:
    """A log line when .zst inputs carry no content checksum (damage inside them could go unnoticed)."""
    unchecked = [f for kind, files in sources if kind.endswith(":zstd") for f in files if zstd_without_checksum(f)]
    if unchecked:
        more = f" and {len(unchecked) - 1} more" if len(unchecked) > 1 else ""
        log(f"note: {unchecked[0]}{more}: no zstd content checksum, so damage inside cannot always be detected "
            "(compress with the zstd tool, which stores one by default)")


class _WorkerDied(DepthToolsError):
    """A tokenizer worker process was killed: the preparation can continue from its finished units."""


def _prepare_in(partial: Path, target: Path, units: list[Unit], sources, tok, settings: dict, text_field: str,
                domain_field: str | None, seed: int, val_fraction: float, workers: int, shard_tokens: int,
                n_files: int, log) -> dict:
    """Tokenize the units not yet done into `partial/work`, assemble the shards in `partial/out` and swap
    them into `target`; returns the manifest (meta.json) plus the seconds it took."""
    work = partial / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    total_bytes = sum(u.size for u in units)
    records: dict[int, dict] = {}
    for i in range(len(units)):
        done = unit_done(work, i)
        if done is not None:
            records[i] = done
    todo = [i for i in range(len(units)) if i not in records]
    log(f"{n_files} input file(s), {total_bytes:,} bytes in {len(units)} unit(s); tokenizer {tok.name} "
        f"(vocab {tok.vocab_size:,}, {np.dtype(tok.dtype).name})"
        + (f"; continuing: {len(records)} unit(s) already done" if records else ""))
    args = [(i, units[i], str(work), text_field, domain_field, seed, val_fraction) for i in todo]
    _tokenize_all(args, tok, workers, records, log, len(units))
    tokenize_s = time.perf_counter() - t0
    done_bytes = sum(units[i].size for i in todo)
    log(f"tokenized {len(todo)} unit(s), {done_bytes:,} bytes in {tokenize_s:.1f}s"
        + (f" ({done_bytes / tokenize_s / 1e6:.1f} MB/s)" if tokenize_s > 0 and todo else ""))
    check_some_text([records[i] for i in range(len(units))], sources, text_field)
    out = partial / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    meta = _assemble(out, work, [records[i] for i in range(len(units))], tok, settings, shard_tokens, target.name,
                     sources)
    if meta.get("val_from_tail"):
        log(f"note: no whole document fell in val (one long text?), so its last {meta['val_from_tail']['tokens']:,} "
            "tokens are held out as the validation split")
    tok.save(out)
    _atomic_json(out / "meta.json", meta)
    replace_dir(out, target)
    shutil.rmtree(partial, ignore_errors=True)
    return {**meta, "seconds": time.perf_counter() - t0}


def check_some_text(records: list[dict], sources, text_field: str) -> None:
    """Refuse inputs that hold no text at all (an empty file, only blank lines, every text field empty or
    null): that is a mistake to report, not a 0-token dataset that fails later in training."""
    text_bytes = sum(r["parts"][s]["bytes"] for r in records for s in ("train", "val"))
    if text_bytes:
        return
    files = [str(f) for _kind, fs in sources for f in fs]
    named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    documents = sum(r["documents"] for r in records)
    found = (f"{documents:,} record(s), every {text_field!r} empty or null" if documents
             else "no records")
    raise DepthToolsError(f"--input {named}: no text at all ({found}); nothing to tokenize — check the file(s) "
                          "and --text-field")


def _start_partial(partial: Path, settings: dict, log) -> None:
    """Keep an interrupted preparation with the same settings; discard one with other settings."""
    path = partial / "settings.json"
    if partial.exists():
        try:
            same = json.loads(path.read_text(encoding="utf-8")) == settings
        except (OSError, ValueError):
            same = False
        if same:
            return
        log(f"{partial}: discarding an interrupted preparation with other settings")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    _atomic_json(path, settings)


def _tokenize_all(args: list[tuple], tok, workers: int, records: dict[int, dict], log, total: int) -> None:
    if not args:
        return
    if workers == 1 or len(args) == 1:
        for a in args:
            records[a[0]] = tokenize_unit(*a, tok=tok)
            _progress(log, records, a[0], total)
        return

    context = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    # One tokenizer thread per worker process (the workers are the parallelism); set before the
    # fork so the children start with it and `tokenizers` does not warn about forking.
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ProcessPoolExecutor(max_workers=min(workers, len(args)), mp_context=context,
                                   initializer=_init_worker, initargs=(_tokenizer_record(tok),))
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    try:
        with pool:
            for record in pool.map(_run_unit, args):
                records[record["unit"]] = record
                _progress(log, records, record["unit"], total)
    except BrokenProcessPool:
        raise _WorkerDied(f"a tokenizer worker process died (killed, or out of memory) after {len(records)} "
                              "unit(s) were done; run the same command again to continue from there") from None


_LAST_LOG = [0.0]


def _progress(log, records: dict, index: int, total: int) -> None:
    """One line per unit for small jobs, else at most one every 10 s."""
    now = time.monotonic()
    if total > 20 and now - _LAST_LOG[0] < 10 and len(records) < total:
        return
    _LAST_LOG[0] = now
    r = records[index]
    log(f"unit {index}: {r['documents']:,} documents, "
        f"{r['parts']['train']['tokens'] + r['parts']['val']['tokens']:,} tokens ({len(records)}/{total} done)")


# ---------------------------------------------------------------- assembling fixed-size shards


class _ShardWriter:
    """Writes one split as consecutive shards of exactly `shard_tokens` tokens (the last one shorter)."""

    def __init__(self, folder: Path, rel: str, dtype, shard_tokens: int):
        self.folder, self.rel, self.dtype, self.shard_tokens = folder, rel, np.dtype(dtype), shard_tokens
        folder.mkdir(parents=True, exist_ok=True)
        self.shards: list[dict] = []
        self.split_sha = hashlib.sha256()
        self.tokens = self.documents = 0
        self._open()

    def _open(self) -> None:
        i = len(self.shards)
        self.file = open(self.folder / f"{i:05d}.bin", "wb")
        self.idx = open(self.folder / f"{i:05d}.idx", "wb")
        self.sha, self.n, self.docs = hashlib.sha256(), 0, 0

    def _close(self) -> None:
        self.file.close()
        self.idx.close()
        i = len(self.shards)
        self.shards.append({"file": f"{self.rel}/{i:05d}.bin", "index": f"{self.rel}/{i:05d}.idx", "tokens": self.n,
                            "documents": self.docs, "sha256": self.sha.hexdigest()})

    def write(self, tokens: np.ndarray, starts: np.ndarray) -> None:
        """Append tokens; `starts` are document starts relative to `tokens`."""
        pos = 0
        starts = np.asarray(starts, dtype=np.uint64)
        while pos < len(tokens):
            if self.n == self.shard_tokens:
                self._close()
                self._open()
            take = min(self.shard_tokens - self.n, len(tokens) - pos)
            piece = np.ascontiguousarray(tokens[pos:pos + take], dtype=self.dtype)
            inside = starts[(starts >= pos) & (starts < pos + take)] - np.uint64(pos) + np.uint64(self.n)
            self.file.write(piece.tobytes())
            self.idx.write(inside.astype(np.uint64).tobytes())
            self.sha.update(piece.tobytes())
            self.split_sha.update(piece.tobytes())
            self.n += take
            self.docs += int(inside.size)
            self.documents += int(inside.size)
            self.tokens += take
            pos += take

    def finish(self) -> dict:
        self._close()
        if len(self.shards) > 1 and self.shards[-1]["tokens"] == 0:  # never an empty trailing shard
            last = self.shards.pop()
            (self.folder / Path(last["file"]).name).unlink()
            (self.folder / Path(last["index"]).name).unlink()
        return {"shards": self.shards, "tokens": self.tokens, "documents": self.documents,
                "sha256": self.split_sha.hexdigest(), "dtype": self.dtype.name}


def _part(work: Path, unit: int, split: str, dtype, documents: int):
    stem = work / f"u{unit:06d}.{split}"
    n = os.path.getsize(f"{stem}.bin") // np.dtype(dtype).itemsize
    tokens = np.memmap(f"{stem}.bin", dtype=dtype, mode="r") if n else np.zeros(0, dtype=dtype)
    starts = np.fromfile(f"{stem}.idx", dtype=np.uint64) if documents else np.zeros(0, dtype=np.uint64)
    doms = np.fromfile(f"{stem}.dom", dtype=np.uint16) if documents else np.zeros(0, dtype=np.uint16)
    return tokens, starts, doms


CHUNK_TOKENS = 1 << 24  # tokens copied per step while assembling (memory stays flat)


def _assemble(out: Path, work: Path, records: list[dict], tok, settings: dict, shard_tokens: int, name: str,
              sources) -> dict:
    dtype = tok.dtype
    splits: dict[str, dict] = {}
    total_train = sum(r["parts"]["train"]["tokens"] for r in records)
    moved = held_out_tail(records, settings)
    for split in ("train", "val"):
        writer = _ShardWriter(out / split, split, dtype, shard_tokens)
        if split == "val" and moved:
            _write_tail(writer, work, records, dtype, total_train - moved, tok.sep_id)
        offset = 0
        for r in records:
            tokens, starts, _doms = _part(work, r["unit"], split, dtype, r["parts"][split]["documents"])
            if split == "train" and moved:  # the train stream stops where the held-out tail begins
                keep = max(0, min(len(tokens), total_train - moved - offset))
                offset += len(tokens)
                tokens, starts = tokens[:keep], starts[starts < np.uint64(keep)]
            for lo in range(0, len(tokens), CHUNK_TOKENS):
                hi = min(lo + CHUNK_TOKENS, len(tokens))
                inside = starts[(starts >= lo) & (starts < hi)] - np.uint64(lo)
                writer.write(tokens[lo:hi], inside)
        splits[split] = writer.finish()
    domain_names = sorted({d for r in records for d in _val_domains(r)})
    if len(domain_names) > MAX_DOMAINS:
        raise DepthToolsError(f"--domain-field {settings['domain_field']!r} has {len(domain_names)} values in the "
                              f"validation split, more than {MAX_DOMAINS}; pick a coarser field")
    for domain in domain_names:
        key = f"val_{_safe(domain)}"
        writer = _ShardWriter(out / key, key, dtype, shard_tokens)
        for r in records:
            local = r["domains"].index(domain) if domain in r["domains"] else None
            if local is None or not r["parts"]["val"]["documents"]:
                continue
            tokens, starts, doms = _part(work, r["unit"], "val", dtype, r["parts"]["val"]["documents"])
            ends = np.append(starts[1:], np.uint64(len(tokens)))
            for s, e in zip(starts[doms == local], ends[doms == local]):
                writer.write(tokens[int(s):int(e)], np.zeros(1, dtype=np.uint64))
        splits[key] = {**writer.finish(), "domain": domain}
    train_domains: dict[str, int] = {}
    for r in records:
        for d, n in r["train_domain_documents"].items():
            train_domains[d] = train_domains.get(d, 0) + n
    data_fp = data_fingerprint(tok.fingerprint(), splits)
    return {
        "format": FORMAT_SHARDS, "name": name, "settings": settings, "dtype": np.dtype(dtype).name,
        "layout": "shards", "shard_tokens": shard_tokens,
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "sep_id": tok.sep_id,
                      "sep_token": None if tok.name == "byte" else tok.sep_token,
                      "fingerprint": tok.fingerprint(), "file": "tokenizer.json"},
        "separator": f"token {tok.sep_id} precedes every document",
        "data_fingerprint": data_fp, "fingerprint_scope": FINGERPRINT_SCOPE,
        "sources": [{"kind": k, "files": len(files), "bytes": sum(f.stat().st_size for f in files),
                     "first": str(files[0])} for k, files in sources],
        "documents": sum(r["documents"] for r in records),
        "input_bytes": sum(r["parts"]["train"]["bytes"] + r["parts"]["val"]["bytes"] for r in records),
        "train_domain_documents": train_domains,
        "domains": domain_names,
        "splits": splits,
        "val_domain_files": {s["domain"]: s["shards"][0]["file"] for s in splits.values() if "domain" in s},
        "val_from_tail": ({"tokens": moved, "why": "no whole document fell in val (e.g. one long text file): the "
                           "last tokens of the train stream were held out as one validation document"}
                          if moved else None),
    }


TAIL_MIN_TOKENS = 4096  # a document cut for validation gives val at least this many tokens (or a tenth of it)


def held_out_tail(records: list[dict], settings: dict) -> int:
    """Tokens to cut from the end of the train stream into val when no whole document was held out (one long
    text file is one document, so val would be empty and every probe's default --split val would fail):
    max(val_fraction x train tokens, min(TAIL_MIN_TOKENS, a tenth of them)); 0 when val has documents,
    val_fraction is 0, domains are split (val_<domain> needs whole documents) or the text is tiny."""
    if settings.get("val_fraction", 0) <= 0 or settings.get("domain_field"):
        return 0
    if any(r["parts"]["val"]["documents"] for r in records):
        return 0
    total = sum(r["parts"]["train"]["tokens"] for r in records)
    if total < 20:
        return 0
    return max(int(round(settings["val_fraction"] * total)), min(TAIL_MIN_TOKENS, total // 10))


def _write_tail(writer: "_ShardWriter", work: Path, records: list[dict], dtype, start: int, sep_id: int) -> None:
    """Write the train stream's tokens from global position `start` on as one document (a separator first)."""
    writer.write(np.array([sep_id], dtype=dtype), np.zeros(1, dtype=np.uint64))
    offset = 0
    for r in records:
        tokens, _starts, _doms = _part(work, r["unit"], "train", dtype, r["parts"]["train"]["documents"])
        lo = max(0, start - offset)
        offset += len(tokens)
        for a in range(lo, len(tokens), CHUNK_TOKENS):
            writer.write(tokens[a:min(a + CHUNK_TOKENS, len(tokens))], np.zeros(0, dtype=np.uint64))


def _val_domains(record: dict) -> list[str]:
    if not record["parts"]["val"]["documents"]:
        return []
    return list(record["domains"])


def _safe(domain: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", domain)


def _atomic_json(path: Path, obj) -> None:
    """A unit record or a staged meta/settings file: atomic, not fsynced, keys in order, one-space indent."""
    atomic_write_json(path, obj, indent=1, sort_keys=False, fsync=False)


# ---------------------------------------------------------------- tokenizer and name


def resolve_tokenizer(spec: str, sep_token: str | None, units: list[Unit], text_field: str, domain_field: str | None,
                      seed: int, val_fraction: float, log):
    """byte, bpe4k/bpe8k (trained here on the train split) or a local tokenizer.json."""
    if spec == "byte":
        if sep_token:
            raise DepthToolsError("--sep-token applies to a tokenizer file; the byte tokenizer's separator is NUL")
        return ByteTokenizer()
    if spec in BPE_SIZES:
        t0 = time.perf_counter()
        tok = BPETokenizer.train(_train_sample(units, text_field, domain_field, seed, val_fraction),
                                 vocab_size=BPE_SIZES[spec])
        log(f"{spec}: trained on the train split (up to {BPE_SAMPLE_BYTES // 2**20} MB) in {time.perf_counter() - t0:.1f}s")
        return tok
    if is_tokenizer_file(spec):
        probe = BPETokenizer.from_file(spec, sep_token=sep_token)
        probe.check_separator(spec)
        return BPETokenizer.from_file(spec, sep_token=sep_token, name=file_tokenizer_name(spec, probe.vocab_size))
    raise DepthToolsError(f"unknown tokenizer {spec!r}; valid: {', '.join(TOKENIZER_SPECS)}, or a path to a tokenizer.json")


def _train_sample(units, text_field, domain_field, seed, val_fraction) -> Iterator[str]:
    fields, threshold, taken = FieldReader(text_field, domain_field), val_threshold(val_fraction), 0
    for unit in units:
        for text, _domain in read_unit(unit, fields):
            raw = text.encode("utf-8", errors="replace")
            if val_fraction > 0 and is_val(raw, seed, threshold):
                continue
            yield text
            taken += len(raw)
            if taken >= BPE_SAMPLE_BYTES:
                return


def default_name(sources, tok) -> str:
    first = sources[0][1][0]
    many = sum(len(files) for _k, files in sources) > 1
    stem = first.parent.resolve().name if many else first.name
    stem = re.sub(r"(\.(jsonl|ndjson|json|parquet|arrow|gz|zst|zstd|txt))+$", "", stem, flags=re.I)
    stem = re.sub(r"[^A-Za-z0-9_.+-]+", "-", stem).strip("-.") or "input"
    return stem if tok.name == "byte" else f"{stem}-{tok.name}"


# ---------------------------------------------------------------- reading back

def verify(data_dir: str | os.PathLike) -> list[str]:
    """Recompute every data file's sha256 against the manifest; returns the files that differ."""
    return changed_data_files(data_dir)
