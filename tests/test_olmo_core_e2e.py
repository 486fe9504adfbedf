"""`depthtools import` end to end on native OLMo-core checkpoints (issue 44, "Done when").

* Every DepthBench architecture (tests/fixtures/olmo_core_names/, the fork's tiny configs): our model's weights
  written under the fork's names (`to_olmo_core`) into `stepN/model_and_optim/` with DCP's own writer, beside the
  step's config.json; `depthtools import RUN` gives bit-identical logits. Also a 2-rank gloo save whose tensors are
  row-sharded DTensors (tests/dcp_writer.py).
* Upstream OLMo-core (Llama- and OLMo-2-style `Transformer`s from its own config classes) saved with OLMo-core's
  own `save_model_and_optim_state`, in one process and FSDP2-sharded over 2 gloo ranks (tests/olmo_core_writer.py);
  the import's logits against OLMo-core's own forward: max |diff| <= 1e-5 in float32.
* Then the workflow of docs/olmo-core.md on the imported models: info, lens, ablate --mode skip,
  causal --protocol depthbench, and a sweep imported as a grid through analyze, summarize and report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from test_olmo_core_mapping import ARCHS, EXPECTED, fixture, perturbed_model, tokens
from typer.testing import CliRunner

from cli.main import app
from depthtools.checkpoint import load, read_json
from depthtools.interop.formats import import_path
from depthtools.interop.olmo_core import olmo_core_mapping, to_olmo_core

from tiny_models import one_thread  # noqa: F401  (autouse: one intra-op thread)

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
WORDS = "the cat dog bird went to market and came back with apples".split()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: str, *args: str, ranks: int = 2) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(ROOT / "tests" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def write_step(run: Path, step: int, config: dict, forks: dict[str, torch.Tensor], ranks: int = 1) -> Path:
    """run/stepN/{config.json, model_and_optim/} as OLMo-core's trainer leaves them (optimizer state beside)."""
    folder = run / f"step{step}"
    target = folder / "model_and_optim"
    if ranks == 1:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save({"model": forks, "optim": {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in forks.items()},
                                                "param_groups": [{"lr": 1e-3}]}}, checkpoint_id=str(target))
    else:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone(memory_format=torch.contiguous_format) for k, v in forks.items()}, str(folder / "state.safetensors"))  # aliases: own copies
        torchrun("dcp_writer.py", str(target), str(folder / "state.safetensors"), ranks=ranks)
        (folder / "state.safetensors").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def fork_run(run: Path, arch: str, seed: int = 0, ranks: int = 1, n_layers: int | None = None, tokenizer=None):
    """(our model, run folder): a DepthBench run of `arch` whose step 10 holds our model's weights."""
    config = json.loads(json.dumps(fixture(arch)["config"]))
    if n_layers is not None:
        config["model"]["n_layers"] = n_layers
    if tokenizer is not None:
        config["dataset"] = {**config.get("dataset", {}), "tokenizer": {"identifier": str(tokenizer),
                                                                        "eos_token_id": 0}}
    mapping = olmo_core_mapping(config)
    model = perturbed_model(mapping.cfg, seed)
    write_step(run, 10, config, to_olmo_core(model.state_dict(), mapping), ranks)
    return model, run


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_depthbench_architecture_imports_bit_identically(tmp_path, arch):
    model, run = fork_run(tmp_path / "run", arch)
    summary = import_path(run, out=tmp_path / "ck")
    assert summary["format"] == "olmo-core-run" and summary["step"] == 10
    imported = load(tmp_path / "ck")
    want_arch, want_options = EXPECTED[arch]
    assert imported.config.arch == want_arch
    assert {k: imported.config.options[k] for k in want_options} == want_options
    x = tokens(imported.config.vocab_size)
    assert torch.equal(_logits(imported, x), _logits(model.eval(), x))


def test_two_rank_sharded_save_imports_bit_identically(tmp_path):
    model, run = fork_run(tmp_path / "run", "mhc", ranks=2)
    assert len(list((run / "step10" / "model_and_optim").glob("*.distcp"))) == 2
    import_path(run, out=tmp_path / "ck")
    imported = load(tmp_path / "ck")
    x = tokens(imported.config.vocab_size)
    assert torch.equal(_logits(imported, x), _logits(model.eval(), x))


def _upstream(style: str, tmp_path: Path):
    """An upstream OLMo-core model (norm gains moved off 1) and the step config its trainer would write."""
    pytest.importorskip("olmo_core.nn.transformer")
    from olmo_core_writer import upstream_config

    config = upstream_config(style)
    torch.manual_seed(0)
    reference = config.build(init_device="cpu")
    reference.init_weights(device=torch.device("cpu"))
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    step_config = json.loads(json.dumps({"model": config.as_config_dict(), "dataset": {"sequence_length": 64}}))
    return reference.eval(), step_config


@pytest.mark.parametrize("style, ranks", [("llama", 1), ("olmo2", 1), ("llama", 2)])
def test_upstream_olmo_core_saved_by_olmo_core_imports_exactly(tmp_path, style, ranks):
    reference, step_config = _upstream(style, tmp_path)
    step = tmp_path / "run" / "step5"
    if ranks == 1:
        from olmo_core.distributed.checkpoint import save_model_and_optim_state

        optim = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_model_and_optim_state(step / "model_and_optim", reference, optim)
    else:
        step.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "state.safetensors"))
        torchrun("olmo_core_writer.py", style, str(tmp_path / "state.safetensors"), str(step / "model_and_optim"))
        assert len({p.name.split("_")[2] for p in (step / "model_and_optim").glob("*.distcp")}) == 2  # two ranks
    (step / "config.json").write_text(json.dumps(step_config))
    result = runner.invoke(app, ["import", str(tmp_path / "run"), "--out", str(tmp_path / "ck"), "--json"])
    assert result.exit_code == 0, result.output
    imported = load(tmp_path / "ck")
    x = tokens(64)
    with torch.no_grad():
        out = reference(x)
        diff = ((out.logits if hasattr(out, "logits") else out) - imported(x)).abs().max().item()
    assert diff <= 1e-5, diff
    print(f"upstream {style} {ranks} rank(s): max |logit diff| = {diff:.3g}")


def word_tokenizer(path: Path) -> Path:
    """A word-level tokenizers file of 13 ids (0 is the separator), small enough for the fixtures' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}},
                                     unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def ok(args: list) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_workflow_import_info_probes_and_sweep_report(tmp_path, monkeypatch):
    """docs/olmo-core.md's workflow: a MoDA run killed while saving step 20, its tokenizer named by the config;
    info, lens, ablate --mode skip, causal --protocol depthbench on it (ablate and causal on an HC import too); then
    a Pre-LN sweep of two depths imported as one grid through analyze, summarize and report."""
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    tok = word_tokenizer(tmp_path / "words.json")
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(3000)), encoding="utf-8")
    _, run = fork_run(tmp_path / "moda_run", "moda", tokenizer=tok)
    killed = write_step(run, 20, json.loads((run / "step10" / "config.json").read_text()),
                        {"embeddings.weight": torch.zeros(2, 2)})
    (killed / "model_and_optim" / ".metadata").unlink()

    said = ok(["import", run, "--name", "moda_tiny"])
    assert "passed over step20" in said and "imported step10" in said
    ckpt = tmp_path / "ckpts" / "moda_tiny"
    assert (ckpt / "tokenizer.json").is_file() and read_json(ckpt / "config.json")["tokenizer"]["sep_id"] == 0
    info = json.loads(ok(["info", "--ckpt", "moda_tiny", "--json"]))
    assert info["finished"] and info["provenance"] == f"imported from olmo-core {run.resolve()} step 10"
    assert info["source"]["step"] == 10 and info["source"]["block_type"] == "moda" and info["source"]["distcp_files"] >= 1
    fork_run(tmp_path / "hc_run", "hc", tokenizer=tok)
    ok(["import", tmp_path / "hc_run", "--name", "hc_tiny"])
    window = ["--text", text, "--n-tokens", "256", "--seq-len", "32"]
    ok(["lens", "--ckpt", "moda_tiny", *window])
    for name in ("moda_tiny", "hc_tiny"):
        ok(["ablate", "--ckpt", name, *window, "--mode", "skip"])
        ok(["causal", "--ckpt", name, *window, "--protocol", "depthbench"])

    for depth in (2, 4):
        fork_run(tmp_path / f"preln_L{depth}", "preln", seed=depth, n_layers=depth, tokenizer=tok)
    sweep = json.loads(ok(["import", tmp_path / "preln_L2", tmp_path / "preln_L4", "--grid", "db_preln", "--json"]))
    grid = tmp_path / "ckpts" / "db_preln"
    assert sorted(p.name for p in grid.iterdir()) == ["preln_L2", "preln_L4"] and len(sweep["cells"]) == 2
    ok(["analyze", "--grid", grid, *window])
    ok(["summarize", "--grid", grid])
    ok(["report", "--grid", grid, "--out", tmp_path / "db.html"])
    html = (tmp_path / "db.html").read_text()
    assert "preln_L2" in html and "preln_L4" in html and "no seed-noise estimate exists" in html


def _refused(args: list, needle: str, out: Path) -> None:
    result = runner.invoke(app, ["import", *map(str, args), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert needle in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


def test_bad_runs_are_one_line_and_write_nothing(tmp_path):
    """The issue's hostile inputs that need the mapping: an unknown block type, NaN weights, a tensor whose shape
    disagrees with the config, a tokenizer that is not the model's; each through the CLI."""
    config = json.loads(json.dumps(fixture("keel")["config"]))
    mapping = olmo_core_mapping(config)
    forks = to_olmo_core(perturbed_model(mapping.cfg).state_dict(), mapping)

    unknown = json.loads(json.dumps(config))
    unknown["model"]["block"]["name"] = "mystery_block"
    write_step(tmp_path / "unknown", 1, unknown, forks)
    _refused([tmp_path / "unknown"], "model.block.name='mystery_block'", tmp_path / "o1")

    nan = dict(forks, **{"blocks.1.attention_norm.weight": torch.full_like(forks["blocks.1.attention_norm.weight"],
                                                                          float("nan"))})
    write_step(tmp_path / "nan", 1, config, nan)
    _refused([tmp_path / "nan"], "non-finite", tmp_path / "o2")

    wide = dict(forks, **{"blocks.1.feed_forward.w1.weight": torch.zeros(47, 16)})
    write_step(tmp_path / "shape", 1, config, wide)
    _refused([tmp_path / "shape"], "blocks.1.feed_forward.w1.weight has shape (47, 16)", tmp_path / "o3")

    write_step(tmp_path / "good", 1, config, forks)
    big = tmp_path / "big.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0")).save(str(big))  # 40 ids > 32
    _refused([tmp_path / "good", "--tokenizer", big], "not this model's tokenizer", tmp_path / "o4")


def test_sweep_names_are_checked_before_the_first_cell_is_written(tmp_path):
    for name, depth in (("a", 2), ("b", 3), ("c", 3)):
        fork_run(tmp_path / name, "preln", n_layers=depth)
    _refused([tmp_path / "a", tmp_path / "b", tmp_path / "c", "--grid", "g"], "both import as cell preln_L3",
             tmp_path / "grid")
    ok(["import", tmp_path / "b", "--grid", "g", "--out", tmp_path / "grid"])
    before = (tmp_path / "grid" / "preln_L3" / "model.safetensors").read_bytes()
    result = runner.invoke(app, ["import", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "grid")])
    assert result.exit_code == 2 and "already holds a checkpoint; pass --force" in result.output
    assert sorted(p.name for p in (tmp_path / "grid").iterdir()) == ["preln_L3"]  # preln_L2 was not written first
    assert (tmp_path / "grid" / "preln_L3" / "model.safetensors").read_bytes() == before


def test_logit_lens_runs_on_an_imported_depthbench_hc_run(tmp_path, monkeypatch):
    """Issue 44 "Done when": `depthtools lens` runs on an imported DepthBench HC run, whose head norms every
    stream before the sum (readout "normed_sum"); at depth L the lens is the model's own output."""
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    tok = word_tokenizer(tmp_path / "words.json")
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(WORDS[(3 * i) % len(WORDS)] for i in range(600)), encoding="utf-8")
    fork_run(tmp_path / "hc_run", "hc", tokenizer=tok)
    ok(["import", tmp_path / "hc_run", "--name", "hc_tiny"])
    imported = load(tmp_path / "ckpts" / "hc_tiny")
    assert imported.config.options["readout"] == "normed_sum"
    result = runner.invoke(app, ["lens", "--ckpt", "hc_tiny", "--text", str(text), "--n-tokens", "64",
                                 "--seq-len", "16", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["depth"] for r in rows] == list(range(imported.n_layer + 1))
    assert rows[-1]["kl_final_lens"] == 0 and rows[-1]["top1_agree"] == 1
    assert all(r["ce"] > 0 for r in rows) and rows[0]["kl_final_lens"] > 0
    assert (tmp_path / "ckpts" / "hc_tiny" / "analysis" / "lens_logit.parquet").is_file()
