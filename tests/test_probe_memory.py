"""Memory that does not grow with layers × vocabulary: no tensor any probe creates is larger than one
batch's logits [B, T, V] (or the embedding matrix, whose transposed views the unembedding returns), whatever the depth (a structural check of every op's output, recorded with a
TorchDispatchMode, on the same model shape at two depths)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from depthtools.analysis import suite
from depthtools.analysis.suite import analysis_args

from tiny_models import one_thread, tiny, windows  # noqa: F401 (fixture)

VOCAB = 512  # larger than L·d of these models, so an [L × tokens × V] or [L × tokens × d] stack would show


class LargestTensor(TorchDispatchMode):
    """Records the largest numel of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def largest(name: str, n_layer: int, tokens: torch.Tensor, batch: int) -> int:
    model = tiny("preln", n_layer=n_layer, vocab=VOCAB, context=16)
    args = analysis_args(name, batch_size=batch)
    with LargestTensor() as mode:
        suite.ANALYSES[name].run(model, tokens, suite.Probe(), **args)
    return mode.largest


@pytest.mark.parametrize("name", ["lens_logit", "ablate_skip", "ablate_swap", "ablate_mean", "ablate_prune",
                                  "causal", "sequence_profile"])
def test_no_probe_tensor_grows_with_layers_times_vocabulary(name):
    tokens = windows(n=4, length=11, vocab=VOCAB)
    batch, T = 2, tokens.shape[1] - 1
    weight = max(p.numel() for p in tiny("preln", n_layer=2, vocab=VOCAB, context=16).parameters())  # V×d views
    one_batch_logits = max(batch * T * VOCAB, weight)
    shallow, deep = largest(name, 2, tokens, batch), largest(name, 6, tokens, batch)
    assert deep <= one_batch_logits, f"{name}: a tensor of {deep} elements > one batch's logits {one_batch_logits}"
    assert deep == shallow  # three times the layers, the same largest tensor


def test_the_check_sees_a_layers_times_vocabulary_stack():
    """The recorder is not blind: stacking every depth's logits is caught."""
    model = tiny("preln", n_layer=4, vocab=VOCAB, context=16)
    inputs = windows(n=2, length=10, vocab=VOCAB)
    with LargestTensor() as mode, torch.no_grad():
        torch.stack([model.head(s) for s in model.run_states(inputs)])
    assert mode.largest == 5 * 2 * 10 * VOCAB
