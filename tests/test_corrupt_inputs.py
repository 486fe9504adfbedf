"""Corrupt compressed and columnar input to `data prepare --input` (issue 35, item 5).

Every damaged file here is a real one written by the test and then broken the way files break: a
gzip or zstd stream cut short or replaced by garbage, a gzip member with flipped bytes (its CRC no
longer matches), a parquet file with flipped bytes inside a data page or cut short, and inputs with
no text at all. Each must be one `error:` line naming the file (and the offset or row group where
known), exit code 2, and nothing left behind: no dataset folder and no hidden `.<name>.partial/`.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from depthtools.data import prepare_inputs
from depthtools.errors import DepthToolsError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 97}" for j in range(60)) for i in range(600)]
RAW = "".join(json.dumps({"text": t}) + "\n" for t in DOCS).encode()


def _flip(data: bytes, start: int, width: int = 64) -> bytes:
    out = bytearray(data)
    for i in range(start, min(start + width, len(out))):
        out[i] ^= 0xA5
    return bytes(out)


def _zstd(data: bytes) -> bytes:
    return pa.compress(data, codec="zstd", asbytes=True)


def _parquet(path: Path, compression: str = "snappy", **options) -> Path:
    """DOCS as parquet, 4 row groups of 150 rows. Plain-encoded without page statistics, so a flip a few
    bytes after a data page's offset lands in the page's (compressed) text, not in min/max values that
    a reader never uses."""
    pq.write_table(pa.table({"text": DOCS}), path, row_group_size=150, compression=compression, use_dictionary=False,
                   write_statistics=False, **options)
    return path


def _data_page(path: Path, group: int) -> int:
    """Byte offset of the first data page of row group `group` (its page header comes first)."""
    return pq.ParquetFile(path).metadata.row_group(group).column(0).data_page_offset


def make(kind: str, folder: Path) -> tuple[Path, list[str]]:
    """Write the broken input `kind`; return it and the words its error line must hold."""
    if kind == "gz-garbage":
        path = folder / "a.jsonl.gz"
        path.write_bytes(b"this was never gzip\n" * 50)
        return path, ["corrupt gzip", "Not a gzipped file"]
    if kind == "gz-truncated":
        path = folder / "a.jsonl.gz"
        whole = gzip.compress(RAW)
        path.write_bytes(whole[: len(whole) * 2 // 3])
        return path, ["truncated gzip", "bytes of decompressed text"]
    if kind == "gz-flipped":
        path = folder / "a.jsonl.gz"
        whole = gzip.compress(RAW)
        path.write_bytes(_flip(whole, len(whole) // 2))
        return path, ["byte"]  # "corrupt gzip ... (CRC check failed)", or the damaged record: "not a JSON line"
    if kind == "gz-empty-file":
        path = folder / "a.jsonl.gz"
        path.write_bytes(b"")
        return path, ["no text at all"]
    if kind == "zst-garbage":
        path = folder / "a.jsonl.zst"
        path.write_bytes(b"\x00\x01 never zstd " * 100)
        return path, ["corrupt zstd"]
    if kind == "zst-truncated":
        path = folder / "a.jsonl.zst"
        whole = _zstd(RAW)
        path.write_bytes(whole[: len(whole) // 2])
        return path, ["truncated zstd"]
    if kind == "zst-flipped-checksummed":
        import zstandard

        path = folder / "a.jsonl.zst"
        whole = zstandard.ZstdCompressor(write_checksum=True).compress(RAW)  # as the zstd tool writes by default
        path.write_bytes(_flip(whole, len(whole) // 2, width=1))
        return path, ["corrupt zstd"]
    if kind == "parquet-flipped-page":
        path = _parquet(folder / "a.parquet")
        data = path.read_bytes()
        path.write_bytes(_flip(data, _data_page(path, 2) + 40))  # inside row group 2's first data page
        return path, ["row group 2", "rows 300..449", "damaged"]
    if kind == "parquet-flipped-page-checksummed":
        path = _parquet(folder / "a.parquet", compression="none", write_page_checksum=True)
        path.write_bytes(_flip(path.read_bytes(), _data_page(path, 1) + 60, width=1))  # one byte: only a CRC sees it
        return path, ["row group 1", "damaged", "CRC"]
    if kind == "parquet-truncated":
        path = _parquet(folder / "a.parquet")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path, ["not a readable parquet file"]
    if kind == "jsonl-empty":
        path = folder / "a.jsonl"
        path.write_bytes(b"")
        return path, ["no text at all", "no records"]
    if kind == "jsonl-blank-lines":
        path = folder / "a.jsonl"
        path.write_bytes(b"\n  \n\n")
        return path, ["no text at all"]
    if kind == "jsonl-empty-texts":
        path = folder / "a.jsonl"
        path.write_text('{"text": ""}\n{"text": null}\n{"text": ""}\n')
        return path, ["no text at all", "3 record(s)", "'text' empty or null"]
    if kind == "parquet-no-rows":
        path = folder / "a.parquet"
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
        return path, ["no text at all"]
    raise AssertionError(kind)


KINDS = ["gz-garbage", "gz-truncated", "gz-flipped", "gz-empty-file", "zst-garbage", "zst-truncated", "zst-flipped-checksummed",
         "parquet-flipped-page", "parquet-flipped-page-checksummed", "parquet-truncated", "jsonl-empty",
         "jsonl-blank-lines", "jsonl-empty-texts", "parquet-no-rows"]


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir()) if out.is_dir() else []


@pytest.mark.parametrize("kind", KINDS)
def test_corrupt_input_is_one_line_exit_2_and_leaves_nothing(kind, tmp_path):
    (tmp_path / "in").mkdir()
    path, words = make(kind, tmp_path / "in")
    out = tmp_path / "data"
    result = subprocess.run([sys.executable, "-m", "cli", "data", "prepare", "--input", str(path), "--out", str(out),
                             "--name", "corpus"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and len(errors) == 1, result.stderr[-2000:]
    assert str(path) in errors[0] and all(w in errors[0] for w in words), errors[0]
    assert _leftovers(out) == [], _leftovers(out)  # no dataset, no .corpus.partial, no lock file


@pytest.mark.parametrize("workers", [1, 2])
def test_a_corrupt_file_among_good_ones_stops_the_run_and_leaves_nothing(workers, tmp_path):
    """Several units, the bad file last: the good units were tokenized, then the run stops and cleans up."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(RAW)
    _parquet(folder / "b.parquet")
    bad, _words = make("gz-truncated", folder)
    out = tmp_path / "data"
    with pytest.raises(DepthToolsError, match=rf"{bad}: truncated gzip") as err:
        prepare_inputs([str(folder / "a.jsonl"), str(folder / "b.parquet"), str(bad)], out_dir=out, name="mix",
                       workers=workers, unit_bytes=64 * 1024)
    assert "\n" not in str(err.value)
    assert _leftovers(out) == []


def test_zstandard_fallback_reports_damage_the_same_way(tmp_path, monkeypatch):
    """Without pyarrow's zstd codec the `zstandard` package reads .zst; its errors are one line too."""
    pytest.importorskip("zstandard")
    from depthtools.data import inputs as inputs_mod

    monkeypatch.setattr(inputs_mod, "pyarrow_zstd", lambda: False)
    for kind in ("zst-garbage", "zst-truncated"):
        folder = tmp_path / kind
        folder.mkdir()
        path, _words = make(kind, folder)
        with pytest.raises(DepthToolsError, match=rf"{path}: (corrupt|truncated) zstd"):
            prepare_inputs([str(path)], out_dir=tmp_path / "data", name=kind)
        assert _leftovers(tmp_path / "data") == []


def test_a_zst_file_without_a_content_checksum_is_noted(tmp_path):
    """pyarrow writes .zst without a checksum: a flip inside may decode silently, so the log says so."""
    import zstandard

    (tmp_path / "plain.jsonl.zst").write_bytes(_zstd(RAW))
    (tmp_path / "checked.jsonl.zst").write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(RAW))
    for name, noted in (("plain.jsonl.zst", True), ("checked.jsonl.zst", False)):
        lines: list[str] = []
        prepare_inputs([str(tmp_path / name)], out_dir=tmp_path / "data", name=name.split(".")[0], log=lines.append)
        assert any("no zstd content checksum" in line and name in line for line in lines) == noted, lines


def test_the_same_files_undamaged_prepare_the_same_text(tmp_path):
    """Positive control: the writers above make files the reader takes, token-exact across formats."""
    from depthtools.data import load_split

    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl.gz").write_bytes(gzip.compress(RAW))
    (folder / "b.jsonl.zst").write_bytes(_zstd(RAW))
    _parquet(folder / "c.parquet")
    counts = []
    for name in ("a.jsonl.gz", "b.jsonl.zst", "c.parquet"):
        data = prepare_inputs([str(folder / name)], out_dir=tmp_path / "data", name=name.split(".")[0], val_fraction=0)
        counts.append(len(load_split(data, "train")))
    assert counts[0] == counts[1] == counts[2] == sum(len(t.encode()) + 1 for t in DOCS)
