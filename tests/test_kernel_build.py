"""The CPU kernels (depthtools/arch/csrc) build only on the first real CPU call: importing depthtools and planning a
grid on `meta` start no compiler; without a compiler the torch twin runs and `kernel_status` says so (each of
these in a fresh interpreter, so nothing this test process already built or imported hides a build); a build
lock left by a killed builder does not hang the next build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILERS = ("cc", "gcc", "clang", "c++", "g++", "clang++", "ninja")  # ninja: cpp_extension builds with it


def _run(code: str, path: Path, cache: Path) -> dict:
    """Run `code` (which prints one JSON line last) with PATH = `path` only and the kernel cache in `cache`."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(PATH=str(path), DEPTHTOOLS_COMPILE_CACHE=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_and_a_meta_grid_plan_start_no_compiler(tmp_path):
    """Every compiler name (and ninja) on PATH is a stub that records its call: `import depthtools` and a grid plan
    over every architecture with C kernels (models built on `meta` to count parameters) never call one, and the
    kernel cache stays empty."""
    bin_dir, calls, cache = tmp_path / "bin", tmp_path / "compiler_calls.txt", tmp_path / "cache"
    bin_dir.mkdir()
    for name in COMPILERS:
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "$0 $*" >> "{calls}"\nexit 1\n')
        stub.chmod(0o755)
    code = (
        "import json, depthtools\n"
        "cells = depthtools.plan_grid(['hc', 'mhc', 'attnres', 'blockattnres', 'moda'], '1.6M', layers=[4, 8], tolerance=0.5)\n"
        "from depthtools.arch import cpu_kernels\n"
        "print(json.dumps({'cells': len(cells), 'libs': sorted(cpu_kernels._libs),"
        " 'status': cpu_kernels.kernel_status()}))\n"
    )
    out = _run(code, bin_dir, cache)
    assert out["cells"] == 10
    assert not calls.exists(), calls.read_text()
    assert out["libs"] == []  # no library was even attempted
    assert not (cache / "depthtools_kernels").exists() or not any((cache / "depthtools_kernels").iterdir())
    assert all(v == f"C (builds on first CPU use with {bin_dir / 'c++'})" for v in out["status"].values()), out


def test_without_a_compiler_the_torch_twin_runs_and_says_so(tmp_path):
    """PATH without any compiler: HC, AttnRes and MoDA train a step on their torch-op paths, every library reports
    "torch ops", and the losses equal those of the same models in this process (C kernels where built)."""
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    code = (
        "import json, torch\n"
        "from depthtools.arch import DepthModel, cpu_kernels\n"
        "from depthtools.config import ModelConfig\n"
        "losses = {}\n"
        "for arch in ('hc', 'mhc', 'attnres', 'moda'):\n"
        "    cfg = ModelConfig(arch=arch, vocab_size=64, d_model=16, n_layer=2, n_heads=2, max_seq_len=8)\n"
        "    model = DepthModel(cfg, seed=0).double()\n"
        "    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))\n"
        "    loss = model(tokens).logsumexp(-1).mean()\n"
        "    loss.backward()\n"
        "    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)\n"
        "    losses[arch] = loss.item()\n"
        "print(json.dumps({'losses': losses, 'status': cpu_kernels.kernel_status()}))\n"
    )
    out = _run(code, empty, tmp_path / "cache")
    assert set(out["status"]) == {"sinkhorn", "connector", "bank", "moda"}
    assert all(v.startswith("torch ops") for v in out["status"].values()), out["status"]
    import torch

    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    for arch, loss in out["losses"].items():
        cfg = ModelConfig(arch=arch, vocab_size=64, d_model=16, n_layer=2, n_heads=2, max_seq_len=8)
        model = DepthModel(cfg, seed=0).double()
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        assert abs(model(tokens).logsumexp(-1).mean().item() - loss) < 1e-12, arch


@pytest.mark.timeout(300)  # without the fix this build waits forever
def test_a_stale_build_lock_does_not_hang_the_build(tmp_path, monkeypatch):
    """A builder killed mid-build leaves cpp_extension's lock file, on which the next build would wait forever: a
    lock older than STALE_LOCK_S is removed and the library builds."""
    from depthtools.arch import cpu_kernels

    cc = cpu_kernels._compiler()
    assert cc is not None, "this test needs a compiler and ninja (CI has both)"
    lock = cpu_kernels._target("sinkhorn", cc, cpu_kernels._LIBRARIES["sinkhorn"][0], tmp_path).parent / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = lock.stat().st_mtime - cpu_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    monkeypatch.setattr(cpu_kernels, "_libs", {})
    assert cpu_kernels.library("sinkhorn", folder=tmp_path) is not None
    assert not lock.exists()
