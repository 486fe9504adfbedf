"""Tokenizers with one small interface: bytes (default, V=256) or byte-level BPE (4k/8k).

Both reserve id 0 as the document separator (`sep_id`): for bytes it is the NUL byte, which the
corpus cleaner strips from every text, so it can never be confused with content; for BPE it is the
special token `<|endoftext|>`. `fingerprint()` is a sha256 of the tokenizer definition, so a
checkpoint can prove which tokenizer its data used.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from depthtools.errors import DepthToolsError

TOKENIZER_FILE = "tokenizer.json"
SEPARATOR = "<|endoftext|>"
BPE_SIZES = {"bpe4k": 4096, "bpe8k": 8192}
TOKENIZER_SPECS = ("byte", *BPE_SIZES)


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, exact round trip on any valid UTF-8 text."""

    name = "byte"
    vocab_size = 256
    sep_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids as uint16 without a Python list (fast path for data preparation)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"depthtools_tokenizer": "byte", "vocab_size": 256, "sep_id": 0}, sort_keys=True)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save(self, directory: Path) -> Path:
        return _atomic_write_text(Path(directory) / TOKENIZER_FILE, self.to_json())

    @classmethod
    def from_dir(cls, directory: Path) -> "ByteTokenizer":
        return cls()


class BPETokenizer:
    """Byte-level BPE (HuggingFace `tokenizers`), trained on the train split only and saved as tokenizer.json."""

    def __init__(self, tokenizer, name: str | None = None):
        self._tok = tokenizer
        tokenizer.encode_special_tokens = True  # a literal "<|endoftext|>" in text is text, not a separator
        self.vocab_size = tokenizer.get_vocab_size()
        self.sep_id = tokenizer.token_to_id(SEPARATOR)
        if self.sep_id is None:
            raise DepthToolsError(f"BPE tokenizer has no {SEPARATOR} token; it was not made by depthtools")
        self.name = name or _bpe_name(self.vocab_size)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> "BPETokenizer":
        """Train byte-level BPE; the 256 byte symbols are always in the alphabet so any text encodes."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if not 257 <= vocab_size <= 65535:
            raise DepthToolsError(f"BPE vocab_size {vocab_size} must be in 257..65535 (tokens are stored as uint16)")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SEPARATOR],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint16)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint16) for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self._tok.to_str()

    def fingerprint(self) -> str:
        canonical = json.dumps(json.loads(self.to_json()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def save(self, directory: Path) -> Path:
        return _atomic_write_text(Path(directory) / TOKENIZER_FILE, self.to_json())

    @classmethod
    def from_dir(cls, directory: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        path = Path(directory) / TOKENIZER_FILE
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as err:  # tokenizers raises plain Exception subclasses on bad JSON
            raise DepthToolsError(f"{path}: not a valid tokenizer file ({str(err).splitlines()[0]})") from None


def _bpe_name(vocab_size: int) -> str:
    return f"bpe{vocab_size // 1024}k" if vocab_size % 1024 == 0 else f"bpe{vocab_size}"


def load_tokenizer(spec_or_dir: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """`"byte"` gives the byte tokenizer; a directory gives the tokenizer saved there (tokenizer.json).

    A BPE spec like "bpe4k" cannot be loaded by name, because BPE is trained per dataset: pass the
    prepared data directory instead.
    """
    if str(spec_or_dir) == "byte":
        return ByteTokenizer()
    path = Path(spec_or_dir)
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise DepthToolsError(f"{path}: no {TOKENIZER_FILE} here (run `depthtools data prepare` first)")
        try:
            head = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DepthToolsError(f"{file}: not valid JSON ({err.msg} at line {err.lineno})") from None
        return ByteTokenizer() if head.get("depthtools_tokenizer") == "byte" else BPETokenizer.from_dir(path)
    if str(spec_or_dir) in BPE_SIZES:
        raise DepthToolsError(f"tokenizer {spec_or_dir!r} is trained per dataset; pass its data directory (e.g. data/default-{spec_or_dir})")
    raise DepthToolsError(f"unknown tokenizer {str(spec_or_dir)!r}; valid: byte, or a prepared data directory")


def _atomic_write_text(path: Path, text: str) -> Path:
    """Write via a temporary file in the same folder, then rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
