"""Tokenizers rebuilt from a GGUF file's metadata (`tokenizer.ggml.*`), as the `tokenizer.json` the model had.

llama.cpp's converter writes a vocabulary (`tokens`, one per id), `token_type` (1 normal, 2 unknown,
3 control, 4 user-defined, 5 unused, 6 byte), and either `merges` (BPE: `model` "gpt2") or `scores`
(SentencePiece: `model` "llama"), with the name of the pre-tokenizer (`pre`), a regex llama.cpp keeps in
C++. Rebuilt here with the `tokenizers` library (not transformers' GGUF converter, which is not exact for
two of them: it applies no NFC for Qwen2 and does not set Llama-3's ignore_merges):

- byte-level BPE with `pre` "gpt2"/"default" (GPT-2's own ByteLevel split), "llama-bpe" (Llama-3: its
  split regex, `ignore_merges`: a pre-token that is a vocabulary entry is taken whole) or "qwen2" (its
  regex, one digit per piece, and NFC, as Qwen2's tokenizer.json normalizes);
- SentencePiece BPE (Llama-1/2, Mistral, ... `model` "llama"): merges derived from the scores (a pair merges
  when the piece it forms exists; the higher that piece's score, the earlier: SentencePiece's own rule),
  byte fallback, "▁" for spaces and a leading "▁" unless `add_space_prefix` is false, always prepended (as
  sentencepiece, llama.cpp and Llama-2's own tokenizer.json do; transformers' conversion of a tokenizer.model
  now writes a Metaspace that skips it when the text starts with a space, which sentencepiece does not).

Control tokens become special added tokens and user-defined ones added tokens, each at its own id, as in
the original tokenizer.json; no post-processor (depthtools encodes without special tokens). Any other
kind (Gemma's SentencePiece, whose scores do not give the merge order; WordPiece, Unigram, RWKV, other
pre-tokenizers) returns the one-line reason and the weights import without a tokenizer.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from depthtools.errors import DepthToolsError

# Llama-3's and Qwen2's split regexes, as their tokenizer.json files (and llama.cpp's LLAMA3 / QWEN2 pre-types) have them
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split regex or None for GPT-2's ByteLevel split, ignore_merges, NFC)
BPE_PRE = {"gpt2": (None, False, False), "default": (None, False, False),
           "llama-bpe": (LLAMA3_SPLIT, True, False), "llama3": (LLAMA3_SPLIT, True, False),
           "llama-v3": (LLAMA3_SPLIT, True, False), "qwen2": (QWEN2_SPLIT, False, True)}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
SPM_MERGEABLE = (NORMAL, USER_DEFINED)  # SentencePiece merges into normal / user-defined pieces only


def bpe_parts(tokens: list[Any], merges: list[Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocabulary, merge pairs) of a GGUF byte-level BPE, or a one-line refusal of what `tokenizers` would choke
    on or silently get wrong: a token listed twice (one id would vanish), a merge that is not two tokens
    separated by a space, a merge of (or into) a token the list lacks."""
    vocab = vocabulary(tokens)
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not all(parts):
            raise DepthToolsError(f"GGUF tokenizer.ggml.merges entry {merge!r} is not two tokens separated by one space")
        unknown = next((t for t in (*parts, "".join(parts)) if t not in vocab), None)
        if unknown is not None:
            raise DepthToolsError(f"GGUF tokenizer.ggml.merges entry {merge!r} merges into or from {unknown!r}, which "
                                  "is not in tokenizer.ggml.tokens")
        pairs.append((parts[0], parts[1]))
    return vocab, pairs


def vocabulary(tokens: list[Any]) -> dict[str, int]:
    """token -> id, refusing a non-string token or one listed twice (one id would vanish)."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise DepthToolsError(f"GGUF tokenizer.ggml.tokens[{i}]={token!r} is not a string")
        if token in vocab:
            raise DepthToolsError(f"GGUF tokenizer.ggml.tokens lists {token!r} twice (ids {vocab[token]} and {i}); "
                                  "each token must have one id")
        vocab[token] = i
    return vocab


def token_types(meta: dict[str, Any], count: int) -> list[int]:
    """tokenizer.ggml.token_type (all normal when absent), one integer per token or a one-line refusal."""
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * count
    if not isinstance(types, list) or len(types) != count or not all(isinstance(t, int) for t in types):
        shown = f"{len(types)} entries" if isinstance(types, list) else repr(types)[:40]
        raise DepthToolsError(f"GGUF tokenizer.ggml.token_type has {shown}; expected one integer per token ({count})")
    return types


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's BPE encoding: every split of a normal/user-defined piece into two
    pieces of the vocabulary is a merge, ranked by the piece's score (highest first; then by the pieces' ids)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in SPM_MERGEABLE}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _scores(meta: dict[str, Any], count: int) -> list[float]:
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != count or not all(isinstance(s, (int, float)) for s in scores):
        shown = f"{len(scores)} entries" if isinstance(scores, list) else "none"
        raise DepthToolsError(f"GGUF tokenizer.ggml.scores has {shown}; a SentencePiece vocabulary needs one number "
                              f"per token ({count})")
    return [float(s) for s in scores]


def sentencepiece(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    """A SentencePiece BPE vocabulary (tokenizer.ggml.model "llama") as Llama-2's tokenizer.json has it: BPE with
    byte fallback, spaces as "▁", a leading "▁" (add_space_prefix, default true)."""
    vocab = vocabulary(tokens)
    merges = spm_merges(tokens, _scores(meta, len(tokens)), types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", next((i for i, k in enumerate(types) if k == UNKNOWN), None))
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def byte_level(meta: dict[str, Any], tokens: list[str], pre: str) -> Tokenizer:
    """A byte-level BPE (tokenizer.ggml.model "gpt2") with the pre-tokenizer `pre` names (a key of BPE_PRE)."""
    vocab, pairs = bpe_parts(tokens, meta["tokenizer.ggml.merges"])
    split, ignore_merges, nfc = BPE_PRE[pre]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def add_special(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones as added tokens (matched whole in text), at
    their own ids (each is in the model's vocabulary)."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def unsupported(meta: dict[str, Any]) -> str | None:
    """Why the file's tokenizer cannot be rebuilt exactly (None: it can)."""
    model, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model is None:
        return "the file has no tokenizer metadata"
    if model == "gpt2" and pre not in BPE_PRE:
        return (f"byte-level BPE with pre-tokenizer {pre!r} cannot be rebuilt exactly from GGUF (rebuilt: "
                f"{', '.join(BPE_PRE)})")
    if model == "llama" and isinstance(arch, str) and arch.startswith("gemma"):
        return ("Gemma's SentencePiece vocabulary cannot be rebuilt exactly from GGUF (its scores do not give the "
                "merge order)")
    if model not in ("gpt2", "llama"):
        return f"tokenizer model {model!r} cannot be rebuilt exactly from GGUF (rebuilt: gpt2 BPE, llama SentencePiece)"
    if model == "llama" and meta.get("tokenizer.ggml.scores") is None:
        return "a SentencePiece vocabulary without tokenizer.ggml.scores cannot be rebuilt (they give the merge order)"
    return None


def gguf_tokenizer(meta: dict[str, Any], vocab_size: int) -> tuple[Tokenizer | None, str | None]:
    """(tokenizers.Tokenizer, None) rebuilt exactly from the file's metadata, or (None, why not in one line);
    a malformed vocabulary is a one-line DepthToolsError."""
    why = unsupported(meta)
    if why is not None:
        return None, why
    tokens = meta.get("tokenizer.ggml.tokens")
    model = meta["tokenizer.ggml.model"]
    if not tokens or (model == "gpt2" and meta.get("tokenizer.ggml.merges") is None):
        return None, "the file's tokenizer has no tokens or merges"
    if len(tokens) > vocab_size:
        raise DepthToolsError(f"GGUF tokenizer has {len(tokens)} tokens but the embedding has only {vocab_size} rows")
    types = token_types(meta, len(tokens))
    if model == "gpt2":
        tok = byte_level(meta, list(tokens), meta.get("tokenizer.ggml.pre", "default"))
    else:
        tok = sentencepiece(meta, list(tokens), types)
    add_special(tok, list(tokens), types)
    return tok, None


__all__ = ["gguf_tokenizer", "bpe_parts", "spm_merges", "BPE_PRE", "LLAMA3_SPLIT", "QWEN2_SPLIT"]
