"""Shared builders for analysis tests: tiny float64 models moved off their init, fixed token windows."""

import pytest
import torch

from depthtools.arch import DepthModel
from depthtools.config import ModelConfig

VOCAB = 61


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine they lose a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(arch: str, n_layer: int = 4, vocab: int = VOCAB, context: int = 24) -> DepthModel:
    """A d=32 model in float64, every parameter moved off its init (zero-init gates hide nothing)."""
    cfg = ModelConfig(arch=arch, vocab_size=vocab, d_model=32, n_layer=n_layer, n_heads=4, max_seq_len=context)
    model = DepthModel(cfg, seed=0).double().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def windows(n: int = 3, length: int = 13, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
