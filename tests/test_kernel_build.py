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
    assert set(out["status"]) == {"sinkhorn", "connector", "bank", "moda", "rowmetrics"}
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


# -- the kernels' signatures: read from the C sources, checked against every caller when a library loads ----------

def test_c_signatures_are_read_from_the_sources():
    """`c_signatures` reads each kernel's parameters from csrc/ once per type it is instantiated for (REAL, KV_T
    expanded), and every exported kernel of every library has a declared caller (`cpu_kernels.Kernel`)."""
    import depthtools.arch.ops  # noqa: F401  (imports every ops module: their declarations)
    from depthtools.arch import cpu_kernels

    sig = cpu_kernels.c_signatures("connector")
    fwd = sig["hc_connect_forward_f64"]
    assert fwd.returns == "void"
    assert [(p.name, p.ctype, p.pointer) for p in fwd.params[:8]] == [
        ("H", "double", True), ("Pt", "double", True), ("S", "double", True), ("scale", "double", True),
        ("N", "long", False), ("n", "int", False), ("d", "int", False), ("eps", "double", False)]
    moda = cpu_kernels.c_signatures("moda")
    assert [p.ctype for p in moda["moda_forward_bf16"].params[:3]] == ["unsigned short", "unsigned short", "float"]
    assert sorted(s for s in moda if s.startswith("moda_store_slot")) == [
        "moda_store_slot_bf16", "moda_store_slot_f32", "moda_store_slot_f64"]
    for library in cpu_kernels._LIBRARIES:
        declared = {s for k in cpu_kernels._declared[library] for s in k.symbols(cpu_kernels.c_signatures(library))}
        kernels = {s for s in cpu_kernels.c_signatures(library) if not s.endswith("_array")}  # (test helpers)
        if library == "connector":  # its Sinkhorn block routines are called from the connector kernels only
            kernels = {s for s in kernels if not s.startswith("sinkhorn_")}
        assert kernels <= declared, (library, kernels - declared)


def test_a_caller_that_differs_from_the_c_definition_fails_when_the_library_loads(monkeypatch, tmp_path):
    """A C kernel that gained a parameter (a copy of csrc/ with one edited) no longer matches its caller's
    declaration: loading the library raises KernelSignatureError naming both lists, instead of calling the kernel
    with shifted arguments; a declaration with a parameter missing fails the same way."""
    import shutil

    from depthtools.arch import cpu_kernels

    src = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.SOURCE_DIR, src)
    text = (src / "sinkhorn_impl.h").read_text()
    edited = text.replace("int FN(sinkhorn_forward)(const REAL *z, REAL *out, long N,",
                          "int FN(sinkhorn_forward)(const REAL *z, REAL *out, long stride, long N,")
    assert edited != text
    (src / "sinkhorn_impl.h").write_text(edited)
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", src)
    monkeypatch.setattr(cpu_kernels, "_declared", {})
    monkeypatch.setattr(cpu_kernels, "_libs", {})
    cpu_kernels.Kernel("sinkhorn", "sinkhorn_forward", "z out N n t_max first tiny")
    with pytest.raises(cpu_kernels.KernelSignatureError, match=r"sinkhorn_forward_f32 .*passes 7 arguments.*takes 8"):
        cpu_kernels._bind_declared("sinkhorn", None)
    monkeypatch.undo()  # the real sources: the built (cached) library loads, and checks its callers
    monkeypatch.setattr(cpu_kernels, "_declared", {})
    monkeypatch.setattr(cpu_kernels, "_libs", {})
    cpu_kernels.Kernel("sinkhorn", "sinkhorn_backward", "z grad N n t_max first tiny")  # `out` forgotten
    with pytest.raises(cpu_kernels.KernelSignatureError, match="sinkhorn_backward"):
        cpu_kernels.library("sinkhorn")


def test_a_call_with_a_wrong_dtype_or_count_fails_before_the_kernel_runs():
    """A bound kernel converts each argument by its C parameter: a float64 tensor for a float32 kernel's pointer,
    a tensor on another device, a float for an int, or a wrong count raise TypeError naming the parameter (before
    the C code runs); the right arguments give the kernel's result."""
    import torch

    from depthtools.arch import cpu_kernels
    from depthtools.arch.ops import sinkhorn as sinkhorn_ops

    if cpu_kernels.library("sinkhorn") is None:
        pytest.skip("no C compiler here: the sinkhorn library did not build")
    z = torch.randn(4, 4, 8)
    out = torch.empty_like(z)
    kernel, tiny = sinkhorn_ops._FORWARD, torch.finfo(torch.float32).tiny
    with pytest.raises(TypeError, match="argument out: wants a CPU tensor of torch.float32"):
        kernel(torch.float32, z, out.double(), 8, 4, 3, 0, tiny)
    with pytest.raises(TypeError, match="argument out: wants a CPU tensor .* got torch.float32 tensor on meta"):
        kernel(torch.float32, z, out.to("meta"), 8, 4, 3, 0, tiny)
    with pytest.raises(TypeError, match="argument t_max: wants a int, got float"):
        kernel(torch.float32, z, out, 8, 4, 3.0, 0, tiny)
    with pytest.raises(TypeError, match="takes 7 arguments, got 6"):
        kernel(torch.float32, z, out, 8, 4, 3, 0)
    assert kernel(torch.float32, z, out, 8, 4, 3, 0, tiny) == 0
    assert torch.allclose(out.sum(1), torch.ones(4, 8), atol=1e-6)  # rows_last with first=0: rows sum to 1
