"""Streamed weights (issue 45 item 3): every probe's tables from a model read one block at a time equal the in-memory
model's, bit for bit in float32; sharded bf16 checkpoints; pickled or damaged weights are one line."""

import pickle
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.analysis.suite import ANALYSES, analyze_grid, read_result
from depthtools.arch import DepthModel, Plan
from depthtools.config import ModelConfig
from depthtools.errors import CheckpointError

from tiny_models import one_thread, perturb, windows  # noqa: F401  (autouse: one intra-op thread)

runner = CliRunner()
SIZES = dict(n_tokens=64, seq_len=16, lens_steps=2, lens_tokens=256, batch_size=2)


def cell(root: Path, data_dir: Path, arch: str = "preln", n_layer: int = 4, **options) -> Path:
    """A float32 checkpoint (weights moved off their init) recording the fixture corpus."""
    cfg = ModelConfig(arch=arch, vocab_size=256, d_model=32, n_layer=n_layer, n_heads=4, max_seq_len=32,
                      options=options)
    model = perturb(DepthModel(cfg, seed=0))
    return ck.save(model, root / f"{arch}_L{n_layer}", extra={"data": {"path": str(data_dir)}})


def tables(directory: Path) -> dict[str, pd.DataFrame]:
    """Every table the suite saved beside the checkpoint."""
    return {p.stem: read_result(directory, p.stem) for p in sorted((directory / "analysis").glob("*.parquet"))}


@pytest.mark.parametrize("arch", ["preln", "attnres", "hc"])
def test_every_probe_streamed_equals_in_memory(tmp_path, data_dir, arch):
    directory = cell(tmp_path, data_dir, arch)
    only = ",".join(ANALYSES)
    analyze_grid(ckpts=[directory], only=only, tuned=True, recompute=True, **SIZES)
    memory = tables(directory)
    assert len(memory) >= len(ANALYSES)
    streamed = ck.load(directory, stream=True, budget=0)
    assert all(p.is_meta for p in streamed.blocks.parameters() if p.dim() > 1)  # nothing of a block is loaded
    with ck.loading(stream=True, budget=0):  # every block read again at every use
        analyze_grid(ckpts=[directory], only=only, tuned=True, recompute=True, **SIZES)
    again = tables(directory)
    assert again.keys() == memory.keys()
    for name, table in memory.items():
        pd.testing.assert_frame_equal(again[name], table, check_exact=True, obj=name)


def test_budget_keeps_blocks_and_prefix_caching_still_holds(tmp_path, data_dir):
    from depthtools.analysis.lens import model_fingerprint
    from depthtools.analysis.sweep import intact_states, plan_logits

    directory = cell(tmp_path, data_dir)
    memory = ck.load(directory)
    toks = windows(vocab=256)
    for budget, most in ((1 << 30, 5), (0, None)):  # every block kept: read once; none kept: read at each use
        model = ck.load(directory, stream=True, budget=budget)
        with torch.no_grad():
            states = intact_states(model, toks)
            plans = [Plan.skipping(l) for l in range(4)]
            for plan, got in zip(plans, plan_logits(model, plans, states)):
                assert torch.equal(got, memory.run(toks, plan=plan))
        if most is not None:
            assert model.stream.reads <= most  # 4 blocks + head, each read once
        else:
            assert model.stream.reads > 12
        assert torch.equal(model.tok_embed.weight, memory.tok_embed.weight)
        assert model_fingerprint(model) == model_fingerprint(memory)  # read one tensor at a time, whatever the budget


def test_sharded_bf16_checkpoint_streams_and_loads_as_its_float32_upcast(tmp_path, data_dir):
    directory = cell(tmp_path, data_dir)
    model = ck.load(directory)
    (directory / ck.WEIGHTS).unlink()
    ck.write_sharded(directory, ck.model_state(model).items(), shard_bytes=20_000, dtype=torch.bfloat16)
    assert len(list(directory.glob("model-*.safetensors"))) > 3
    reference = DepthModel(model.config)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.to(torch.bfloat16).float())  # what a bf16 file holds, read back in float32
    toks = windows(vocab=256)
    loaded, streamed = ck.load(directory), ck.load(directory, stream=True, budget=0)
    with torch.no_grad():
        want = reference.eval().run(toks)
        assert torch.equal(loaded.run(toks), want)
        assert torch.equal(streamed.run(toks), want)


def test_tied_embedding_streams(tmp_path):
    cfg = ModelConfig(arch="preln", vocab_size=256, d_model=32, n_layer=2, n_heads=4, max_seq_len=32,
                      tie_embeddings=True)
    tied = ck.save(perturb(DepthModel(cfg, seed=1)), tmp_path / "tied")
    toks = windows(vocab=256)
    with torch.no_grad():
        assert torch.equal(ck.load(tied, stream=True).run(toks), ck.load(tied).run(toks))


class Trap:
    """Unpickling this would create `marker` (it must never happen)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def refused(args, match: str):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1 and match in lines[0], result.stderr
    return result


def test_stream_refuses_pickled_weights_without_unpickling(tmp_path, data_dir):
    directory = cell(tmp_path, data_dir)
    (directory / ck.WEIGHTS).unlink()
    marker = tmp_path / "unpickled"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(Trap(marker)))
    refused(["lens", "--ckpt", directory, "--n-tokens", "64", "--seq-len", "16", "--stream"], "pickled weights")
    assert not marker.exists() and not (directory / "analysis").exists()
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        ck.load(directory, stream=True)


def test_stream_refuses_a_truncated_shard_in_one_line(tmp_path, data_dir):
    directory = cell(tmp_path, data_dir)
    model = ck.load(directory)
    (directory / ck.WEIGHTS).unlink()
    ck.write_sharded(directory, ck.model_state(model).items(), shard_bytes=20_000)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    refused(["ablate", "--ckpt", directory, "--n-tokens", "64", "--seq-len", "16", "--stream"], "truncated")
    assert not (directory / "analysis").exists()


def test_stream_refuses_a_shard_damaged_after_loading(tmp_path, data_dir):
    directory = cell(tmp_path, data_dir)
    model = ck.load(directory, stream=True)
    (directory / ck.WEIGHTS).write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError) as info, torch.no_grad():
        model.run(windows(vocab=256))
    assert "\n" not in str(info.value) and str(directory / ck.WEIGHTS) in str(info.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_streamed_in_a_low_precision_dtype_equals_the_in_memory_load(tmp_path, data_dir, dtype):
    """load(stream=True, dtype=...) (what `--stream --dtype bfloat16` runs) gives the logits of load(dtype=...),
    whose weights are cast straight into the dtype: the streamed blocks are read and cast the same way."""
    directory = cell(tmp_path, data_dir)
    toks = windows(vocab=256)
    streamed = ck.load(directory, stream=True, budget=0, dtype=dtype)
    assert streamed.tok_embed.weight.dtype == getattr(torch, dtype)
    with torch.no_grad():
        assert torch.equal(streamed.run(toks), ck.load(directory, dtype=dtype).run(toks))


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_tensor_source_reads_what_safetensors_reads_in_chunks(tmp_path, monkeypatch, stored):
    """Positioned reads (straight into the result when the file holds the wanted dtype, else cast through one
    reused chunk buffer) give safetensors' tensors exactly, aligned as torch's own; huge finite values (whose sum
    overflows) pass, one NaN or inf anywhere is one line."""
    from safetensors.torch import load_file, save_file

    from depthtools.arch import stream as st

    monkeypatch.setattr(st, "CHUNK_BYTES", 1000)  # many chunks per tensor, a short last one
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(37, 29, generator=gen), "big": torch.full((600,), 3e38), "empty": torch.zeros(0, 4),
               "b": torch.randn(1001, generator=gen)}
    path = tmp_path / "w.safetensors"
    save_file({k: v.to(stored) for k, v in tensors.items()}, str(path))
    want = load_file(str(path))
    source = st.TensorSource(dict.fromkeys(want, path))
    for dtype in (None, torch.float32, torch.bfloat16):
        got = source.read(list(want), dtype)
        for name, value in want.items():
            expected = value if dtype is None else value.to(dtype)
            assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), (name, dtype)
            assert got[name].data_ptr() % 64 == 0 or got[name].numel() == 0
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = {**tensors, "b": tensors["b"].clone()}
        broken["b"][777] = bad
        save_file({k: v.to(stored) for k, v in broken.items()}, str(path))
        source = st.TensorSource(dict.fromkeys(want, path))
        assert source.read(["a"], torch.float32)["a"].shape == (37, 29)
        for dtype in (None, torch.float32):
            with pytest.raises(CheckpointError, match="tensor b has non-finite") as info:
                source.read(["b"], dtype)
            assert "\n" not in str(info.value)


def test_the_weight_hash_is_the_first_read_of_every_block(tmp_path, data_dir):
    """`lens.model_fingerprint` of a streamed model materialises each block through the streamer: within the
    budget they are kept, so the probe after it reads nothing again (one read of the file per block, not two);
    with budget 0 each is released as the next is read. The hash equals the in-memory model's either way."""
    from depthtools.analysis.lens import model_fingerprint

    directory = cell(tmp_path, data_dir)
    memory = ck.load(directory)
    toks = windows(vocab=256)
    for budget in (1 << 30, 0):
        model = ck.load(directory, stream=True, budget=budget)
        assert model_fingerprint(model) == model_fingerprint(memory)
        assert model.stream.reads == 4 + 1  # every block and the head, once
        on_meta = [p.is_meta for p in model.blocks.parameters()]
        assert not any(on_meta) if budget else all(on_meta)  # kept / released (the head is the last one read)
        with torch.no_grad():
            assert torch.equal(model.run(toks), memory.run(toks))
        assert model.stream.reads == (4 + 1 if budget else 2 * (4 + 1))
