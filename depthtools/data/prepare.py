"""Turn corpora into token files: `data/<name>/{train,val,val_<domain>}.bin` + `tokenizer.json` + `meta.json`.

Layout of every .bin: flat np.uint16 token ids; each document is preceded by the tokenizer's
separator id (0: the NUL byte for `byte`, `<|endoftext|>` for BPE), so a model always sees a
document start after a separator and never mistakes a boundary for content.

Splits are by whole documents, stratified per (corpus, domain) and decided by a seeded hash of the
document name, so they are deterministic, independent of file order, and no document is in both.
`val_<domain>.bin` holds the same validation documents grouped by domain, for per-domain losses.
`meta.json` is written last and the directory is swapped in atomically, so a present meta.json
means a complete dataset; calling `prepare` again with the same settings returns at once.

The user's own corpora (`prepare_inputs`, `data prepare --input`) use the sharded layout of
`depthtools.data.shards` instead; `read_meta` and `load_split` read either layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from depthtools.data.corpora import CORPORA, MIXES, Corpus, Document, cache_root, text_dir_corpus
from depthtools.data.digest_cache import DigestCache
from depthtools.data.sharded_tokens import load_sharded
from depthtools.data.tokenizer import (
    BPE_SIZES,
    TOKENIZER_SPECS,
    BPETokenizer,
    ByteTokenizer,
    file_tokenizer_name,
    is_tokenizer_file,
)
from depthtools.errors import DepthToolsError
from depthtools.fsutil import (
    atomic_write_json,
    check_dir_target,
    check_name,
    dir_mode,
    exclusive_lock,
    file_sha256,
    json_section,
    read_json_object,
    replace_dir,
    write_error,
)

FORMAT = "depthtools.data/1"
FORMAT_SHARDS = "depthtools.data.shards/1"  # depthtools.data.shards (kept here so reading needs no import)
META_FILE = "meta.json"
SPLITS_FILE = "splits.json"
TOKEN_DTYPE = np.uint16


@dataclass(frozen=True)
class _Part:
    """A corpus's contribution after extraction, capping and splitting."""

    corpus: Corpus
    train: list[Document]
    val: list[Document]
    source_info: dict


def prepare(
    corpus: str | list[str] = "default",
    out_dir: str | os.PathLike = "data",
    tokenizer: str = "byte",
    val_fraction: float = 0.05,
    seed: int = 0,
    max_bytes: int | None = None,
    text_dir: str | os.PathLike | None = None,
    name: str | None = None,
    log: Callable[[str], None] | None = None,
    force: bool = False,
) -> Path:
    """Prepare a corpus or a MIX ("shakespeare+sympy", a list, or "default") and return its directory.

    `max_bytes` caps each corpus's extracted text (the mix `default` caps at 1.5 MB per corpus unless
    you pass one). Idempotent: an existing dataset with identical settings is returned untouched (an
    incomplete one is rebuilt). A folder holding anything else — a dataset with other settings, which
    checkpoints trained on it still name, or files that are not a dataset — is refused
    (DepthToolsError) unless force=True, which rebuilds it in place.
    """
    log = log or (lambda _msg: None)
    if name is not None:  # one folder under out_dir, checked before anything
        check_name(name, "dataset name (--name)")
    corpora, default_cap, mix_name = resolve_corpora(corpus, text_dir)
    _validate(tokenizer, val_fraction, max_bytes)
    cap = max_bytes if max_bytes is not None else default_cap
    file_tok = _file_tokenizer(tokenizer) if is_tokenizer_file(tokenizer) else None
    check_dir_target(out_dir, "data folder (--out)")
    target = Path(out_dir) / (name or _default_name(mix_name, file_tok.name if file_tok else tokenizer))
    settings = _settings(corpora, f"file:{file_tok.fingerprint()}" if file_tok else tokenizer, val_fraction, seed,
                         cap, text_dir)
    if is_prepared(target, settings):
        log(f"{target}: already prepared with these settings")
        return target
    with dataset_lock(target, log):
        if is_prepared(target, settings):  # prepared by the process that held the lock a moment ago
            log(f"{target}: already prepared with these settings")
            return target
        if not force:
            check_overwrite(target, settings)
        t0 = time.perf_counter()
        parts = [_extract_part(c, cap, val_fraction, seed, log) for c in corpora]
        tok = file_tok or _make_tokenizer(tokenizer, parts, log)
        _write_dataset(target, parts, tok, settings, seed, log)
        log(f"{target}: prepared in {time.perf_counter() - t0:.1f}s")
    return target


def dataset_lock(target: Path, log=None) -> exclusive_lock:
    """The lock one preparation of `target` holds: `.<name>.lock` beside it (the dataset folder itself is
    swapped in by rename, which would take a lock inside it along); a second process is refused."""
    return exclusive_lock(target.with_name(f".{target.name}.lock"), f"dataset {target}", log=log)


def resolve_corpora(corpus: str | list[str], text_dir) -> tuple[list[Corpus], int | None, str]:
    """Parse a corpus name, a MIX "a+b" or a list into Corpus objects; also the mix's default cap and name."""
    default_cap = None
    if isinstance(corpus, str) and corpus in MIXES:
        names, default_cap = list(MIXES[corpus][0]), MIXES[corpus][1]
        mix_name = corpus
    else:
        names = corpus.split("+") if isinstance(corpus, str) else list(corpus)
        names = [n.strip() for n in names]
        mix_name = "+".join(names)
    valid = [*CORPORA, "text-dir", *MIXES]
    for n in names:
        if n not in CORPORA and n != "text-dir":
            raise DepthToolsError(f"unknown corpus {n!r}; valid: {', '.join(valid)} (join several with '+')")
    if len(set(names)) != len(names) or not names:
        raise DepthToolsError(f"corpus mix {mix_name!r} must name each corpus once")
    if "text-dir" in names and text_dir is None:
        raise DepthToolsError("corpus 'text-dir' needs --text-dir DIR (a folder of UTF-8 files)")
    if text_dir is not None and "text-dir" not in names:
        raise DepthToolsError(f"--text-dir given but corpus {mix_name!r} does not include text-dir; use --corpus text-dir or e.g. {mix_name}+text-dir")
    return [text_dir_corpus(Path(text_dir)) if n == "text-dir" else CORPORA[n] for n in names], default_cap, mix_name


def _validate(tokenizer: str, val_fraction: float, max_bytes: int | None) -> None:
    if tokenizer not in TOKENIZER_SPECS and not is_tokenizer_file(tokenizer):
        raise DepthToolsError(f"unknown tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZER_SPECS)}, "
                              "or a path to a tokenizer.json")
    if not 0.0 <= val_fraction < 1.0:
        raise DepthToolsError(f"val_fraction {val_fraction} must be in [0, 1)")
    if max_bytes is not None and max_bytes <= 0:
        raise DepthToolsError(f"max_bytes {max_bytes} must be a positive number of bytes")


def _file_tokenizer(path) -> BPETokenizer:
    """A user's tokenizer file for the single-file (uint16) layout of the package corpora."""
    tok = BPETokenizer.from_file(path)
    tok.check_separator(path)
    if tok.vocab_size > 65536:
        raise DepthToolsError(f"{path}: {tok.vocab_size:,} tokens do not fit the uint16 token files of --corpus; "
                              "prepare the text with --input (sharded, uint32 ids) instead")
    return BPETokenizer.from_file(path, name=file_tokenizer_name(path, tok.vocab_size))


def _default_name(mix_name: str, tokenizer: str) -> str:
    return mix_name if tokenizer == "byte" else f"{mix_name}-{tokenizer}"


def _settings(corpora, tokenizer, val_fraction, seed, cap, text_dir) -> dict:
    """Everything that determines the output; equal settings mean `prepare` has nothing to do."""
    out = {"format": FORMAT, "corpora": [c.name for c in corpora], "tokenizer": tokenizer,
           "val_fraction": val_fraction, "seed": seed, "max_bytes": cap}
    if text_dir is not None:
        out["text_dir"] = str(Path(text_dir).expanduser().resolve())
        out["text_dir_state"] = _dir_state(Path(text_dir).expanduser())
    return out


def _dir_state(directory: Path) -> str:
    """Cheap fingerprint of a folder (names, sizes, mtimes), so edits to --text-dir trigger a rebuild."""
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(directory)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:12] + "…"


def check_overwrite(target: Path, settings: dict) -> None:
    """Refuse to replace `target` unless it is absent, empty, or an (incomplete) dataset with these settings.

    A dataset's content is what trained checkpoints record (its data fingerprint), so rebuilding it
    with other settings would silently change what they are later evaluated on.
    """
    if not target.exists():
        return
    if not target.is_dir():
        raise DepthToolsError(f"{target} exists and is not a folder; pass force=True (depthtools data prepare --force) "
                              "to replace it, or choose another --name")
    if not any(target.iterdir()):
        return
    try:
        meta = json.loads((target / META_FILE).read_text(encoding="utf-8"))
        old = meta["settings"]
        if not isinstance(old, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise DepthToolsError(f"{target} is not empty and holds no readable dataset ({META_FILE}); pass force=True "
                              "(depthtools data prepare --force) to replace it, or choose another --name") from None
    if old == settings:
        return  # the same dataset, incomplete: rebuilding it restores the same content
    changed = [f"{k}: {_short(old.get(k))} -> {_short(settings.get(k))}"
               for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    raise DepthToolsError(f"{target} already holds a dataset prepared with other settings ({'; '.join(changed)}); "
                          "checkpoints trained on it record its fingerprint, so it is not overwritten: pass force=True "
                          "(depthtools data prepare --force) to rebuild it, or choose another --name")


def is_prepared(target: Path, settings: dict) -> bool:
    """True if `target` holds a complete dataset built with exactly `settings`."""
    try:
        meta = json.loads((target / META_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if meta.get("settings") != settings:
        return False
    if not (target / meta.get("tokenizer", {}).get("file", "tokenizer.json")).is_file():
        return False
    itemsize = np.dtype(meta.get("dtype", "uint16")).itemsize
    files = [(f["file"], f["tokens"]) for s in meta.get("splits", {}).values() for f in s.get("shards", [s])]
    return all((target / f).is_file() and (target / f).stat().st_size == itemsize * n for f, n in files)


# ---------------------------------------------------------------- extraction, capping, splitting


def _extract_part(corpus: Corpus, cap: int | None, val_fraction: float, seed: int, log) -> _Part:
    t0 = time.perf_counter()
    ex = corpus.extract(cache_root())
    docs = cap_documents(ex.documents, cap)
    train, val = split_documents(docs, corpus, val_fraction, seed)
    used = sum(len(d.text.encode("utf-8")) for d in docs)
    log(f"{corpus.name}: {len(ex.documents)} documents, {ex.n_bytes:,} bytes (version {ex.package_version}); "
        f"using {len(docs)} documents, {used:,} bytes; {time.perf_counter() - t0:.1f}s")
    info = {"corpus": corpus.name, "domain": corpus.domain, "license": corpus.license, "source": corpus.source,
            "package_version": ex.package_version, "documents": len(ex.documents), "bytes": ex.n_bytes,
            "sha256": ex.sha256, "expected_sha256": corpus.expected_sha256, "expected_version": corpus.package_version,
            "checksum_ok": None if corpus.expected_sha256 is None else ex.sha256 == corpus.expected_sha256,
            "documents_used": len(docs), "bytes_used": used, "train_documents": len(train), "val_documents": len(val)}
    return _Part(corpus, train, val, info)


def _rank(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode("utf-8")).hexdigest()


def cap_documents(docs: list[Document], max_bytes: int | None) -> list[Document]:
    """Keep whole documents in a fixed pseudo-random order (sha256 of the name) up to `max_bytes`.

    The order does not depend on the seed, so a cap picks the same text for every split seed and a
    representative spread rather than the alphabetical head. The last document is cut at a line
    boundary to fill the cap, so even one huge document yields something. Result is in name order.
    """
    if max_bytes is None:
        return docs
    kept, total = [], 0
    for d in sorted(docs, key=lambda d: _rank(d.name)):
        size = len(d.text.encode("utf-8"))
        if total + size <= max_bytes:
            kept.append(d)
            total += size
            continue
        head = d.text.encode("utf-8")[: max_bytes - total].decode("utf-8", errors="ignore")
        head = head[: head.rfind("\n") + 1] or head
        if head:
            kept.append(Document(d.name, head, d.domain))
        break
    return sorted(kept, key=lambda d: d.name)


def split_documents(docs: list[Document], corpus: Corpus, val_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """Whole-document train/val split, stratified by domain; a group of n>=2 documents gives
    max(1, round(val_fraction*n)) (at most n-1) to val, chosen by sha256(seed, corpus, name)."""
    train, val = [], []
    groups: dict[str, list[Document]] = {}
    for d in docs:
        groups.setdefault(d.domain or corpus.domain, []).append(d)
    for domain, group in sorted(groups.items()):
        n = len(group)
        n_val = 0 if n < 2 or val_fraction == 0 else min(n - 1, max(1, round(val_fraction * n)))
        ranked = sorted(group, key=lambda d: _rank(seed, corpus.name, d.name))
        val += ranked[:n_val]
        train += ranked[n_val:]
    return train, val


def _domain(doc: Document, corpus: Corpus) -> str:
    return doc.domain or corpus.domain


# ---------------------------------------------------------------- tokenizing and writing


def _make_tokenizer(spec: str, parts: list[_Part], log):
    if spec == "byte":
        return ByteTokenizer()
    t0 = time.perf_counter()
    tok = BPETokenizer.train((d.text for p in parts for d in p.train), vocab_size=BPE_SIZES[spec])
    log(f"{spec}: trained on the train split in {time.perf_counter() - t0:.1f}s")
    return tok


def _encode_docs(tok, docs: list[Document]) -> np.ndarray:
    """[sep, doc0..., sep, doc1..., ...] as uint16."""
    if not docs:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    sep = np.array([tok.sep_id], dtype=TOKEN_DTYPE)
    pieces = []
    for ids in tok.encode_batch([d.text for d in docs]):
        pieces += [sep, ids]
    return np.concatenate(pieces)


def _write_dataset(target: Path, parts: list[_Part], tok, settings: dict, seed: int, log) -> None:
    """Build everything in a temporary sibling folder, then swap it in with renames."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(dir_mode())  # mkdtemp makes it private; the dataset is an ordinary folder (umask applies)
    try:
        t0 = time.perf_counter()
        train_docs = [(p.corpus, d) for p in parts for d in p.train]
        order = np.random.default_rng(seed).permutation(len(train_docs))  # interleave corpora in train.bin
        train_docs = [train_docs[i] for i in order]
        val_docs = [(p.corpus, d) for p in parts for d in p.val]
        splits = {"train": _write_split(tmp, "train", tok, train_docs), "val": _write_split(tmp, "val", tok, val_docs)}
        for domain in sorted({_domain(d, c) for c, d in val_docs}):
            key = f"val_{_safe(domain)}"
            splits[key] = _write_split(tmp, key, tok, [(c, d) for c, d in val_docs if _domain(d, c) == domain])
            splits[key]["domain"] = domain
        log(f"tokenized with {tok.name} in {time.perf_counter() - t0:.1f}s: "
            + ", ".join(f"{k} {v['tokens']:,}" for k, v in splits.items()))
        tok.save(tmp)
        _write_json(tmp / SPLITS_FILE, {"train": sorted(f"{c.name}/{d.name}" for c, d in train_docs),
                                         "val": sorted(f"{c.name}/{d.name}" for c, d in val_docs)})
        _write_json(tmp / META_FILE, _meta(target.name, parts, tok, settings, splits))
        replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _safe(domain: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", domain)


def _write_split(folder: Path, key: str, tok, docs) -> dict:
    tokens = _encode_docs(tok, [d for _c, d in docs])
    try:
        tokens.tofile(folder / f"{key}.bin")
    except OSError as exc:  # numpy names no file; a full disk is ENOSPC here
        raise write_error(exc, folder.parent / folder.name / f"{key}.bin") from None
    return {"file": f"{key}.bin", "tokens": int(tokens.size), "documents": len(docs),
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}


def _meta(name: str, parts: list[_Part], tok, settings: dict, splits: dict) -> dict:
    data_fp = data_fingerprint(tok.fingerprint(), splits)
    return {
        "format": FORMAT, "name": name, "settings": settings, "dtype": "uint16",
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "sep_id": tok.sep_id,
                      "fingerprint": tok.fingerprint(), "file": "tokenizer.json"},
        "separator": f"token {tok.sep_id} precedes every document",
        "data_fingerprint": data_fp, "fingerprint_scope": FINGERPRINT_SCOPE,
        "sources": [p.source_info for p in parts],
        "package_versions": {p.corpus.name: p.source_info["package_version"] for p in parts},
        "domains": sorted({s["domain"] for s in splits.values() if "domain" in s}),
        "splits": splits,
        "val_domain_files": {s["domain"]: s["file"] for s in splits.values() if "domain" in s},
    }


def _write_json(path: Path, obj) -> None:
    """A file of the staging folder (swapped in whole by replace_dir): atomic, not fsynced, keys in order."""
    atomic_write_json(path, obj, sort_keys=False, fsync=False)



# ---------------------------------------------------------------- reading back


def read_meta(data_dir: str | os.PathLike) -> dict:
    """The meta.json of a prepared dataset; a clear error if the folder is not one."""
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise DepthToolsError(f"{data_dir}: no {META_FILE}; prepare it with `depthtools data prepare`")
    meta = read_json_object(path, "a dataset's metadata", hint="; prepare it again")
    if meta.get("format") not in (FORMAT, FORMAT_SHARDS):
        raise DepthToolsError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r} or {FORMAT_SHARDS!r}; "
                              "prepare it again")
    splits = json_section(meta, "splits", path)
    tokenizer = json_section(meta, "tokenizer", path)
    for key, split in splits.items():
        if not isinstance(split, dict) or not isinstance(split.get("tokens"), int):
            raise DepthToolsError(f"{path}: split {key!r} is not a record with a token count; prepare it again")
    if "train" not in splits:
        raise DepthToolsError(f"{path}: no 'train' split; prepare it again")
    if not isinstance(tokenizer.get("vocab_size"), int) or isinstance(tokenizer.get("vocab_size"), bool):
        raise DepthToolsError(f"{path}: tokenizer.vocab_size must be an integer, got {tokenizer.get('vocab_size')!r}; "
                              "prepare it again")
    files = _split_files(splits, path)
    if tokenizer.get("file") is not None:  # a run copies it into its cell: it must stay a name inside the folder
        check_name(tokenizer["file"], f"{path}: tokenizer.file")
        if tokenizer["file"] in (META_FILE, SPLITS_FILE, *files):
            raise DepthToolsError(f"{path}: tokenizer.file {tokenizer['file']!r} names the dataset's own "
                                  f"{'metadata' if tokenizer['file'] in (META_FILE, SPLITS_FILE) else 'token'} file, "
                                  "not a tokenizer; prepare it again")
    for domain, name in (meta.get("val_domain_files") or {}).items():
        _data_file_name(name, f"{path}: val_domain_files[{domain!r}]")
    check_data_fingerprint(meta, path)
    return meta


def _data_file_name(name, where: str) -> str:
    """A data file named in meta.json, confined to the dataset folder: a relative path whose every
    component passes `check_name` ('train.bin', 'train/00000.bin'; not '../x', '/abs' or 'a//b')."""
    if not isinstance(name, str):
        raise DepthToolsError(f"{where} must be a file name, not {type(name).__name__} {name!r}"[:300])
    for part in name.split("/"):
        check_name(part, f"{where} ({name!r}, a file inside the dataset folder)")
    return name


def _split_files(splits: dict, path: Path) -> list[str]:
    """Every token and index file the splits name (each confined by `_data_file_name`)."""
    files = []
    for key, split in splits.items():
        if "shards" in split:
            shards = split["shards"]
            if not isinstance(shards, list) or not all(isinstance(s, dict) and isinstance(s.get("tokens"), int)
                                                       for s in shards):
                raise DepthToolsError(f"{path}: splits.{key}.shards is not a list of shard records; prepare it again")
            for i, shard in enumerate(shards):
                files.append(_data_file_name(shard.get("file"), f"{path}: splits.{key}.shards[{i}].file"))
                if "index" in shard:
                    files.append(_data_file_name(shard["index"], f"{path}: splits.{key}.shards[{i}].index"))
        else:
            files.append(_data_file_name(split.get("file"), f"{path}: splits.{key}.file"))
    return files


FINGERPRINT_SCOPE = "tokenizer+splits"  # meta.json "fingerprint_scope" of datasets whose fingerprint covers every split


def data_fingerprint(tokenizer_fingerprint: str, splits: dict) -> str:
    """The dataset's fingerprint, which checkpoints record and resume compares: the sha256 of the
    tokenizer's fingerprint and, for every split, its name, sha256 and the name and sha256 of each of
    its files, so that another file (renamed, or its contents changed) gives another fingerprint."""
    parts = [tokenizer_fingerprint]
    for key in sorted(splits):
        split = splits[key]
        parts += [key, str(split.get("sha256"))]
        for shard in split.get("shards", [split]):
            parts += [str(shard.get("file")), str(shard.get("sha256"))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def check_data_fingerprint(meta: dict, path: Path) -> None:
    """meta.json's data_fingerprint must be the one its records give (`data_fingerprint`; datasets
    prepared before it covered every split: the tokenizer, train and val sha256s only), so a split
    record edited by hand (another file, another sha256) is refused rather than trained on under the
    old fingerprint."""
    splits, tok = meta["splits"], meta["tokenizer"]
    if meta.get("fingerprint_scope") == FINGERPRINT_SCOPE:
        expected = data_fingerprint(str(tok.get("fingerprint")), splits)
    else:
        expected = hashlib.sha256("\0".join([str(tok.get("fingerprint")), str(splits["train"].get("sha256")),
                                              str((splits.get("val") or {}).get("sha256"))]).encode()).hexdigest()
    if meta.get("data_fingerprint") != expected:
        raise DepthToolsError(f"{path}: data_fingerprint {str(meta.get('data_fingerprint'))[:12]!r} is not the one its "
                              f"tokenizer and split records give ({expected[:12]}): meta.json was edited; prepare it again")


def changed_data_files(data_dir: str | os.PathLike, meta: dict | None = None, cached: bool = False) -> list[str]:
    """The data files whose sha256 differs from the one meta.json records (missing ones included):
    every shard of a sharded dataset, every split file of a single-file one. Reads all the data once;
    `cached`: only the files whose stat key changed since their digest last matched (`digest_cache`)."""
    data_dir = Path(data_dir)
    meta = meta if meta is not None else read_meta(data_dir)
    cache = DigestCache(data_dir) if cached else None
    bad = []
    for split in meta["splits"].values():
        for record in split.get("shards", [split]):
            path = data_dir / record["file"]
            if not path.is_file():
                bad.append(record["file"])
                continue
            digest = cache.sha256(record["file"], path) if cache is not None else file_sha256(path)
            if digest != record.get("sha256"):
                bad.append(record["file"])
            elif cache is not None:
                cache.verified(record["file"], digest)
    if cache is not None:
        cache.save()
    return bad


def check_data_files(data_dir: str | os.PathLike, meta: dict | None = None, cached: bool = True) -> None:
    """One line naming the data files that changed since the dataset was prepared (`changed_data_files`):
    a run that starts reads its data against the recorded sha256s before training on it. `cached` (the
    default): a file whose size, mtime, ctime, inode and device are those of its last match is not read
    again (`depthtools.data.digest_cache`, and its limits); `shards.verify` always reads everything."""
    bad = changed_data_files(data_dir, meta, cached=cached)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise DepthToolsError(f"{data_dir}: {', '.join(bad[:3])}{more} differ from the sha256 meta.json records "
                              "(changed since the data was prepared); prepare it again")


def load_split(data_dir: str | os.PathLike, split: str = "train") -> np.ndarray:
    """Token ids of one split (train, val, or val_<domain>) as a read-only memmap of either layout.

    Single-file datasets give a uint16 memmap; sharded ones (`data prepare --input`) the memmap of
    their one shard or a `ShardedTokens` over several (uint16 or uint32): the same windows either way.
    """
    meta = read_meta(data_dir)
    info = meta["splits"].get(split)
    if info is None:
        raise DepthToolsError(f"{data_dir}: no split {split!r}; valid: {', '.join(meta['splits'])}")
    if "shards" in info:
        return load_sharded(Path(data_dir), info, meta.get("dtype", "uint16"))
    path = Path(data_dir) / info["file"]
    size = path.stat().st_size if path.is_file() else -1
    if size != 2 * info["tokens"]:
        raise DepthToolsError(f"{path}: {size} bytes, meta.json says {info['tokens']} tokens; prepare it again")
    if info["tokens"] == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
