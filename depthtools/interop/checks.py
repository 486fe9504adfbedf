"""What an import must check before it writes a checkpoint, with the rules `checkpoint.load` applies.

A checkpoint that `load` would refuse must not be written by `import-hf` in the first place: an
int64 tensor is not cast to float (it would become a meaningless model), a NaN/inf weight is not
copied (every probe would be NaN), and a tokenizer that cannot be read, or whose ids do not fit
the model's embedding, is not carried beside the weights (export and `lens --text` would refuse it
later, far from the cause). Each check is one small function of what was read, independent of the
model family, so every importer can call it; each refusal is one `DepthToolsError` line naming
the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from tokenizers import Tokenizer

from depthtools.checkpoint import tensor_problem
from depthtools.errors import DepthToolsError
from depthtools.fsutil import read_json_object

# tokenizer-side JSON files an HF folder may hold; each must be a JSON object when present
TOKENIZER_JSON_OBJECTS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                          "chat_template.json", "generation_config.json")
SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def validate_imported_weights(tensors: Mapping[str, Any], source: str | Path | Callable[[str], Any]) -> None:
    """Refuse tensors that `checkpoint.load` would refuse: a non-floating dtype or a NaN/inf entry.

    `tensors`: the tensors the import will use (name -> torch.Tensor, in the source's own names).
    `source`: the file they came from, or a function giving the file of a tensor name (sharded
    checkpoints). Checked before any cast, so an int64 tensor is reported as int64."""
    for key in sorted(tensors):
        problem = tensor_problem(key, tensors[key])
        if problem is not None:
            where = source(key) if callable(source) else source
            raise DepthToolsError(f"cannot import {where}: {problem}")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_ids(ids: list[int], vocab_size: int, file: Path, what: str) -> None:
    if ids and max(ids) >= vocab_size:
        raise DepthToolsError(f"cannot import {file}: its {what} has token ids up to {max(ids)} ({len(ids)} tokens), "
                              f"but the model's vocabulary (config.json vocab_size) is {vocab_size}: it is not this "
                              "model's tokenizer")


def _tokenizer_json(file: Path, vocab_size: int) -> None:
    """A `tokenizers` file must load, and every id it can produce must index the embedding."""
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception subclasses on a bad file
        raise DepthToolsError(f"cannot import {file}: not a valid tokenizer file ({_first_line(exc)})") from None
    _check_ids(list(tok.get_vocab(with_added_tokens=True).values()), vocab_size, file, "vocabulary")


def _sentencepiece(file: Path, vocab_size: int) -> None:
    """A sentencepiece model must load (when sentencepiece is installed) and fit the embedding."""
    if file.stat().st_size == 0:
        raise DepthToolsError(f"cannot import {file}: the sentencepiece model file is empty")
    try:
        import sentencepiece  # optional dependency
    except ImportError:
        return  # nothing reads it here; transformers will, where it is used
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(file.read_bytes())
    except Exception as exc:  # sentencepiece raises RuntimeError/OSError with a C++ message
        raise DepthToolsError(f"cannot import {file}: not a valid sentencepiece model ({_first_line(exc)})") from None
    size = processor.GetPieceSize()
    _check_ids(list(range(size)), vocab_size, file, "sentencepiece vocabulary")


def _json_objects(directory: Path, names: set[str], vocab_size: int) -> None:
    for name in TOKENIZER_JSON_OBJECTS:
        file = directory / name
        if name not in names:
            continue
        obj = read_json_object(file, f"a tokenizer file carried into the checkpoint ({name})", DepthToolsError)
        if name in ("vocab.json", "added_tokens.json"):
            ids = list(obj.values())
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise DepthToolsError(f"cannot import {file}: token ids must be integers")
            _check_ids(ids, vocab_size, file, "vocabulary")


def check_special_ids(hf_config: Mapping[str, Any], vocab_size: int, file: str | Path) -> None:
    """bos/eos/pad ids in an HF config.json must be ids of the model (eos may be a list); negative ids
    (some configs' "no pad token") are left alone."""
    for key in SPECIAL_ID_KEYS:
        value = hf_config.get(key)
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and v >= vocab_size:
                raise DepthToolsError(f"cannot import {file}: {key}={value!r} is not an id of the model's vocabulary "
                                      f"(vocab_size {vocab_size})")


def validate_tokenizer(directory: str | Path, vocab_size: int, files: tuple[str, ...] | None = None) -> None:
    """Refuse the tokenizer files of an HF folder that cannot be read or do not fit a `vocab_size` model.

    tokenizer.json must load with `tokenizers`; tokenizer.model with sentencepiece (if installed);
    the JSON side files must be JSON objects; every token id any of them can produce must be below
    `vocab_size` (a model may have more ids than its tokenizer, never fewer). `files`: the names the
    import will carry (default: every known tokenizer file present)."""
    directory = Path(directory)
    names = files if files is not None else ("tokenizer.json", "tokenizer.model", *TOKENIZER_JSON_OBJECTS)
    present = {name for name in names if (directory / name).is_file()}
    if "tokenizer.json" in present:
        _tokenizer_json(directory / "tokenizer.json", vocab_size)
    if "tokenizer.model" in present:
        _sentencepiece(directory / "tokenizer.model", vocab_size)
    _json_objects(directory, present, vocab_size)


__all__ = ["validate_imported_weights", "validate_tokenizer", "check_special_ids"]
