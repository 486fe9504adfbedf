"""Interop commands: `import` (OLMo-core runs, HF folders, GGUF; alias `import-hf`), `export-hf` (library:
`depthtools.interop`)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from cli.app import app
from cli.common import console, print_json, table


def _show(title: str, summary: dict) -> None:
    rows = [[k, v] for k, v in summary.items() if not isinstance(v, (dict, list))]
    for section in ("model", "params", "tokenizer"):
        for k, v in (summary.get(section) or {}).items():
            rows.append([f"{section}.{k}", v])
    console.print(table(title, ["field", "value"], rows))
    for note in summary.get("notes", []):
        console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)


def _import(paths: list[Path], name: Optional[str], out: Optional[Path], step: Optional[int],
            tokenizer: Optional[Path], max_seq_len: Optional[int], force: bool, as_json: bool,
            grid: Optional[str] = None, stream: Optional[bool] = None) -> None:
    from depthtools.interop.formats import import_paths  # lazy: keeps the CLI torch-free

    summary = import_paths(paths, name=name, out=out, force=force, step=step, tokenizer=tokenizer,
                           max_seq_len=max_seq_len, grid=grid, stream=stream)
    if as_json:
        print_json(summary)
        return
    for cell in summary.get("cells", [summary]):
        _show(f"imported {cell.get('source')}", cell)
    if "cells" in summary:
        console.print(f"grid {escape(summary['grid'])}: {len(summary['cells'])} cells", highlight=False)
        for note in summary.get("notes", []):
            console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)


PATH_HELP = ("An OLMo-core run folder (stepN/ folders) or one step folder, a local transformers model folder "
             "(config.json + safetensors) or a .gguf file.")
STEP_HELP = "OLMo-core: the step to import (default: the latest complete step)."
STREAM_HELP = ("Hugging Face folders: --stream writes the weights tensor by tensor into shards in the source's dtype "
               "(memory: about one shard), --no-stream builds the float32 model in memory (one model.safetensors); "
               "default: stream when the in-memory import would need more than half the RAM. Both load to the same "
               "float32 model, bit for bit.")
TOKENIZER_HELP = ("OLMo-core: a tokenizer.json (or a folder holding one) to carry (default: the file the step's "
                  "config names, when it is local).")


@app.command("import")
def import_command(
    paths: List[Path] = typer.Argument(..., help=PATH_HELP + " Several OLMo-core runs (one sweep): one grid (--grid)."),
    name: Optional[str] = typer.Option(None, "--name", help="Checkpoint name under $DEPTHTOOLS_CHECKPOINTS."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the checkpoint (with --grid: the grid) to this directory instead."),
    grid: Optional[str] = typer.Option(None, "--grid", help="Import OLMo-core runs as the cells <arch>_L<n> of this grid under $DEPTHTOOLS_CHECKPOINTS."),
    step: Optional[int] = typer.Option(None, "--step", min=0, help=STEP_HELP),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help=TOKENIZER_HELP),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="Context length (default: the source's)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing checkpoint (its whole folder; all or nothing: a failed import leaves the old one as it was)."),
    stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help=STREAM_HELP, show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Import a checkpoint from another toolkit; what PATH is decides how (docs/olmo-core.md, docs/interop.md).

    - An OLMo-core run folder (DepthBench's training runs) or one of its stepN/ folders: the model in
      model_and_optim/ (torch.distributed.checkpoint, any number of ranks) is read without running any pickled
      code and mapped to its depthtools architecture (Pre-LN, Peri-LN, LNS, DeepNorm, KEEL, HC, mHC, AttnRes,
      MoDA; upstream Llama/OLMo-2). Default: the latest complete step.
    - A transformers folder of a supported family (llama, mistral, qwen2/3, gemma 1-3, olmo 1/2, gpt2,
      gpt_neox, phi, phi3, mixtral, olmoe, qwen2_moe, qwen3_moe) imported exactly as `preln`
      (docs/pretrained.md); tokenizer files are carried.
    - A .gguf file (llama, qwen2, qwen3, gemma, gemma2, gemma3), dequantized with the gguf package (pip install -e ".\\[gguf]").

    Nothing is written unless everything was read and checked; the checkpoint appears whole or not at all.

    Example: depthtools import runs/hc_400m_L24 --name hc_L24
    Example: depthtools import runs/hc_400m_L24 --step 4000 --tokenizer gpt-neox-olmo-dolma.json --name hc_L24_s4000
    Example: depthtools import ./TinyLlama --name tinyllama
    Example: depthtools import runs/hc_L16 runs/hc_L24 runs/hc_L32 --grid depthbench_hc   (one sweep, one grid)
    """
    _import(paths, name, out, step, tokenizer, max_seq_len, force, as_json, grid, stream)


@app.command("import-hf")
def import_hf_command(
    path: Path = typer.Argument(..., help=PATH_HELP),
    name: Optional[str] = typer.Option(None, "--name", help="Checkpoint name under $DEPTHTOOLS_CHECKPOINTS."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the checkpoint to this directory instead."),
    step: Optional[int] = typer.Option(None, "--step", min=0, help=STEP_HELP),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help=TOKENIZER_HELP),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="Context length (default: the source's)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing checkpoint (its whole folder; all or nothing: a failed import leaves the old one as it was)."),
    stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help=STREAM_HELP, show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Alias of `depthtools import` (kept for existing scripts): imports a transformers folder, a .gguf file or an
    OLMo-core run, whichever PATH is.

    A .gguf file needs the gguf extra: pip install -e ".\\[gguf]"

    Example: depthtools import-hf ./TinyLlama --name tinyllama
    Example: depthtools import-hf ./tiny-q8_0.gguf --name tiny-gguf
    """
    _import([path], name, out, step, tokenizer, max_seq_len, force, as_json, stream=stream)


@app.command("export-hf")
def export_hf_command(
    directory: Path = typer.Argument(..., help="Output directory (a transformers Llama model)."),
    ckpt: str = typer.Option(..., "--ckpt", help="Checkpoint path or cell name (e.g. preln_L8); preln only."),
    tokenizer: str = typer.Option("auto", "--tokenizer",
                                  help="auto (what the checkpoint records), byte, none, or a data/tokenizer directory."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output directory."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Export a `preln` checkpoint as a transformers Llama directory (+ tokenizer).

    Load it with LlamaForCausalLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR).

    Example: depthtools export-hf --ckpt preln_L8 exported/preln_L8
    """
    from depthtools.interop import export_hf  # lazy: keeps the CLI torch-free

    summary = export_hf(ckpt, directory, tokenizer=None if tokenizer == "auto" else tokenizer, force=force)
    if as_json:
        print_json(summary)
        return
    _show(f"exported {summary['checkpoint']}", summary)
