"""Tokenizers with one small interface: bytes (default, V=256), byte-level BPE (4k/8k) trained per
dataset, or any local `tokenizers` file (`tokenizer.json`, e.g. a GPT-NeoX/OLMo 50k vocabulary).

Each has a document separator `sep_id`: for bytes the NUL byte (id 0), which the corpus cleaner
strips from every text, so it can never be confused with content; for BPE the special token
`<|endoftext|>` (id 0 for the ones depthtools trains); for a user's file the token named by `sep_token`,
else the model's declared eos/bos special token, else the first special one of SEPARATOR_CANDIDATES
(`choose_separator`: the one rule `import-hf` records too). Special tokens written in a
text are encoded as text, never as the separator. `fingerprint()` is a sha256 of the tokenizer
definition, so a checkpoint can prove which tokenizer its data used. `dtype` is the smallest
unsigned type holding every id (uint16 up to 65,536 tokens, else uint32).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from depthtools.errors import DepthToolsError
from depthtools.fsutil import atomic_write_text, file_sha256

TOKENIZER_FILE = "tokenizer.json"
SEPARATOR = "<|endoftext|>"
BPE_SIZES = {"bpe4k": 4096, "bpe8k": 8192}
TOKENIZER_SPECS = ("byte", *BPE_SIZES)
# Document separators tried, in order, in a user's tokenizer.json (GPT-2/NeoX/OLMo, Llama 3, Llama 2/Mistral, Gemma).
SEPARATOR_CANDIDATES = (SEPARATOR, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (vocab <= 65,536), else uint32."""
    return np.uint16 if vocab_size <= 65536 else np.uint32


def is_tokenizer_file(spec) -> bool:
    """Whether a --tokenizer value names a file (or a folder holding tokenizer.json) rather than byte/bpe4k/bpe8k."""
    text = str(spec)
    return text not in TOKENIZER_SPECS and (text.endswith(".json") or os.sep in text or Path(text).exists())


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, exact round trip on any valid UTF-8 text."""

    name = "byte"
    vocab_size = 256
    sep_id = 0
    sep_token = "\x00"
    dtype = np.uint16

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
        return atomic_write_text(Path(directory) / TOKENIZER_FILE, self.to_json(), fsync=False)

    @classmethod
    def from_dir(cls, directory: Path) -> "ByteTokenizer":
        return cls()


class BPETokenizer:
    """A HuggingFace `tokenizers` tokenizer: byte-level BPE trained on the train split, or a user's file.

    `sep_token` names the document separator; None chooses it by `choose_separator` (the model's declared
    eos/bos special token first: `declared`, read by `from_file` from the files beside the tokenizer).
    """

    def __init__(self, tokenizer, name: str | None = None, sep_token: str | None = None,
                 declared: tuple[str, ...] = ()):
        self._tok = tokenizer
        tokenizer.encode_special_tokens = True  # a literal "<|endoftext|>" in text is text, not a separator
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(tokenizer.get_vocab_size(), max(vocab.values(), default=-1) + 1)
        self.sep_token = choose_separator(tokenizer, declared, sep_token)
        self.sep_id = tokenizer.token_to_id(self.sep_token)
        self.dtype = token_dtype(self.vocab_size)
        self.name = name or _bpe_name(self.vocab_size)

    def check_separator(self, where) -> None:
        """Refuse a separator that is an ordinary vocabulary token: text encodes to it too, so it could
        not mark where documents start (and an export could not make it eos/bos). Checked when data
        is prepared; a tokenizer without any special token needs one added first."""
        added = self._tok.get_added_tokens_decoder().get(self.sep_id)
        if added is None or not added.special:
            raise DepthToolsError(
                f"{where}: the document separator {self.sep_token!r} (id {self.sep_id}) is an ordinary token of the "
                "vocabulary, not a special token, so text encodes to it too; pass --sep-token with one of the "
                "tokenizer's special tokens, or add one (tokenizer.add_special_tokens(['<|endoftext|>']); tokenizer.save(...))")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> "BPETokenizer":
        """Train byte-level BPE; the 256 byte symbols are always in the alphabet so any text encodes."""
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
        return np.asarray(self.encode(text), dtype=self.dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets nobody here reads
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self._tok.to_str()

    def fingerprint(self) -> str:
        return tokenizers_fingerprint(self._tok)

    def save(self, directory: Path) -> Path:
        return atomic_write_text(Path(directory) / TOKENIZER_FILE, self.to_json(), fsync=False)

    @classmethod
    def from_dir(cls, directory: Path) -> "BPETokenizer":
        """The tokenizer.json in `directory`, with the separator and name recorded beside it (a data
        folder's meta.json or a checkpoint's config.json), if any."""
        record = _recorded_tokenizer(Path(directory))
        return cls.from_file(Path(directory) / TOKENIZER_FILE, sep_token=record.get("sep_token"), name=record.get("name"))

    @classmethod
    def from_file(cls, path: str | os.PathLike, sep_token: str | None = None, name: str | None = None) -> "BPETokenizer":
        """Any local `tokenizers` file (tokenizer.json), or a folder holding one; never downloads."""
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise DepthToolsError(f"tokenizer file {path} not found; pass a local tokenizer.json (nothing is downloaded)")
        beside = _recorded_tokenizer(path.parent)  # a data folder's or checkpoint's own file: the one it records
        if beside.get("file", TOKENIZER_FILE) == path.name:
            check_tokenizer_file(path, beside.get("fingerprint"), f"{beside.get('from')} in {path.parent}")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises plain Exception subclasses on bad JSON
            raise DepthToolsError(f"{path}: not a valid tokenizer file ({str(err).splitlines()[0]})") from None
        return cls(tok, name=name, sep_token=sep_token, declared=() if sep_token else declared_specials(path.parent, tok))


def choose_separator(tok, declared: Iterable[str] = (), sep_token: str | None = None) -> str:
    """The document separator of a `tokenizers` tokenizer: the one rule `data prepare` and `import-hf` share,
    so `--data` and `--text` windows start with the same token.

    `sep_token` when given (it must exist). Otherwise the first special token (an added token marked
    special, which text never encodes to) among the model's declared eos then bos tokens (`declared`:
    `declared_specials`), then SEPARATOR_CANDIDATES; failing a special one, the first candidate present
    (`BPETokenizer.check_separator` then refuses it where data is written). Gemma's vocabulary holds an
    ordinary "</s>" (id 212) besides its special "<eos>": the declared eos, or the special candidate, wins."""
    if sep_token:
        if tok.token_to_id(sep_token) is None:
            raise DepthToolsError(f"tokenizer has no token {sep_token!r} to separate documents; "
                                  f"pass --sep-token with one of its special tokens")
        return sep_token
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    candidates = [t for t in dict.fromkeys([*declared, *SEPARATOR_CANDIDATES]) if tok.token_to_id(t) is not None]
    for token in candidates:
        if token in specials:
            return token
    if not candidates:
        raise DepthToolsError(f"tokenizer defines none of {', '.join(SEPARATOR_CANDIDATES)} to separate documents; "
                              "pass --sep-token NAME (its end-of-text token)")
    return candidates[0]


# Where a model folder declares its special tokens: (file, key), eos before bos, the model's config first.
DECLARED = (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token"),
            ("config.json", "bos_token_id"), ("generation_config.json", "bos_token_id"), ("tokenizer_config.json", "bos_token"))


def declared_specials(folder: str | os.PathLike, tok) -> tuple[str, ...]:
    """The eos then bos tokens a model folder declares (config.json / generation_config.json ids, a list's
    first; tokenizer_config.json texts), as token texts of `tok`. A depthtools checkpoint imported from such a
    folder declares them in config.json under source.hf_config. Unreadable files declare nothing."""
    out: list[str] = []
    for name, key in DECLARED:
        try:
            head = json.loads((Path(folder) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(head, dict):
            continue
        source = head.get("source") if name == "config.json" and key not in head else None
        if isinstance(source, dict) and isinstance(source.get("hf_config"), dict):
            head = source["hf_config"]
        value = head.get(key)
        value = value[0] if isinstance(value, list) and value else value
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, int) and not isinstance(value, bool):
            value = tok.id_to_token(value)
        if isinstance(value, str) and value not in out:
            out.append(value)
    return tuple(out)


def tokenizers_fingerprint(tok) -> str:
    """The one fingerprint of a `tokenizers` Tokenizer: sha256 of its canonical JSON (keys sorted, no
    spaces), taken as data preparation uses it (special tokens in text encoded as text). `data prepare`,
    `import-hf` and the checks between them all call this, so one tokenizer has one fingerprint whatever
    file layout or whitespace it was saved with."""
    tok.encode_special_tokens = True
    canonical = json.dumps(json.loads(tok.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def vocab_fingerprint(tokens: Iterable[str | None]) -> str:
    """A fingerprint of a vocabulary alone: sha256 of its (id, token text) pairs in id order. What a GGUF file
    (`tokenizer.ggml.tokens`) and a tokenizer.json share when the tokenizer itself cannot be rebuilt from
    the GGUF, so data prepared with another vocabulary is still told apart. llama.cpp pads a vocabulary
    with "[PAD<id>]" entries for ids the tokenizer lacks; those, and ids without a token, are left out."""
    pairs = [[i, t] for i, t in enumerate(tokens) if isinstance(t, str) and t != f"[PAD{i}]"]
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def tokenizer_vocab_fingerprint(tok) -> str:
    """`vocab_fingerprint` of a `tokenizers` Tokenizer (its vocabulary with the added tokens, by id)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    return vocab_fingerprint(tokens)


def tokenizer_file_fingerprint(path: str | os.PathLike) -> str | None:
    """`tokenizers_fingerprint` of a tokenizer.json file (None when it cannot be read as one)."""
    try:
        return tokenizers_fingerprint(Tokenizer.from_file(str(path)))
    except Exception:  # tokenizers raises plain Exception subclasses on bad files
        return None


def check_tokenizer_file(path: str | os.PathLike, recorded: object, where: str) -> None:
    """Refuse a tokenizer file that is not the one recorded beside it (config.json's or meta.json's tokenizer
    fingerprint), e.g. a tokenizer.json a re-import replaced before it failed half-way: a model must never read
    text through another model's tokenizer. The record is the data-prepare fingerprint (`tokenizers_fingerprint`)
    or, for a tokenizer.model and checkpoints imported before both shared one, the file's sha256. No record: no
    check."""
    if not isinstance(recorded, str) or not recorded:
        return
    path = Path(path)
    found = tokenizer_file_fingerprint(path)
    if recorded == found or recorded == file_sha256(path):
        return
    raise DepthToolsError(f"{path} is not the tokenizer {where} records (fingerprint {str(found or file_sha256(path))[:12]}, "
                          f"recorded {recorded[:12]}): the file was replaced after the record was written (a re-import "
                          "or copy that failed half-way?); restore it, or re-import the model with --force")


def file_tokenizer_name(path: str | os.PathLike, vocab_size: int) -> str:
    """A readable name for a user's tokenizer file: its folder (for .../gpt-neox-20b/tokenizer.json) or stem."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / TOKENIZER_FILE
    stem = path.parent.name if path.name == TOKENIZER_FILE and path.parent.name else path.stem
    return f"{stem}-{vocab_size}"


def _recorded_tokenizer(directory: Path) -> dict:
    for name, key in (("meta.json", "tokenizer"), ("config.json", "tokenizer")):
        try:
            record = json.loads((directory / name).read_text(encoding="utf-8")).get(key) or {}
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(record, dict):
            return {"from": name, **{k: record[k] for k in ("sep_token", "name", "fingerprint", "file")
                                     if isinstance(record.get(k), str)}}
    return {}


def _bpe_name(vocab_size: int) -> str:
    return f"bpe{vocab_size // 1024}k" if vocab_size % 1024 == 0 else f"bpe{vocab_size}"


def load_tokenizer(spec_or_dir: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """`"byte"` gives the byte tokenizer; a directory gives the tokenizer saved there (tokenizer.json);
    a file gives that `tokenizers` file.

    A BPE spec like "bpe4k" cannot be loaded by name, because BPE is trained per dataset: pass the
    prepared data directory instead.
    """
    if str(spec_or_dir) == "byte":
        return ByteTokenizer()
    path = Path(spec_or_dir)
    if path.is_file():
        return BPETokenizer.from_file(path)
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
