"""A streamed import (issue 45): a Hugging Face folder converted tensor by tensor into bf16/float32 shards.

For families whose conversion renames (Llama, Qwen3, Gemma-2, Mixtral), transposes (GPT-2's Conv1D), splits a
fused tensor (Phi-3's qkv and gate_up, GPT-2's c_attn, NeoX's per-head qkv), feeds two of our tensors from one
(Phi's shared input norm) or ties a head, tiny random
transformers models are saved as sharded bfloat16 and float32 safetensors and imported twice: in memory (today's
path: the float32 model) and streamed. The streamed checkpoint is in the source's dtype; loaded (normally and
`stream=True`) it is the in-memory import's model bit for bit (every tensor, the logits), and transformers' model
within the families' tolerance. Bad folders are refused by both paths in the same line, with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families import CASES, TOL, build_hf, tokens

from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.errors import DepthToolsError
from depthtools.interop import import_hf
from depthtools.interop.families import hf_state, hf_state_plan, hf_state_stream
from depthtools.interop.llama import (
    IN_MEMORY_COPIES,
    HFWeights,
    hf_to_model_config,
    read_hf_config,
    read_hf_tensors,
    stream_wanted,
)

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")

STREAM_CASES = ["llama-bias-gqa", "qwen3-qknorm", "gemma2-softcap-window", "phi3-fused-window-partial", "gpt2",
                "phi-parallel-partial-biased-head", "neox-parallel-partial", "mixtral-top2-window"]
SHARD = "20KB"  # several shards per tiny model


def source_folder(case: str, root: Path, dtype: torch.dtype):
    """`case` saved sharded in `dtype`; returns (folder, transformers' model of those weights in float32)."""
    model = build_hf(case, root / "built")
    folder = root / f"src_{str(dtype).replace('torch.', '')}"
    model.to(dtype).save_pretrained(folder, safe_serialization=True, max_shard_size=SHARD)
    reference = getattr(transformers, CASES[case][1]).from_pretrained(folder, dtype=torch.float32).eval()
    return folder, reference


def stored_dtypes(checkpoint: Path) -> set[torch.dtype]:
    files = ck.weight_files(checkpoint)
    return {t.dtype for f in sorted(set(files.values())) for t in load_file(str(f)).values()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", STREAM_CASES)
def test_streamed_import_is_the_in_memory_import(case, dtype, tmp_path):
    folder, reference = source_folder(case, tmp_path, dtype)
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    memory = import_hf(folder, out=tmp_path / "memory", stream=False)
    streamed = import_hf(folder, out=tmp_path / "streamed", stream=True)

    out = tmp_path / "streamed"
    assert (out / ck.WEIGHTS_INDEX).is_file() and not (out / ck.WEIGHTS).exists()
    assert stored_dtypes(out) == {dtype}  # the source's dtype, not float32
    assert stored_dtypes(tmp_path / "memory") == {torch.float32}
    assert any("streamed import" in note for note in streamed["notes"])
    assert {k: v for k, v in streamed.items() if k not in ("notes", "checkpoint")} == {
        k: v for k, v in memory.items() if k not in ("notes", "checkpoint")}
    config_m, config_s = ck.read_config(tmp_path / "memory"), ck.read_config(out)
    assert config_s == config_m  # model, params, source, tokenizer: as the in-memory import writes them

    ours_m, ours_s = ck.load(tmp_path / "memory"), ck.load(out)
    state_m, state_s = ck.model_state(ours_m), ck.model_state(ours_s)
    assert list(state_s) == list(state_m)
    for name in state_m:
        assert state_s[name].dtype == torch.float32
        assert torch.equal(state_s[name], state_m[name]), name
    x = tokens()
    with torch.no_grad():
        logits = ours_m(x)
        assert torch.equal(ours_s(x), logits)
        assert torch.equal(ck.load(out, stream=True)(x), logits)
        assert (logits - reference(x).logits).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["gpt2", "neox-sequential"])
def test_a_tied_config_with_its_own_head_streams_untied(case, tmp_path, monkeypatch):
    """The head check of the in-memory import (`families.head_from_file`) reads only the head and the embedding."""
    config_cls, model_cls, kwargs, _ = CASES[case]
    monkeypatch.setitem(CASES, case, (config_cls, model_cls, {**kwargs, "tie_word_embeddings": True}, {}))
    folder = tmp_path / "hf"
    build_hf(case, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    embed = next(k for k in tensors if k.endswith(("wte.weight", "embed_in.weight")))
    tensors["embed_out.weight" if case.startswith("neox") else "lm_head.weight"] = torch.randn(
        tensors[embed].shape, generator=torch.Generator().manual_seed(3))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    memory = import_hf(folder, out=tmp_path / "memory", stream=False)
    streamed = import_hf(folder, out=tmp_path / "streamed", stream=True)
    assert streamed["notes"][0] == memory["notes"][0] and "tie_word_embeddings" in memory["notes"][0]
    a, b = ck.load(tmp_path / "memory"), ck.load(tmp_path / "streamed")
    assert not b.config.tie_embeddings
    for name, value in ck.model_state(a).items():
        assert torch.equal(ck.model_state(b)[name], value), name


@pytest.mark.parametrize("case", ["phi3-fused-window-partial", "gpt2", "neox-parallel-partial", "qwen2-moe-shared-dense",
                                  "phi-qk-layernorm-tied"])
def test_the_stream_yields_hf_states_tensors_each_in_its_own_storage(case, tmp_path):
    """`hf_state_stream` gives `hf_state`'s names in order and its values, reading each HF tensor once; an HF
    tensor that feeds several of ours (a fused qkv, Phi's shared input norm) gives each its own copy."""
    build_hf(case, tmp_path)
    cfg = hf_to_model_config(read_hf_config(tmp_path))
    tensors = read_hf_tensors(tmp_path)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in ck.model_state(DepthModel(cfg)).items()}
    state = hf_state(tensors, cfg, expected)
    steps = hf_state_plan({k: v.to("meta") for k, v in tensors.items()}, cfg, expected)
    reads: list[str] = []

    def read(name: str) -> torch.Tensor:
        reads.append(name)
        return tensors[name]

    streamed = list(hf_state_stream(steps, read, cfg))
    assert [k for k, _ in streamed] == list(state)
    assert len(reads) == len(set(reads))  # a fused tensor is read once
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for _, t in streamed)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two share memory
    for name, tensor in streamed:
        assert torch.equal(tensor.float(), state[name]), name


def _bad_folders(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a folder both import paths must refuse, a part of the line)."""
    out = {}
    nan = root / "nan"
    model = build_hf("gpt2", nan)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    model.save_pretrained(nan, safe_serialization=True, max_shard_size=SHARD)
    out["nan"] = (nan, "transformer.h.1.mlp.c_fc.weight has 1 non-finite")

    wrong = root / "wrong"
    build_hf("phi3-fused-window-partial", wrong, max_shard_size=SHARD)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    out["shape"] = (wrong, "gate_up_proj.weight has shape (96, 32)")

    experts = root / "experts"
    build_hf("mixtral-top2-window", experts)
    config = json.loads((experts / "config.json").read_text())
    (experts / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    out["experts"] = (experts, "hold 4 experts in layer 0")

    extra, integer = root / "extra", root / "integer"
    for folder, name, value in ((extra, "model.layers.0.mlp.extra.weight", torch.ones(3)),
                                (integer, "model.layers.1.mlp.up_proj.weight", None)):
        build_hf("llama-bias-gqa", folder)
        tensors = load_file(str(folder / "model.safetensors"))
        tensors[name] = value if value is not None else tensors[name].to(torch.int64)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    out["extra"] = (extra, "unexpected ['model.layers.0.mlp.extra.weight']")
    out["integer"] = (integer, "has dtype int64")

    missing = root / "missing"
    build_hf("olmo-clip", missing, max_shard_size=SHARD)
    sorted(missing.glob("model-*.safetensors"))[1].unlink()
    out["missing"] = (missing, "missing weights file")
    return out


def test_bad_folders_are_refused_alike_and_nothing_is_written(tmp_path):
    for label, (folder, needle) in _bad_folders(tmp_path / "bad").items():
        lines = []
        for stream in (False, True):
            target = tmp_path / f"{label}_{stream}"
            with pytest.raises(DepthToolsError) as err:
                import_hf(folder, out=target, stream=stream)
            lines.append(str(err.value))
            assert not target.exists(), label
            assert not list(tmp_path.glob(f".{target.name}.*")), label  # no staging folder left
        assert needle in lines[1] and len(lines[1].splitlines()) == 1, (label, lines)
        assert lines[1] == lines[0], label


def test_an_import_streams_when_the_in_memory_one_would_not_fit(tmp_path):
    build_hf("llama-bias-gqa", tmp_path / "hf", max_shard_size=SHARD)
    weights = HFWeights(tmp_path / "hf")
    need = weights.stored_bytes() + IN_MEMORY_COPIES * weights.float32_bytes()
    assert weights.float32_bytes() == 4 * sum(t.numel() for t in load_file_all(tmp_path / "hf").values())
    assert stream_wanted(weights, memory=2 * need - 2) and not stream_wanted(weights, memory=2 * need)
    import_hf(tmp_path / "hf", out=tmp_path / "auto")  # a tiny model on this machine: in memory, one file
    assert (tmp_path / "auto" / ck.WEIGHTS).is_file() and not (tmp_path / "auto" / ck.WEIGHTS_INDEX).exists()


def load_file_all(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_a_sharded_checkpoint_is_finished_for_info_grids_and_reports(tmp_path):
    """A streamed import writes shards + model.safetensors.index.json, no model.safetensors: `info`'s summary, the
    weights-header check of grid status / train / report, and the grid listing read the shards (before, they
    called such a checkpoint's weights missing); a damaged shard is still named."""
    from depthtools.analysis.tables import checkpoint_dirs
    from depthtools.checkpoint import WEIGHTS, WEIGHTS_INDEX, checkpoint_summary, read_json, weights_problem

    folder, _ = source_folder("llama-bias-gqa", tmp_path, torch.bfloat16)
    grid = tmp_path / "grid"
    import_hf(folder, out=grid / "streamed", stream=True)
    streamed = grid / "streamed"
    assert not (streamed / WEIGHTS).exists() and (streamed / WEIGHTS_INDEX).is_file()
    summary = checkpoint_summary(streamed)
    assert summary["finished"] and summary["weights"] == "ok"
    assert weights_problem(streamed / WEIGHTS, read_json(streamed / "config.json")["model"]) is None
    assert checkpoint_dirs(grid) == [streamed]
    shard = sorted(streamed.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    problem = weights_problem(streamed / WEIGHTS)
    assert problem is not None and shard.name in problem and "truncated" in problem
    assert not checkpoint_summary(streamed)["finished"]


def _cli(*args: str):
    """`depthtools ARGS` as a user runs it (the console script's exit code and stderr)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True)


def test_cli_import_stream_and_no_stream_force_the_path(tmp_path):
    """`import --stream` writes source-dtype shards + an index that load to the in-memory import's logits;
    `--no-stream` (and the `import-hf` alias) one float32 model.safetensors, though the tiny model would be
    imported in memory anyway."""
    from typer.testing import CliRunner

    from cli.main import app

    folder, _ = source_folder("llama-bias-gqa", tmp_path, torch.bfloat16)
    runner = CliRunner()
    for command, flag, out in (("import", "--stream", "streamed"), ("import-hf", "--no-stream", "memory"),
                               ("import-hf", "--stream", "streamed_alias")):
        result = runner.invoke(app, [command, str(folder), "--out", str(tmp_path / out), flag, "--json"])
        assert result.exit_code == 0, result.output
    for out in ("streamed", "streamed_alias"):
        assert (tmp_path / out / ck.WEIGHTS_INDEX).is_file() and not (tmp_path / out / ck.WEIGHTS).exists()
        assert len(list((tmp_path / out).glob("model-*.safetensors"))) >= 1
        assert stored_dtypes(tmp_path / out) == {torch.bfloat16}
    assert (tmp_path / "memory" / ck.WEIGHTS).is_file() and not (tmp_path / "memory" / ck.WEIGHTS_INDEX).exists()
    assert stored_dtypes(tmp_path / "memory") == {torch.float32}
    x = tokens()
    with torch.no_grad():
        logits = ck.load(tmp_path / "memory")(x)
        assert torch.equal(ck.load(tmp_path / "streamed")(x), logits)
        assert torch.equal(ck.load(tmp_path / "streamed", stream=True)(x), logits)


def test_cli_import_stream_refuses_a_gguf_file_and_a_pickled_folder(tmp_path):
    """--stream on what cannot stream: one line on stderr, exit 2, nothing written (no target, no staging)."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    build_hf("llama-bias-gqa", tmp_path / "hf")
    (pickled / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"never unpickled")
    for source, needle in ((gguf, "--stream applies to Hugging Face folders only"),
                           (pickled, "has only pickled weights (pytorch_model.bin)")):
        for command in ("import", "import-hf"):
            target = tmp_path / f"out_{source.stem}_{command}"
            result = _cli(command, str(source), "--out", str(target), "--stream")
            assert result.returncode == 2 and result.stdout == "", result
            assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert not target.exists() and not list(tmp_path.glob(f".{target.name}*"))


def test_stream_on_a_grid_of_olmo_core_runs_is_refused_before_anything_is_read(tmp_path):
    from depthtools.interop.formats import import_paths

    with pytest.raises(DepthToolsError, match="--stream applies to one Hugging Face folder") as info:
        import_paths([tmp_path / "run_a", tmp_path / "run_b"], grid="g", out=tmp_path / "grid", stream=True)
    assert "\n" not in str(info.value) and not (tmp_path / "grid").exists()
