"""Cost of TransformerLens HookPoints when no hook is attached (target: <= 1.05x).

Compares DepthModel's forward with the same model whose HookPoints are replaced by a plain
Python identity function (i.e. "removed": no nn.Module call at all), same weights, same input,
interleaved repetitions, median of per-rep times.

    python benchmarks/bench_hooks.py [--arch preln] [--layers 32] [--d-model 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformer_lens.hook_points import HookPoint

from depthtools.arch import DepthModel
from depthtools.config import ModelConfig


class _Identity:
    """A bare callable standing where a HookPoint was (keeps the empty hook dicts the model checks)."""

    _forward_hooks: dict = {}

    def __call__(self, x):
        return x


_identity = _Identity()


def strip_hook_points(model: torch.nn.Module) -> int:
    """Replace every HookPoint submodule by a plain function; returns how many were removed."""
    removed = 0
    for module in list(model.modules()):
        for name, child in list(module._modules.items()):
            if isinstance(child, HookPoint):
                del module._modules[name]
                object.__setattr__(module, name, _identity)
                removed += 1
    return removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="preln")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(arch=args.arch, vocab_size=256, d_model=args.d_model, n_layer=args.layers,
                      n_heads=4, max_seq_len=args.seq)
    hooked = DepthModel(cfg, seed=0).eval()
    plain = copy.deepcopy(hooked)
    removed = strip_hook_points(plain)
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    with torch.inference_mode():
        assert torch.equal(hooked(tokens), plain(tokens))
        times = {"hooked": [], "plain": []}
        for _ in range(3):
            hooked(tokens), plain(tokens)
        for _ in range(args.reps):
            for name, model in (("hooked", hooked), ("plain", plain)):
                start = time.perf_counter()
                model(tokens)
                times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"arch={args.arch} L={args.layers} d={args.d_model} batch={args.batch} seq={args.seq} "
          f"threads={args.threads} hook_points_removed={removed}")
    print(f"forward with HookPoints (none attached): {med['hooked'] * 1e3:.2f} ms")
    print(f"forward with HookPoints removed:         {med['plain'] * 1e3:.2f} ms")
    print(f"ratio hooked/plain: {med['hooked'] / med['plain']:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
