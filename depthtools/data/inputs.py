"""The user's own corpora, read locally in the formats people have: `--input PATH...` of `data prepare`.

    jsonl / ndjson / .json (one object per line), optionally .gz or .zst/.zstd compressed
    parquet (pyarrow)
    a Hugging Face `datasets` save_to_disk folder (state.json + *.arrow, read with pyarrow's IPC
        reader; `datasets` itself is never imported and nothing is downloaded)
    a folder of plain-text files (one document per file, as --text-dir)

A path may be a glob (`shards/*.parquet`, `dump/**/*.jsonl.gz`); a folder whose files all have record
suffixes stands for those files. Each source is cut into work units of about `unit_bytes` (byte
ranges of an uncompressed jsonl file aligned to lines, groups of parquet row groups, ranges of
arrow record batches, groups of text files; a compressed file is one unit), so tokenization can run
in parallel and an interrupted preparation continues unit by unit. `read_unit` streams a unit's
documents as (text, domain) in file order, holding one record batch at a time.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from depthtools.data.corpora import clean_text
from depthtools.errors import DepthToolsError

UNIT_BYTES = 16 * 2**20  # target size of one work unit (uncompressed input bytes)
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
HF_STATE = "state.json"
HF_DICT = "dataset_dict.json"
DEFAULT_DOMAIN = "text"
_READ_CHUNK = 1 << 22
_DECOMPRESS_CHUNK = 1 << 16  # smaller: a damaged stream loses the chunk being read, so errors name a closer offset


@dataclass(frozen=True)
class Unit:
    """One piece of work: `kind` jsonl|parquet|arrow|text, a file (or text files), a range within it."""

    kind: str
    path: str
    start: int = 0  # jsonl: byte offset; parquet: first row group; arrow: first record batch
    stop: int = -1  # exclusive; -1 = to the end
    compression: str | None = None
    files: tuple[str, ...] = ()  # kind "text": the documents' files
    size: int = 0  # input bytes (for progress and throughput)

    def to_dict(self) -> dict:
        return {**asdict(self), "files": list(self.files)}


def record_kind(path: Path) -> tuple[str, str | None] | None:
    """(kind, compression) of a record file from its suffixes, None for anything else."""
    name = path.name.lower()
    compression = None
    for suffix, codec in COMPRESSIONS.items():
        if name.endswith(suffix):
            compression, name = codec, name[: -len(suffix)]
            break
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if compression is None and name.endswith(".parquet"):
        return "parquet", None
    if compression is None and name.endswith(".arrow"):
        return "arrow", None
    return None


def _visible_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def hf_arrow_files(directory: Path) -> list[Path]:
    """The arrow files of a `datasets` save_to_disk folder, in the order its state.json lists them.

    A DatasetDict folder (dataset_dict.json) stands for its "train" split; other splits are named
    explicitly (`--input DIR/validation`).
    """
    if (directory / HF_DICT).is_file() and not (directory / HF_STATE).is_file():
        try:
            splits = json.loads((directory / HF_DICT).read_text(encoding="utf-8")).get("splits") or []
        except (OSError, ValueError, AttributeError):
            raise DepthToolsError(f"{directory / HF_DICT}: not valid JSON") from None
        if "train" not in splits:
            raise DepthToolsError(f"{directory} is a datasets DatasetDict without a 'train' split; pass one of "
                                  + ", ".join(f"{directory}/{s}" for s in splits))
        directory = directory / "train"
    try:
        state = json.loads((directory / HF_STATE).read_text(encoding="utf-8"))
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DepthToolsError(f"{directory / HF_STATE}: not a datasets save_to_disk state file (no _data_files list)") from None
    files = [directory / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DepthToolsError(f"{directory}: state.json lists arrow files that are missing: {', '.join(missing[:3])}")
    return files


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and ((path / HF_STATE).is_file() or (path / HF_DICT).is_file())


def expand_inputs(inputs: list[str | os.PathLike]) -> list[tuple[str, list[Path]]]:  # noqa: C901 (one branch per input form the CLI accepts (glob, folder, file, list))
    """Resolve --input values into sources: ("jsonl:gzip"|"parquet"|"arrow"|"text", files), in argument order.

    Globs are expanded (sorted); a file listed twice is read once; a pattern matching nothing, a
    missing path or an empty folder is an error naming it.
    """
    if not inputs:
        raise DepthToolsError("--input needs at least one file, folder or glob")
    seen: set[str] = set()
    sources: list[tuple[str, list[Path]]] = []

    def add(kind: str, files: list[Path]) -> None:
        fresh = [f for f in files if str(f.resolve()) not in seen]
        seen.update(str(f.resolve()) for f in fresh)
        if fresh:
            sources.append((kind, fresh))

    for raw in inputs:
        text = os.path.expanduser(str(raw))
        paths = [Path(p) for p in sorted(glob.glob(text, recursive=True))] if glob.has_magic(text) else [Path(text)]
        if not paths:
            raise DepthToolsError(f"--input {raw}: no file matches this pattern")
        loose_text = []
        for path in paths:
            if not path.exists():
                raise DepthToolsError(f"--input {path}: no such file or folder")
            if is_hf_folder(path):
                add("arrow", hf_arrow_files(path))
            elif path.is_dir():
                files = _visible_files(path)
                if not files:
                    raise DepthToolsError(f"--input {path}: the folder holds no files")
                kinds = [record_kind(f) for f in files]
                if all(k is not None for k in kinds):
                    for f, k in zip(files, kinds):
                        add(_kind_label(k), [f])
                else:
                    add("text", files)
            else:
                kind = record_kind(path)
                if kind is None:
                    loose_text.append(path)
                else:
                    add(_kind_label(kind), [path])
        if loose_text:
            add("text", loose_text)
    if not sources:
        raise DepthToolsError("--input: every file was listed before; nothing to read")
    return sources


def _kind_label(kind: tuple[str, str | None]) -> str:
    return kind[0] if kind[1] is None else f"{kind[0]}:{kind[1]}"


def sources_state(sources: list[tuple[str, list[Path]]]) -> str:
    """Fingerprint of the inputs (kinds, resolved paths, sizes, mtimes): a change restarts a preparation."""
    h = hashlib.sha256()
    for kind, files in sources:
        for f in files:
            st = f.stat()
            h.update(f"{kind}\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def plan_units(sources: list[tuple[str, list[Path]]], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """Cut the sources into work units of about `unit_bytes`, in a fixed order (same inputs, same units)."""
    units: list[Unit] = []
    for label, files in sources:
        kind, _, compression = label.partition(":")
        if kind == "text":
            group, size = [], 0
            for f in files:
                group.append(str(f))
                size += f.stat().st_size
                if size >= unit_bytes:
                    units.append(Unit("text", group[0], files=tuple(group), size=size))
                    group, size = [], 0
            if group:
                units.append(Unit("text", group[0], files=tuple(group), size=size))
            continue
        for f in files:
            units += _file_units(kind, compression or None, f, unit_bytes)
    return units


def _file_units(kind: str, compression: str | None, path: Path, unit_bytes: int) -> list[Unit]:
    size = path.stat().st_size
    if kind == "jsonl":
        if compression is not None or size <= unit_bytes:
            return [Unit("jsonl", str(path), compression=compression, size=size)]
        cuts = list(range(0, size, unit_bytes))
        return [Unit("jsonl", str(path), start, min(start + unit_bytes, size), size=min(unit_bytes, size - start))
                for start in cuts]
    if kind == "parquet":
        import pyarrow.parquet as pq  # heavy, one path: pyarrow for Parquet inputs only

        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as err:  # pyarrow raises ArrowInvalid/OSError subclasses
            raise DepthToolsError(f"{path}: not a readable parquet file ({_first_line(err)})") from None
        return _grouped("parquet", path, [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)], unit_bytes)
    if kind == "arrow":
        sizes = [batch.nbytes for batch in _checked_batches(path)]
        return _grouped("arrow", path, sizes, unit_bytes)
    raise AssertionError(kind)


def _grouped(kind: str, path: Path, sizes: list[int], unit_bytes: int) -> list[Unit]:
    """Consecutive pieces (row groups, record batches) grouped into units of about unit_bytes."""
    units, start, acc = [], 0, 0
    for i, s in enumerate(sizes):
        acc += s
        if acc >= unit_bytes:
            units.append(Unit(kind, str(path), start, i + 1, size=acc))
            start, acc = i + 1, 0
    if start < len(sizes) or not units:
        units.append(Unit(kind, str(path), start, len(sizes), size=acc))
    return units


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


# ---------------------------------------------------------------- reading a unit


class FieldReader:
    """Pulls the text and the (optional) domain out of a record; dotted names reach into nested objects."""

    def __init__(self, text_field: str, domain_field: str | None):
        self.text_field, self.domain_field = text_field, domain_field
        self.text_path, self.domain_path = text_field.split("."), domain_field.split(".") if domain_field else None

    @staticmethod
    def _get(record, path):
        for key in path:
            if not isinstance(record, dict) or key not in record:
                return _MISSING
            record = record[key]
        return record

    def text(self, record, where: str) -> str:
        value = self._get(record, self.text_path)
        if value is _MISSING:
            keys = ", ".join(sorted(record)[:8]) if isinstance(record, dict) else type(record).__name__
            raise DepthToolsError(f"{where}: no field {self.text_field!r} (fields: {keys}); pass --text-field NAME")
        if value is None:
            return ""
        if not isinstance(value, str):
            raise DepthToolsError(f"{where}: field {self.text_field!r} is {type(value).__name__}, not text; pass --text-field NAME")
        return value

    def domain(self, record, where: str) -> str:
        if self.domain_path is None:
            return DEFAULT_DOMAIN
        value = self._get(record, self.domain_path)
        if value is _MISSING:
            raise DepthToolsError(f"{where}: no field {self.domain_field!r} for --domain-field")
        return DEFAULT_DOMAIN if value in (None, "") else str(value)

    def columns(self) -> list[str]:
        cols = [self.text_path[0]]
        if self.domain_path and self.domain_path[0] not in cols:
            cols.append(self.domain_path[0])
        return cols


_MISSING = object()


def read_unit(unit: Unit, fields: FieldReader, batch_rows: int = 1024) -> Iterator[tuple[str, str]]:
    """The (text, domain) of every document in `unit`, in file order, streamed."""
    if unit.kind == "text":
        for f in unit.files:
            yield clean_text(Path(f).read_bytes()), DEFAULT_DOMAIN
    elif unit.kind == "jsonl":
        for offset, line in _jsonl_lines(unit):
            where = f"{unit.path} (byte {offset})" if unit.compression is None else f"{unit.path} (record at byte {offset} of the decompressed text)"
            try:
                record = json.loads(line)
            except ValueError as err:
                raise DepthToolsError(f"{where}: not a JSON line ({err})") from None
            yield fields.text(record, where), fields.domain(record, where)
    elif unit.kind in ("parquet", "arrow"):
        batches = _parquet_batches(unit, fields, batch_rows) if unit.kind == "parquet" else \
            _arrow_unit_batches(unit, fields)
        for batch in batches:
            for row, record in enumerate(_rows(batch, fields, unit)):
                where = f"{unit.path} (row {row} of a batch in {unit.kind} piece {unit.start}..{unit.stop})"
                yield fields.text(record, where), fields.domain(record, where)
    else:
        raise AssertionError(unit.kind)


def _rows(batch, fields: FieldReader, unit: Unit):
    """Records of a pyarrow batch as dicts of the needed top-level columns."""
    names = batch.schema.names
    for col in fields.columns():
        if col not in names:
            raise DepthToolsError(f"{unit.path}: no column {col!r} (columns: {', '.join(names[:12])}); "
                                  "pass --text-field / --domain-field")
    try:
        cols = {c: batch.column(names.index(c)).to_pylist() for c in fields.columns()}
    except (UnicodeDecodeError, ValueError) as err:  # a damaged page whose bytes decompressed but are not text
        raise DepthToolsError(f"{unit.path}: a {unit.kind} batch in piece {unit.start}..{unit.stop} holds text that "
                              f"cannot be decoded ({_first_line(err)}); the file is damaged") from None
    for i in range(batch.num_rows):
        yield {c: v[i] for c, v in cols.items()}


def _parquet_batches(unit: Unit, fields: FieldReader, batch_rows: int):
    """The unit's row groups as record batches, one row group at a time, so a damaged page (bad
    compression, a bad page checksum where the writer stored one, bytes that do not decode) is one line
    naming the file, the row group and its rows."""
    import pyarrow.parquet as pq  # heavy, one path: pyarrow for Parquet inputs only

    try:
        pf = pq.ParquetFile(unit.path, page_checksum_verification=True)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError subclasses
        raise DepthToolsError(f"{unit.path}: not a readable parquet file ({_first_line(err)})") from None
    missing = [c for c in fields.columns() if c not in pf.schema_arrow.names]
    if missing:
        raise DepthToolsError(f"{unit.path}: no column {missing[0]!r} (columns: {', '.join(pf.schema_arrow.names[:12])}); "
                              "pass --text-field / --domain-field")
    meta = pf.metadata
    first_row = sum(meta.row_group(g).num_rows for g in range(unit.start))
    for group in range(unit.start, unit.stop if unit.stop >= 0 else meta.num_row_groups):
        rows = meta.row_group(group).num_rows
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=[group], columns=fields.columns())
        while True:
            try:
                batch = next(batches)
                batch.validate(full=True)  # text that decompressed but is not UTF-8: a damaged page, not a document
            except StopIteration:
                break
            except (OSError, ValueError, EOFError) as err:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
                raise DepthToolsError(f"{unit.path}: row group {group} (rows {first_row:,}..{first_row + rows - 1:,}) "
                                      f"is damaged ({_first_line(err)}); re-create or re-download the file, or leave "
                                      "it out of --input") from None
            yield batch
        first_row += rows


def _arrow_batches(path: Path):
    """Record batches of an arrow file (IPC stream as `datasets` writes, or IPC file), memory-mapped."""
    import pyarrow as pa  # heavy, one path: pyarrow for Parquet inputs only

    source = pa.memory_map(str(path), "r")
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as err:
            raise DepthToolsError(f"{path}: not an arrow IPC stream or file ({_first_line(err)})") from None
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


def _arrow_unit_batches(unit: Unit, fields: FieldReader):
    for i, batch in enumerate(_checked_batches(Path(unit.path))):
        if i < unit.start:
            continue
        if 0 <= unit.stop <= i:
            break
        yield batch


def _checked_batches(path: Path):
    """`_arrow_batches`, with a batch that cannot be read reported as one line naming the file and batch."""
    batches, index = _arrow_batches(path), 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, ValueError, EOFError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise DepthToolsError(f"{path}: record batch {index} is damaged ({_first_line(err)}); re-create the "
                                  "file, or leave it out of --input") from None
        yield batch
        index += 1


def _open_binary(path: str, compression: str | None):
    if compression is None:
        return open(path, "rb")
    if compression == "gzip":
        return gzip.open(path, "rb")
    return _zstd_reader(path)


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def zstd_without_checksum(path: str | os.PathLike) -> bool:
    """True when a .zst file's first frame carries no content checksum (Frame_Header_Descriptor bit 2).

    Without one, flipped bytes inside the file can decompress to other text with no error (pyarrow's
    writer stores none; the `zstd` tool does by default); `prepare_inputs` says so in its log."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(5)
    except OSError:
        return False
    return len(head) == 5 and head[:4] == ZSTD_MAGIC and not head[4] & 0x04


def pyarrow_zstd() -> bool:
    """Whether this pyarrow build has its zstd codec (the PyPI wheels do)."""
    import pyarrow as pa  # heavy, one path: pyarrow for Parquet inputs only

    return pa.Codec.is_available("zstd")


def _zstd_reader(path: str):
    """A zstd-decompressing stream: pyarrow's codec (a dependency already), else the `zstandard` package."""
    import pyarrow as pa  # heavy, one path: pyarrow for Parquet inputs only

    if pyarrow_zstd():
        return pa.input_stream(path, compression="zstd")
    try:
        import zstandard  # optional dependency
    except ImportError:
        raise DepthToolsError(f"{path}: reading .zst needs zstd support: pip install zstandard "
                              "(this pyarrow build has no zstd codec)") from None
    return _ZstdFrames(path, zstandard.ZstdDecompressor())


class _ZstdFrames:
    """The frames of a .zst file decompressed one after another with `zstandard`, refusing a file that ends
    inside a frame (EOFError). zstandard's own stream_reader returns a truncated file's first part as if it
    were all of it (zstandard 0.25), which would prepare a silently shortened dataset."""

    def __init__(self, path: str, dctx):
        self.file, self.dctx = open(path, "rb"), dctx
        self.frame, self.in_frame = dctx.decompressobj(), False
        self.pending = bytearray()

    def _feed(self, data: bytes) -> None:
        while data:
            self.in_frame = True
            self.pending += self.frame.decompress(data)
            if not self.frame.eof:
                return
            data, self.frame, self.in_frame = self.frame.unused_data, self.dctx.decompressobj(), False

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.pending) < size:
            chunk = self.file.read(1 << 16)
            if not chunk:
                if self.in_frame and not self.pending:  # what came before was delivered by the previous call
                    raise EOFError("the file ends inside a zstd frame")
                break
            self._feed(chunk)
        size = len(self.pending) if size < 0 else min(size, len(self.pending))
        out = bytes(self.pending[:size])
        del self.pending[:size]
        return out

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a damaged file raises while it is read: gzip's BadGzipFile (an OSError), EOFError (a truncated
    gzip stream), zlib.error (a damaged deflate block), pyarrow's OSError/ArrowInvalid (zstd), zstandard's
    ZstdError, and plain OSError (an I/O error)."""
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError, zlib.error)
    try:
        import zstandard  # optional dependency

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def _damaged(unit: Unit, err: BaseException, offset: int) -> DepthToolsError:
    """One line for a file that fails while being read: which file, how far reading got, why."""
    reason = _first_line(err)
    if unit.compression is None:
        return DepthToolsError(f"{unit.path}: cannot read it at byte {offset:,} ({reason})")
    truncated = isinstance(err, EOFError) or "truncated" in reason.lower() or "ended before" in reason.lower()
    return DepthToolsError(f"{unit.path}: {'truncated' if truncated else 'corrupt'} {unit.compression} file ({reason}) "
                           f"after {offset:,} bytes of decompressed text; re-create or re-download it, or leave it "
                           "out of --input")


def _read_some(raw) -> bytes:
    """Up to _DECOMPRESS_CHUNK decompressed bytes, returning what is there before reading on (gzip's read1),
    so the text before a damaged spot is delivered and the error names how far the good part reached."""
    return raw.read1(_DECOMPRESS_CHUNK) if isinstance(raw, gzip.GzipFile) else raw.read(_DECOMPRESS_CHUNK)


def _jsonl_lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the non-blank lines that START in [unit.start, unit.stop) (all for compressed files).

    A file that cannot be decompressed or read (garbage, truncated, an I/O error) is one DepthToolsError
    naming it and the decompressed byte offset reached, never a library traceback."""
    errors = _read_errors()
    try:
        raw = _open_binary(unit.path, unit.compression)
    except errors as err:
        raise _damaged(unit, err, 0) from None
    with raw:
        offset = 0
        if unit.compression is None and unit.start > 0:
            raw.seek(unit.start - 1)
            skipped = _skip_line(raw)  # the line through byte start-1 belongs to the previous unit
            offset = unit.start - 1 + skipped
        stop = unit.stop if unit.stop >= 0 else None
        buffer = b""
        while True:
            if stop is not None and offset >= stop:
                return
            try:
                chunk = raw.read(_READ_CHUNK) if unit.compression is None else _read_some(raw)
            except errors as err:
                raise _damaged(unit, err, offset + len(buffer)) from None
            if not chunk:
                break
            buffer += chunk
            lines = buffer.split(b"\n")
            buffer = lines.pop()
            for line in lines:
                if stop is not None and offset >= stop:
                    return
                start, offset = offset, offset + len(line) + 1
                if line.strip():
                    yield start, line
        if buffer.strip() and (stop is None or offset < stop):
            yield offset, buffer


def _skip_line(raw: io.RawIOBase) -> int:
    """Read through the next newline; returns the bytes consumed."""
    consumed = 0
    while True:
        chunk = raw.read(65536)
        if not chunk:
            return consumed
        cut = chunk.find(b"\n")
        if cut >= 0:
            raw.seek(-(len(chunk) - cut - 1), io.SEEK_CUR)
            return consumed + cut + 1
        consumed += len(chunk)
