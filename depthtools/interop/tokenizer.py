"""Tokenizers for exported models: `AutoTokenizer.from_pretrained(dir)` must give depthtools' ids.

Byte tokenizer (depthtools' default: UTF-8 bytes -> ids 0..255) becomes a `tokenizers` byte-level
BPE with no merges whose vocabulary maps GPT-2's printable stand-in for byte b to id b, so text
encodes to exactly `list(text.encode())` and decodes back. Id 0 (the NUL byte, depthtools' document
separator) is also bos/eos/pad, under its byte-level spelling "Ā" (U+0100); `split_special_tokens`
makes a literal "Ā" in text encode as its two UTF-8 bytes, as ByteTokenizer does.

A `tokenizers` file (depthtools' bpe4k/bpe8k, or the user's own tokenizer.json given to `data
prepare`) is carried over after checking its fingerprint against the one the checkpoint recorded.
bos/eos/pad are the token the data actually used as its document separator (the recorded sep_id:
"<|endoftext|>" id 0 for depthtools' BPE, "</s>" id 2 for a Llama-2-style file, ...), not a fixed
name; an export refuses, in one line, a record whose separator it cannot vouch for (no sep_id, an id
the file does not have, a recorded name the id contradicts, an ordinary vocabulary token that text
also encodes to). A post-processor that adds tokens (Llama's "<s> $A" template) is dropped from the
exported file, and padding/truncation settings cleared, because the training data never had them:
the exported tokenizer encodes text to exactly the ids depthtools trained on.
A checkpoint imported from Hugging Face carries its original tokenizer files back out unchanged.

Where the tokenizer comes from: checkpoints record the tokenizer's name and fingerprint in
config.json ("tokenizer") but do not copy its file; a BPE tokenizer.json lives in the prepared data
directory recorded under "data.path".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from depthtools.data.tokenizer import BPETokenizer, check_tokenizer_file
from depthtools.errors import DepthToolsError
from depthtools.fsutil import atomic_write_bytes

# Files carried from an imported HF directory into the checkpoint (and back out on export).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
HF_CARRIED_FILES = (*HF_TOKENIZER_FILES, "generation_config.json")

TOKENIZER_JSON = "tokenizer.json"
SEPARATOR = "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what `pre_tokenizers.ByteLevel` emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


BYTE_SEPARATOR = bytes_to_unicode()[0]  # "Ā": byte 0, id 0


def byte_tokenizer():
    """A `tokenizers.Tokenizer` whose ids are the UTF-8 byte values (0..255), id 0 special."""
    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_SEPARATOR, special=True, normalized=False)])
    return tok


def tokenizer_config(special: str, max_len: int) -> dict[str, Any]:
    """tokenizer_config.json for a plain `tokenizers` file; special = the separator token's text."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special, "eos_token": special, "pad_token": special,
        "split_special_tokens": True,  # literal separator text in input is text (as in depthtools)
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }


@dataclass
class TokenizerPlan:
    """What `export_hf` writes for the tokenizer, and the special ids config.json should name."""

    kind: str  # "byte" | "bpe" | "huggingface" | "none"
    source: str | None = None
    special_ids: dict[str, int | None] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)  # file name -> contents to write
    copies: dict[str, Path] = field(default_factory=dict)  # file name -> file to copy
    notes: list[str] = field(default_factory=list)

    def write(self, out: Path) -> None:
        for name, text in self.texts.items():
            atomic_write_bytes(out / name, text.encode("utf-8"))
        for name, src in self.copies.items():
            atomic_write_bytes(out / name, src.read_bytes())

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "files": sorted([*self.texts, *self.copies]),
                "special_ids": self.special_ids}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DepthToolsError(f"{path}: not a readable tokenizer JSON file ({exc})") from None


def byte_plan(max_len: int, source: str) -> TokenizerPlan:
    special = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    config = tokenizer_config(BYTE_SEPARATOR, max_len)
    tokens = {k: BYTE_SEPARATOR for k in ("bos_token", "eos_token", "pad_token")}
    return TokenizerPlan("byte", source, special, {
        TOKENIZER_JSON: byte_tokenizer().to_str(), "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(tokens, indent=2) + "\n"})


def bpe_plan(file: Path, max_len: int, vocab_size: int, fingerprint: str | None,
             record: dict[str, Any] | None = None) -> TokenizerPlan:
    """A `tokenizers` file the data was prepared with, verified against the checkpoint's record.

    record: the tokenizer record (config.json / meta.json "tokenizer") whose sep_id names the
    document separator; without one, the separator is found as data preparation finds it.
    """
    if file.name != TOKENIZER_JSON:
        raise DepthToolsError(f"{file}: expected a file named {TOKENIZER_JSON}")
    try:
        raw = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception on bad files
        raise DepthToolsError(f"{file}: not a valid tokenizer file ({str(exc).splitlines()[0]})") from None
    record = record or {}
    sep_id, sep_name = record.get("sep_id"), record.get("sep_token")
    if record and (not isinstance(sep_id, int) or isinstance(sep_id, bool)):
        raise DepthToolsError(f"the tokenizer record of this checkpoint has no document separator id (sep_id={sep_id!r}), "
                              "so the exported bos/eos cannot be the token its data used; pass --tokenizer none")
    if isinstance(sep_id, int):
        token = raw.id_to_token(sep_id)
        if token is None:
            raise DepthToolsError(f"{file} has no token with id {sep_id}, the document separator this checkpoint's data used")
        if isinstance(sep_name, str) and sep_name != token:
            raise DepthToolsError(f"{file}: id {sep_id} is {token!r}, but the data's separator was {sep_name!r} "
                                  "(not the tokenizer the data was prepared with)")
        sep_name = token
    tok = BPETokenizer(raw, sep_token=sep_name if isinstance(sep_name, str) else None)
    if fingerprint and tok.fingerprint() != fingerprint:
        raise DepthToolsError(f"{file} is not the tokenizer this checkpoint was trained with "
                              f"(fingerprint {tok.fingerprint()[:12]}, recorded {fingerprint[:12]})")
    if tok.vocab_size > vocab_size:
        raise DepthToolsError(f"{file} has {tok.vocab_size} tokens but the model's vocabulary is {vocab_size}")
    added = raw.get_added_tokens_decoder().get(tok.sep_id)
    if added is None or not added.special:
        raise DepthToolsError(f"the data's document separator {tok.sep_token!r} (id {tok.sep_id}) is an ordinary token of "
                              f"{file}, not a special token (text encodes to it too), so it cannot be the exported "
                              "eos/bos; prepare the data with a tokenizer that has an end-of-text special token")
    special = {"bos_token_id": tok.sep_id, "eos_token_id": tok.sep_id, "pad_token_id": tok.sep_id}
    tokens = {k: tok.sep_token for k in ("bos_token", "eos_token", "pad_token")}
    plan = TokenizerPlan("bpe", str(file), special, {
        "tokenizer_config.json": json.dumps(tokenizer_config(tok.sep_token, max_len), indent=2) + "\n",
        "special_tokens_map.json": json.dumps(tokens, indent=2) + "\n"})
    cleaned, dropped = _as_trained(_json(file))
    if dropped:
        plan.texts[TOKENIZER_JSON] = json.dumps(cleaned, indent=2, ensure_ascii=False) + "\n"
        plan.notes.append(f"exported {TOKENIZER_JSON} without the {' and '.join(dropped)} of {file} "
                          "(the training data never had them; prompts start with the separator "
                          f"{tok.sep_token!r} = bos, as every training document did)")
    else:
        plan.copies[TOKENIZER_JSON] = file
    return plan


_ADDING_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def _as_trained(head: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The tokenizer.json as depthtools encoded with it (add_special_tokens=False, no padding or
    truncation): post-processors that add tokens removed; returns (json, what was dropped)."""
    head, dropped = dict(head), []
    proc = head.get("post_processor")
    if isinstance(proc, dict):
        if proc.get("type") == "Sequence":
            kept = [p for p in proc.get("processors") or [] if p.get("type") not in _ADDING_PROCESSORS]
            if len(kept) != len(proc.get("processors") or []):
                head["post_processor"] = {**proc, "processors": kept} if kept else None
                dropped.append("post-processor's added tokens")
        elif proc.get("type") in _ADDING_PROCESSORS:
            head["post_processor"] = None
            dropped.append(f"post-processor ({proc['type']}, which adds tokens)")
    for key in ("padding", "truncation"):
        if head.get(key) is not None:
            head[key] = None
            dropped.append(f"{key} settings")
    return head, dropped


def _hf_special_ids(directory: Path, recorded: dict[str, Any] | None) -> dict[str, int | None]:
    """bos/eos/pad ids: the imported HF config's, else looked up from tokenizer_config.json."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    if recorded:
        return {k: recorded.get(k) for k in keys}
    ids: dict[str, int | None] = {k: None for k in keys}
    config, file = directory / "tokenizer_config.json", directory / TOKENIZER_JSON
    if config.is_file() and file.is_file():
        settings, tok = _json(config), Tokenizer.from_file(str(file))
        for key in keys:
            token = settings.get(key[: -len("_id")])
            token = token.get("content") if isinstance(token, dict) else token
            ids[key] = tok.token_to_id(token) if isinstance(token, str) else None
    return ids


def hf_plan(directory: Path, vocab_size: int, recorded_ids: dict[str, Any] | None) -> TokenizerPlan:
    """Carry a Hugging Face tokenizer's files (as copied at import) out unchanged."""

    copies = {name: directory / name for name in HF_CARRIED_FILES if (directory / name).is_file()}
    if TOKENIZER_JSON in copies:
        try:
            size = Tokenizer.from_file(str(copies[TOKENIZER_JSON])).get_vocab_size(with_added_tokens=True)
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise DepthToolsError(f"{copies[TOKENIZER_JSON]}: not a valid tokenizer file ({str(exc).splitlines()[0]})") from None
        if size > vocab_size:
            raise DepthToolsError(f"{copies[TOKENIZER_JSON]} has {size} tokens but the model's vocabulary is {vocab_size}")
    return TokenizerPlan("huggingface", str(directory), _hf_special_ids(directory, recorded_ids), copies=copies)


def import_separator(directory: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """The document separator an imported checkpoint records ({"sep_id", "sep_token"}): chosen from the
    folder's tokenizer.json by the rule `data prepare` uses (`depthtools.data.tokenizer.choose_separator`:
    the model's declared eos/bos special token first), so `--text` windows (which start with the recorded
    separator) and `--data` windows prepared with that tokenizer.json start with the same token. A folder
    without a readable tokenizer.json (a SentencePiece tokenizer.model) records the config's eos_token_id."""
    file = Path(directory) / TOKENIZER_JSON
    if file.is_file():
        try:
            tok = BPETokenizer.from_file(file)
        except DepthToolsError:  # no separator candidate at all: the config's eos, as before
            pass
        else:
            return {"sep_id": tok.sep_id, "sep_token": tok.sep_token}
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return {"sep_id": eos if isinstance(eos, int) and not isinstance(eos, bool) else None}


def _is_hf_tokenizer_dir(directory: Path) -> bool:
    file = directory / TOKENIZER_JSON
    if file.is_file():
        head = _json(file)
        return isinstance(head, dict) and "model" in head and not _is_depthtools_bpe(head)
    return (directory / "tokenizer.model").is_file()


def _is_depthtools_bpe(head: dict) -> bool:
    return any(t.get("content") == SEPARATOR for t in head.get("added_tokens") or [])


def _depthtools_record(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's tokenizer record when depthtools prepared its data with a tokenizer file."""
    record = config.get("tokenizer")
    if (isinstance(record, dict) and record and record.get("format") not in ("huggingface", "gguf-vocab")
            and record.get("name") != "byte"):
        return record
    return None


def _recorded_beside(directory: Path) -> dict[str, Any] | None:
    """The tokenizer record of a prepared data folder (meta.json) or a depthtools checkpoint (config.json)."""
    for name in ("meta.json", "config.json"):
        try:
            record = json.loads((directory / name).read_text(encoding="utf-8")).get("tokenizer")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("sep_id"), int) and record.get("format") != "huggingface":
            return record
    return None


def _from_path(path: Path, max_len: int, vocab_size: int, record: dict[str, Any] | None = None) -> TokenizerPlan:
    """An explicitly given tokenizer: a depthtools data dir, a tokenizer.json, or an HF tokenizer dir.

    record: the checkpoint's own tokenizer record, if depthtools prepared its data; then the given
    file must be that tokenizer (fingerprint) and the separator is the one the data used."""
    file = path if path.is_file() else path / TOKENIZER_JSON
    if path.is_dir() and not file.is_file():
        if (path / "tokenizer.model").is_file():
            return hf_plan(path, vocab_size, None)
        raise DepthToolsError(f"{path}: no {TOKENIZER_JSON} here")
    if not file.is_file():
        raise DepthToolsError(f"tokenizer {str(path)!r} not found; valid: byte, none, or a directory / tokenizer.json")
    head = _json(file)
    if isinstance(head, dict) and head.get("depthtools_tokenizer") == "byte":
        return byte_plan(max_len, str(file))
    if record is not None:
        return bpe_plan(file, max_len, vocab_size, record.get("fingerprint"), record)
    beside = _recorded_beside(file.parent)
    if beside is not None:
        return bpe_plan(file, max_len, vocab_size, beside.get("fingerprint"), beside)
    if isinstance(head, dict) and _is_depthtools_bpe(head):
        return bpe_plan(file, max_len, vocab_size, None)
    return hf_plan(file.parent, vocab_size, None)


def resolve_tokenizer(ckpt_dir: Path, config: dict[str, Any], cfg, tokenizer: str | Path | None = None) -> TokenizerPlan:
    """Decide which tokenizer an export writes.

    tokenizer: None/"auto" (what the checkpoint records), "byte", "none", or a path (a prepared
    data directory, a tokenizer.json, or a Hugging Face tokenizer directory). Auto: tokenizer files
    carried in the checkpoint directory (HF import) > the recorded byte tokenizer > the recorded
    tokenizer.json (BPE or the user's file) in the checkpoint or its recorded data directory
    (fingerprint-checked, bos/eos = the recorded separator) > no record: byte when the vocabulary
    has >= 256 ids (depthtools' default), otherwise none (with a note).
    """
    ckpt_dir, max_len, vocab = Path(ckpt_dir), cfg.max_seq_len, cfg.vocab_size
    spec = "auto" if tokenizer is None else str(tokenizer)
    if spec == "none":
        return TokenizerPlan("none", notes=["no tokenizer written (tokenizer='none')"])
    if spec == "byte":
        if vocab < 256:
            raise DepthToolsError(f"the byte tokenizer needs 256 ids but the model's vocabulary is {vocab}")
        return byte_plan(max_len, "byte")
    record = _depthtools_record(config)
    if spec != "auto":
        return _from_path(Path(spec), max_len, vocab, record)
    recorded = config.get("tokenizer") or {}
    if recorded.get("format") == "huggingface" or (not recorded and _is_hf_tokenizer_dir(ckpt_dir)):
        source = (config.get("source") or {}).get("hf_config")
        main = recorded.get("file") if recorded.get("file") in ("tokenizer.model", TOKENIZER_JSON) else TOKENIZER_JSON
        if (ckpt_dir / main).is_file():  # the carried file must be the one the import recorded
            check_tokenizer_file(ckpt_dir / main, recorded.get("fingerprint"), f"checkpoint {ckpt_dir.name}'s config.json")
        return hf_plan(ckpt_dir, vocab, source)
    if recorded.get("format") == "gguf-vocab":  # a GGUF import that knows only its vocabulary
        return TokenizerPlan("none", notes=[("the GGUF import carried no tokenizer (its vocabulary alone is "
                                             "recorded); no tokenizer written: copy the model's own tokenizer files")])
    if recorded.get("name") == "byte":
        return byte_plan(max_len, "byte (recorded)")
    if record:
        # lazy: analysis.tokens imports torch; writing tokenizer files (export-hf's plan) stays torch-free
        from depthtools.analysis.tokens import recorded_data_dir

        data = recorded_data_dir(ckpt_dir)  # found from any working directory (issue 35)
        name = record.get("file", TOKENIZER_JSON)
        candidates = [ckpt_dir / name] + ([data / name] if data else [])
        for file in candidates:
            if file.is_file():
                return bpe_plan(file, max_len, vocab, record.get("fingerprint"), record)
        where = ", ".join(str(c) for c in candidates)
        raise DepthToolsError(f"checkpoint records tokenizer {record.get('name')!r} but its file is missing ({where}); "
                              "pass --tokenizer DATA_DIR (the prepared data directory) or --tokenizer none")
    if vocab >= 256:
        plan = byte_plan(max_len, "byte (assumed)")
        plan.notes.append("no tokenizer recorded in config.json; wrote depthtools' default byte tokenizer")
        return plan
    return TokenizerPlan("none", notes=[f"no tokenizer recorded and vocabulary {vocab} < 256: no tokenizer written"])


__all__ = ["TokenizerPlan", "byte_tokenizer", "bytes_to_unicode", "import_separator", "resolve_tokenizer", "tokenizer_config",
           "BYTE_SEPARATOR", "SEPARATOR"]
