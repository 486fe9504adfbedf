"""The fixed evaluation token set every depth probe runs on (docs/reference/metrics.md §0).

A token set is a LongTensor [N, T+1]: the model reads `tokens[:, :-1]` (T positions) and position t
is scored against `tokens[:, t+1]`, as in the trainer's evaluation windows. Position 0 (the first
token, an attention sink) is excluded from every metric, so a set needs T >= 2.

`sample_windows(data_dir, ...)` draws the windows from a prepared data directory with a fixed seed,
so every model of a grid that shares a tokenizer sees exactly the same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from depthtools.checkpoint import CONFIG, imported_from, read_json
from depthtools.config import ModelConfig
from depthtools.data import load_split, read_meta
from depthtools.data.tokenizer import (
    TOKENIZER_SPECS,
    check_tokenizer_file,
    tokenizer_file_fingerprint,
    tokenizer_vocab_fingerprint,
)
from depthtools.errors import DepthToolsError

FIRST_SCORED = 1  # position 0 is never scored


def sample_windows(
    data_dir: str | Path, n_tokens: int, seq_len: int, split: str = "val", seed: int = 0, cap: bool = False
) -> torch.LongTensor:
    """ceil(n_tokens / seq_len) windows [N, seq_len+1] at seeded random offsets of one split.

    Offsets come from `numpy.random.default_rng(seed)` and are sorted, so the same arguments give the
    same tokens on every machine. A split shorter than one window is a clear error. A split that holds
    fewer tokens than asked is said in `windows.notes` (`split_note`); `cap` then takes only the windows
    it holds without overlap (the CLI's default when --n-tokens is not given).
    """
    if n_tokens < 1:
        raise DepthToolsError(f"empty token set: --tokens must be >= 1, got {n_tokens}")
    if seq_len < 2:
        raise DepthToolsError(f"seq_len must be >= 2 (position 0 is not scored), got {seq_len}")
    ids = load_split(data_dir, split)
    return _windows(ids, n_tokens, seq_len, seed, f"split {split!r} of {data_dir}", cap)


def text_windows(ckpt_dir: Path, text_file: Path, n_tokens: int, seq_len: int, seed: int = 0,
                 cap: bool = False) -> torch.LongTensor:
    """Evaluation windows from a UTF-8 text file tokenized with the checkpoint's own tokenizer (the byte
    tokenizer, or the tokenizer.json it carries), the document separator first as `data prepare` writes it;
    windows at seeded offsets as `sample_windows`. A checkpoint without a tokenizer is refused."""
    config = read_json(ckpt_dir / CONFIG) if (ckpt_dir / CONFIG).is_file() else {}
    record = config.get("tokenizer") if isinstance(config.get("tokenizer"), dict) else {}
    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DepthToolsError(f"--text {text_file}: not a readable UTF-8 text file ({exc})") from None
    sep = record.get("sep_id")
    if record.get("name") == "byte":
        ids = list(text.replace("\0", "").encode("utf-8"))
    else:
        file = ckpt_dir / str(record.get("file") or "tokenizer.json")
        if file.name != "tokenizer.json" or not file.is_file():
            raise DepthToolsError(f"checkpoint {ckpt_dir.name} carries no tokenizer.json to tokenize --text with; "
                                  "pass --data DIR prepared with its tokenizer")

        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise DepthToolsError(f"{file}: not a valid tokenizer file ({str(exc).splitlines()[0]})") from None
        check_tokenizer_file(file, record.get("fingerprint"), f"checkpoint {ckpt_dir.name}'s config.json")
        tok.encode_special_tokens = True  # special tokens written in the text are text, as in data prepare
        ids = tok.encode(text, add_special_tokens=False).ids
    if isinstance(sep, int) and not isinstance(sep, bool):
        ids = [sep, *ids]
    return _windows(np.asarray(ids, dtype=np.int64), n_tokens, seq_len, seed, f"--text {text_file}", cap)


def split_note(where: str, held: int, n_tokens: int, seq_len: int, cap: bool) -> tuple[int, str | None]:
    """(windows to draw, a note or None) when `held` tokens cannot give n_tokens without overlap.

    ceil(n_tokens / seq_len) windows of seq_len + 1 tokens need that many tokens; a shorter source (one
    long text file leaves a validation split of a few hundred tokens) would be resampled over and over,
    which looks like a bigger evaluation set than it is. `cap` takes the whole windows it holds instead."""
    span = seq_len + 1
    asked = math.ceil(n_tokens / seq_len)
    fit = held // span
    if asked <= fit:
        return asked, None
    if cap:
        return max(1, fit), (f"{where} holds {held:,} tokens: evaluating on {max(1, fit)} window(s) of {seq_len} "
                             f"({max(1, fit) * seq_len:,} tokens) instead of the default {n_tokens:,}; pass "
                             "--n-tokens N to sample more (overlapping) windows of it")
    return asked, (f"{where} holds {held:,} tokens: the {n_tokens:,} tokens asked resample it about "
                   f"{asked * span / held:.0f} times (overlapping windows, not more evidence)")


def _windows(ids, n_tokens: int, seq_len: int, seed: int, where: str, cap: bool = False) -> torch.LongTensor:
    """ceil(n_tokens / seq_len) windows [N, seq_len+1] of `ids` at sorted seeded offsets (capped by
    `split_note`); the note, if any, in the result's `notes`."""
    span = seq_len + 1
    if len(ids) < span:
        raise DepthToolsError(f"empty token set: {where} has {len(ids)} tokens, fewer than one window of {span}")
    n_windows, note = split_note(where, len(ids), n_tokens, seq_len, cap)
    if note and cap:  # the whole windows the source holds, side by side: no token counted twice
        offsets = np.arange(n_windows) * span
    else:
        offsets = np.sort(np.random.default_rng(seed).integers(0, len(ids) - span + 1, size=n_windows))
    windows = torch.from_numpy(np.stack([np.asarray(ids[o:o + span], dtype=np.int64) for o in offsets]))
    windows.notes = [note] if note else []
    return windows


def check_tokens(model, tokens: torch.Tensor) -> torch.LongTensor:
    """Validate a token set for `model` and return it as int64 on the model's device."""
    check_token_set(tokens, model.config.max_seq_len, model.config.vocab_size,
                    f"{model.config.arch}, L={model.n_layer}")
    device = next(model.parameters()).device
    return tokens.to(device=device, dtype=torch.long)


def check_token_set(tokens: torch.Tensor, context: int, vocab: int, label: str) -> None:
    """Refuse a token set a model of this context and vocabulary cannot read (one line each). Needs only
    the model's config, so a probe checks its windows before the weights are loaded (`config_limits`)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise DepthToolsError(f"tokens must be a LongTensor [N, T+1], got {shape}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
        raise DepthToolsError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    if tokens.numel() == 0 or tokens.shape[0] == 0:
        raise DepthToolsError("empty token set: need at least one sequence")
    if tokens.shape[1] < FIRST_SCORED + 2:
        raise DepthToolsError(
            f"token windows of length {tokens.shape[1]} leave no scored position; need T+1 >= 3 "
            "(position 0 is excluded)"
        )
    if tokens.shape[1] - 1 > context:
        raise DepthToolsError(
            f"seq-len {tokens.shape[1] - 1} exceeds the model's context {context} "
            f"({label}); use --seq-len <= {context}"
        )
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        raise DepthToolsError(
            f"token ids {int(tokens.min())}..{int(tokens.max())} do not fit the model's vocabulary 0..{vocab - 1} "
            "(wrong tokenizer or data dir?)"
        )


def config_limits(ckpt_dir: str | Path) -> tuple[int, int, str]:
    """(context, vocabulary size, "arch, L=n") from a checkpoint's config.json, without reading its weights:
    what `check_token_set` needs to refuse windows before a model is loaded."""
    ckpt_dir = Path(ckpt_dir)
    section = read_json(ckpt_dir / CONFIG).get("model")
    section = section if isinstance(section, dict) else {}
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}  # what `load` fills in for a missing key
    values = {k: section.get(k, defaults[k]) for k in ("max_seq_len", "vocab_size", "n_layer")}
    bad = [k for k in ("max_seq_len", "vocab_size") if not isinstance(values[k], int) or isinstance(values[k], bool)
           or values[k] < 1]
    if bad:
        raise DepthToolsError(f"config.json in {ckpt_dir} has no valid model.{bad[0]} ({values[bad[0]]!r})")
    return values["max_seq_len"], values["vocab_size"], f"{section.get('arch')}, L={values['n_layer']}"


def split_inputs(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [B,T], scored targets [B,T-1]) of windows [B,T+1]; targets skip position 0."""
    return batch[:, :-1], batch[:, FIRST_SCORED + 1:]


def batches(tokens: torch.Tensor, batch_size: int):
    """Consecutive sequence batches of a token set."""
    if batch_size < 1:
        raise DepthToolsError(f"batch size must be >= 1, got {batch_size}")
    for start in range(0, tokens.shape[0], batch_size):
        yield tokens[start:start + batch_size]


def n_batches(tokens: torch.Tensor, batch_size: int) -> int:
    return math.ceil(tokens.shape[0] / batch_size)


def token_fingerprint(tokens: torch.Tensor) -> str:
    """A short content hash of a token set, recorded in saved settings."""
    data = tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return hashlib.sha256(data + str(tuple(tokens.shape)).encode()).hexdigest()[:16]


def data_dir_candidates(ckpt_dir: str | Path, record: dict) -> list[Path]:
    """Where a checkpoint's training data may be, most likely first, from its config.json "data" record.

    - "path_from_checkpoint" joined to the checkpoint folder (lexically, as it was computed): right
      after the checkpoint and data tree moved together;
    - "path" when absolute (checkpoints trained since issue 35): right from any working directory;
    - "path" when relative (older checkpoints: relative to the folder training ran in): first from the
      current folder (where it always worked), then from each folder above the checkpoint, since
      training usually ran in an ancestor of `checkpoints/` (a notebook in `notebooks/` finds it).
    """
    ckpt_dir = Path(ckpt_dir).absolute()
    out: list[Path] = []
    relative = record.get("path_from_checkpoint")
    if isinstance(relative, str) and relative:
        out.append(Path(os.path.normpath(os.path.join(ckpt_dir, relative))))
    recorded = record.get("path")
    if isinstance(recorded, str) and recorded:
        path = Path(recorded)
        out.append(path)
        if not path.is_absolute():
            out += [parent / path for parent in ckpt_dir.parents]
    unique: list[Path] = []
    for candidate in out:
        if candidate not in unique:
            unique.append(candidate)
    return unique


def _fingerprint(data_dir: Path) -> str | None:
    try:
        return json.loads((data_dir / "meta.json").read_text(encoding="utf-8")).get("data_fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def recorded_data_dir(ckpt_dir: str | Path) -> Path | None:
    """The data directory recorded in a checkpoint's config.json (None if none is recorded).

    Tried in `data_dir_candidates` order: the first folder holding the recorded data fingerprint wins;
    failing that, the first folder that exists (`checkpoint_data_dir` then says its data changed);
    failing that, the recorded path as written (for the error message)."""
    path = Path(ckpt_dir) / CONFIG
    if not path.is_file():
        return None
    data = read_json(path).get("data") or {}
    if not isinstance(data, dict) or not data.get("path"):
        return None
    candidates = data_dir_candidates(ckpt_dir, data)
    existing = [c for c in candidates if c.is_dir()]
    wanted = data.get("data_fingerprint")
    for candidate in existing:
        if wanted and _fingerprint(candidate) == wanted:
            return candidate
    return existing[0] if existing else Path(data["path"])


def _tokenizer_label(record: dict) -> str:
    fingerprint = record.get("fingerprint")
    return f"{record.get('name')!r}" + (f" ({str(fingerprint)[:12]})" if fingerprint else "")


def _carried_fingerprint(ckpt_dir: Path, record: dict) -> str | None:
    """The data-prepare fingerprint of the tokenizer.json an imported checkpoint carries: checkpoints
    imported before import and data prepare shared one fingerprint recorded the file's raw sha256."""
    if record.get("format") != "huggingface" or record.get("file") != "tokenizer.json":
        return None

    file = Path(ckpt_dir) / "tokenizer.json"
    return tokenizer_file_fingerprint(file) if file.is_file() else None


def checkpoint_data_dir(ckpt_dir: str | Path, data: str | Path | None = None) -> Path:
    """The prepared data directory a checkpoint is evaluated on — `data`, else the one its config.json
    records — after checking that it fits the checkpoint (one-line DepthToolsError otherwise):

    - tokenizer: the data's tokenizer must be the one the checkpoint was trained with (fingerprint,
      else name), in both directions (byte data under a BPE model, BPE data under a byte model);
    - content: when the folder is the checkpoint's recorded data folder, its data fingerprint must be
      the recorded one (a folder re-prepared since training no longer holds the training data).

    Checkpoints without these records (saved outside the trainer) are not checked. Every command that
    samples evaluation tokens for a checkpoint resolves its data folder here.
    """
    ckpt_dir = Path(ckpt_dir)
    recorded = recorded_data_dir(ckpt_dir)
    if data is not None:
        data_dir = Path(data)
        if not data_dir.is_dir():
            raise DepthToolsError(f"--data {data_dir} is not a directory (prepare one with `depthtools data prepare`)")
    elif recorded is None:
        raise DepthToolsError(f"checkpoint {ckpt_dir.name} records no data directory; pass --data DIR (a prepared data dir)")
    elif not recorded.is_dir():
        raise DepthToolsError(f"data directory {recorded} recorded in {ckpt_dir.name} does not exist (looked for it "
                              f"from the checkpoint folder and from {Path.cwd()}); pass --data DIR")
    else:
        data_dir = recorded
    meta = read_meta(data_dir)
    config = read_json(ckpt_dir / CONFIG) if (ckpt_dir / CONFIG).is_file() else {}
    config = config if isinstance(config, dict) else {}
    trained, given = config.get("tokenizer"), meta.get("tokenizer") or {}
    if isinstance(trained, dict) and trained.get("vocab_fingerprint") and not trained.get("fingerprint"):
        _check_vocabulary(ckpt_dir, trained, data_dir, given)
    elif isinstance(trained, dict) and trained.get("name") is not None:
        if trained.get("fingerprint") and given.get("fingerprint"):
            same = given["fingerprint"] in (trained["fingerprint"], _carried_fingerprint(ckpt_dir, trained))
        else:
            same = trained.get("name") == given.get("name")
        if not same:
            record = config.get("data") if isinstance(config.get("data"), dict) else {}
            spec = (record.get("settings") or {}).get("tokenizer") if isinstance(record.get("settings"), dict) else None
            spec = spec if spec in TOKENIZER_SPECS else trained.get("name") if trained.get("name") in TOKENIZER_SPECS else None
            hint = f" (depthtools data prepare --tokenizer {spec})" if spec else ""

            how = "was imported with" if imported_from(config) else "was trained with"
            raise DepthToolsError(
                f"checkpoint {ckpt_dir.name} {how} tokenizer {_tokenizer_label(trained)} but {data_dir} "
                f"is tokenized with {_tokenizer_label(given)}; pass --data a folder prepared with the checkpoint's "
                f"tokenizer{hint}"
            )
    record = config.get("data")
    wanted = record.get("data_fingerprint") if isinstance(record, dict) else None
    if wanted and recorded is not None and _same_dir(data_dir, recorded) and meta.get("data_fingerprint") != wanted:
        raise DepthToolsError(
            f"{data_dir} no longer holds the data checkpoint {ckpt_dir.name} was trained on (data fingerprint "
            f"{str(meta.get('data_fingerprint'))[:12]}, config.json records {str(wanted)[:12]}): it was prepared "
            "again with other settings; restore it, or prepare the new data under another name and pass --data"
        )
    return data_dir


def _check_vocabulary(ckpt_dir: Path, trained: dict, data_dir: Path, given: dict) -> None:
    """A checkpoint that knows only its vocabulary (a GGUF import whose tokenizer could not be rebuilt:
    `vocab_fingerprint` of the file's token list) accepts data whose tokenizer.json has that vocabulary,
    and refuses any other in one line, whatever its ids happen to fit."""
    file = data_dir / str(given.get("file") or "tokenizer.json")
    found = None
    if given.get("name") != "byte" and file.is_file():
        try:
            found = tokenizer_vocab_fingerprint(Tokenizer.from_file(str(file)))
        except Exception:  # tokenizers raises plain Exception subclasses; an unreadable file is no match
            found = None
    if found != trained["vocab_fingerprint"]:
        what = f"vocabulary {found[:12]}" if found else f"tokenizer {given.get('name')!r}"
        raise DepthToolsError(
            f"checkpoint {ckpt_dir.name} was imported with the vocabulary of its GGUF file "
            f"({str(trained['vocab_fingerprint'])[:12]}, {trained.get('vocab_size')} tokens) but {data_dir} is "
            f"tokenized with {what}; pass --data a folder prepared with the model's original tokenizer.json")


def separator_note(ckpt_dir: str | Path, data_dir: str | Path) -> str | None:
    """A note when the data's document separator is not the one the checkpoint records (data of an imported
    model prepared before `import-hf` and `data prepare` chose it by one rule): its windows then start with
    another token than the `--text` windows do. Not a refusal: the tokenizer is the same."""
    try:
        record = (read_json(Path(ckpt_dir) / CONFIG).get("tokenizer") or {}).get("sep_id")
        given = (read_meta(data_dir).get("tokenizer") or {}).get("sep_id")
    except (DepthToolsError, AttributeError):
        return None
    if isinstance(record, int) and isinstance(given, int) and record != given:
        return (f"{data_dir} separates documents with token {given}, but checkpoint {Path(ckpt_dir).name} records "
                f"{record} (what --text puts first): prepare the data again for windows that start alike")
    return None


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False
