"""A minimal reader for R's XDR serialization format, enough to read character vectors.

Why: the Jane Austen novels ship in the Debian package r-cran-janeaustenr as an R lazy-load
database (`Rdata.rdx` index + `Rdata.rdb` blobs). We read them without R and without any
general-purpose deserializer that could run code: this reader only builds strings, numbers,
lists and pairlists, and rejects every other R type with a one-line error.

Format reference: R Internals, "Serialization Formats" (src/main/serialize.c).
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from depthtools.errors import DepthToolsError

# SEXP type codes (Rinternals.h) and the pseudo-types of serialize.c that we understand.
SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 1, 2, 9, 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP = 255, 254
_NA_INT = -(2**31)
_UTF8_MASK, _LATIN1_MASK = 1 << 3, 1 << 2


@dataclass
class RObject:
    """A decoded R value: `value` is a list (vectors) or str (symbols); `attrs` maps names to RObjects."""

    rtype: int
    value: Any
    attrs: dict[str, Any] = field(default_factory=dict)

    def names(self) -> list[str] | None:
        """The `names` attribute as a list of str, if present."""
        n = self.attrs.get("names")
        return None if n is None else list(n.value)


class _Reader:
    """Sequential XDR reader over one serialized object."""

    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what
        self.refs: list[Any] = []

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise DepthToolsError(f"{self.what}: truncated R serialization at byte {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def header(self) -> None:
        """Check the 'X\\n' XDR magic and skip the version fields (v2 and v3)."""
        if self._take(2) != b"X\n":
            raise DepthToolsError(f"{self.what}: not an XDR R serialization (expected 'X\\n' header)")
        version = self.int()
        self.int(), self.int()  # writer R version, minimal reader version
        if version == 3:
            self._take(self.int())  # native encoding name
        elif version != 2:
            raise DepthToolsError(f"{self.what}: unsupported R serialization version {version} (valid: 2, 3)")

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper then lower 32 bits
            hi, lo = self.int(), self.int()
            n = (hi << 32) + (lo & 0xFFFFFFFF)
        return n

    def charsxp(self, flags: int) -> str | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = self._take(n)
        levels = flags >> 12
        return raw.decode("latin-1" if levels & _LATIN1_MASK and not levels & _UTF8_MASK else "utf-8")

    def item(self) -> Any:
        """Read one item; returns an RObject, a str (CHARSXP), or None (NULL)."""
        flags = self.int()
        rtype, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if rtype == NILVALUE_SXP:
            return None
        if rtype == REFSXP:
            idx = flags >> 8 or self.int()
            return self.refs[idx - 1]
        if rtype == CHARSXP:
            return self.charsxp(flags)
        if rtype == SYMSXP:
            sym = RObject(SYMSXP, self.item())
            self.refs.append(sym)
            return sym
        if rtype == LISTSXP:
            return self.pairlist(has_attr, has_tag)
        value = self.vector(rtype)
        obj = RObject(rtype, value)
        if has_attr:
            obj.attrs = self.attributes()
        return obj

    def vector(self, rtype: int) -> list:
        n = self.length()
        if rtype in (LGLSXP, INTSXP):
            ints = struct.unpack(f">{n}i", self._take(4 * n))
            return [None if v == _NA_INT else v for v in ints]
        if rtype == REALSXP:
            return list(struct.unpack(f">{n}d", self._take(8 * n)))
        if rtype == STRSXP:
            return [self.charsxp(self.int()) for _ in range(n)]
        if rtype == VECSXP:
            return [self.item() for _ in range(n)]
        raise DepthToolsError(f"{self.what}: unsupported R type {rtype} (this reader handles strings, numbers, lists)")

    def pairlist(self, has_attr: bool, has_tag: bool) -> RObject:
        """A pairlist as an RObject whose value is [(tag, value), ...]; iterative along CDR."""
        cells: list[tuple[str | None, Any]] = []
        attrs = self.attributes() if has_attr else {}
        while True:
            tag = self.item() if has_tag else None
            cells.append((tag.value if isinstance(tag, RObject) else None, self.item()))
            flags = self.int()
            if flags & 0xFF == NILVALUE_SXP:
                return RObject(LISTSXP, cells, attrs)
            if flags & 0xFF != LISTSXP:
                self.pos -= 4
                cells.append((None, self.item()))  # dotted pair: non-list CDR
                return RObject(LISTSXP, cells, attrs)
            has_tag = bool(flags & (1 << 10))
            if flags & (1 << 9):
                self.attributes()

    def attributes(self) -> dict[str, Any]:
        plist = self.item()
        return {tag: val for tag, val in plist.value} if isinstance(plist, RObject) else {}


def unserialize(data: bytes, what: str = "R data") -> Any:
    """Decode one XDR-serialized R object from `data` (already decompressed)."""
    reader = _Reader(data, what)
    reader.header()
    return reader.item()


def read_lazyload_db(rdx: Path) -> dict[str, Any]:
    """Read every variable of an R lazy-load database (`X.rdx` index beside its `X.rdb` blobs).

    The .rdx is a gzip'd serialized list(variables=, references=, compressed=); each variable maps
    to (offset, length) into the .rdb, where a blob is a 4-byte big-endian uncompressed length then
    a zlib stream (compressed=TRUE), or a type byte then bzip2/xz data (compressed=2/3).
    """
    index = unserialize(gzip.decompress(rdx.read_bytes()), str(rdx))
    parts = dict(zip(index.names(), index.value))
    variables = parts["variables"]
    compressed = parts.get("compressed")
    mode = compressed.value[0] if isinstance(compressed, RObject) else 1
    blob_file = rdx.with_suffix(".rdb").read_bytes()
    out: dict[str, Any] = {}
    for name, loc in zip(variables.names(), variables.value):
        offset, length = loc.value
        out[name] = unserialize(_inflate(blob_file[offset : offset + length], mode, name), f"{rdx.name}:{name}")
    return out


def _inflate(blob: bytes, mode: int, name: str) -> bytes:
    """Undo the lazy-load compression of one blob (mode 1: zlib; 2: bzip2; 3: xz/bzip2/none by type byte)."""
    if mode in (1, True):
        return zlib.decompress(blob[4:])
    kind, body = blob[4:5], blob[5:]
    if kind == b"2":
        return bz2.decompress(body)
    if kind == b"Z":
        return lzma.decompress(body)
    if kind == b"0":
        return body
    raise DepthToolsError(f"R lazy-load blob {name!r}: unknown compression type {kind!r} (valid: zlib, '2', 'Z', '0')")
