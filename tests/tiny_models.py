"""Shared test builders: tiny models, fixed token windows, one intra-op thread, the tiny corpus.

Import what a test module needs from here (`from tiny_models import one_thread, tiny, windows`)
instead of copying it; `one_thread` is an autouse fixture, so importing it pins the module.
"""

from pathlib import Path

import pytest
import torch

from depthtools.arch import DepthModel
from depthtools.config import ModelConfig

VOCAB = 61
TINY_CORPUS = Path(__file__).resolve().parent / "fixtures" / "tiny_corpus"
# The shape every training test trains (byte-level vocabulary, 2 blocks, context 32): a cell in seconds.
SMALL = dict(vocab_size=256, d_model=32, n_layer=2, n_heads=2, max_seq_len=32)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine they lose a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(arch: str, n_layer: int = 4, vocab: int = VOCAB, context: int = 24, *, seed: int = 0,
         at_init: bool = False, **options) -> DepthModel:
    """A d=32, 4-head model in eval mode; `options` are the architecture's options.

    Default: float64 with every parameter moved off its init (zero-init gates hide nothing).
    at_init=True: the float32 model exactly as DepthModel(cfg, seed) initialises it, for tests that
    rely on a known initialisation (identity routing at init, zeroed blocks, float32 tolerances).
    """
    cfg = ModelConfig(arch=arch, vocab_size=vocab, d_model=32, n_layer=n_layer, n_heads=4, max_seq_len=context,
                      options=options)
    model = DepthModel(cfg, seed=seed).eval()
    if not at_init:
        perturb(model.double())
    return model


def perturb(model: DepthModel, scale: float = 0.05) -> DepthModel:
    """Move every parameter off its init (a fixed generator: the same model every time)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def windows(n: int = 3, length: int = 13, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """n fixed token windows of `length` ids below `vocab`."""
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def prepare_tiny(out_dir: Path, **kw) -> Path:
    """The tiny fixture corpus as a byte-level dataset under out_dir (the settings conftest's
    session `data_dir` uses; pass kw such as seed, tokenizer or force to vary them). Use the
    session fixture unless the test changes or rebuilds the dataset."""
    from depthtools.data import prepare

    return prepare("text-dir", out_dir=out_dir, text_dir=TINY_CORPUS, **{"val_fraction": 0.3, **kw})


class SimulatedKill(BaseException):
    """What `train_killed_after` raises inside the trainer (a BaseException, like the KeyboardInterrupt or
    SystemExit of a real kill, so no `except Exception` in the trainer can swallow it)."""


def train_killed_after(step: int, model_cfg, recipe, data_dir: Path, out: Path) -> None:
    """Train a cell and stop it abruptly right after the metrics record of `step` is written, the way a
    kill between two checkpoints would; the caller then resumes with train_cell and compares."""
    from depthtools.train import loop, train_cell

    real_append = loop._append_metrics

    def append_then_die(run, record):
        real_append(run, record)
        if record["step"] == step:
            raise SimulatedKill(f"simulated kill after step {step}")

    loop._append_metrics = append_then_die
    try:
        with pytest.raises(SimulatedKill):
            train_cell(model_cfg, recipe, data_dir, out)
    finally:
        loop._append_metrics = real_append
