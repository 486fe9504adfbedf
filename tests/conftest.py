"""Fixtures shared across test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_CORPUS = Path(__file__).resolve().parent / "fixtures" / "tiny_corpus"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The tiny fixture corpus as a byte-level dataset (one 'text' domain), prepared once per run
    and only read by the tests that use it (training, distributed training, interop)."""
    from depthtools.data import prepare

    return prepare("text-dir", out_dir=tmp_path_factory.mktemp("data"), text_dir=TINY_CORPUS, val_fraction=0.3)
