"""Fixtures shared across test modules (builders to import are in tiny_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import prepare_tiny


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """The tiny fixture corpus as a byte-level dataset (one 'text' domain), prepared once per run
    and only read by the tests that use it (training, distributed training, interop)."""
    return prepare_tiny(tmp_path_factory.mktemp("data"))
