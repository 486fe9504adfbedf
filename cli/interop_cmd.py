"""Hugging Face interop commands: `import-hf`, `export-hf` (library: `depthtools.interop`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

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


@app.command("import-hf")
def import_hf_command(
    directory: Path = typer.Argument(..., help="Local transformers model directory (config.json + safetensors) of a supported family, or a .gguf file (llama, qwen2, qwen3)."),
    name: Optional[str] = typer.Option(None, "--name", help="Checkpoint name under $DEPTHTOOLS_CHECKPOINTS."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the checkpoint to this directory instead."),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="Context length (default: max_position_embeddings)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing checkpoint (its whole folder; all or nothing: a failed import leaves the old one as it was)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Import a local transformers checkpoint as a `preln` depthtools checkpoint.

    Families: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, olmo, olmo2, gpt2, gpt_neox
    (Pythia), phi3, imported exactly (docs/pretrained.md). Tokenizer files are carried along.
    Unsupported configs (scaled RoPE, unknown activations, ...) are refused, naming the field.

    A .gguf file (llama.cpp) of a llama, qwen2 or qwen3 model is dequantized with the gguf package
    (pip install -e ".\\[gguf]") and imported the same way; its tokenizer is rebuilt from the file's
    metadata where that is exact, otherwise a note says none was carried.

    Example: depthtools import-hf ./TinyLlama --name tinyllama
    Example: depthtools import-hf ./tiny-q8_0.gguf --name tiny-gguf
    """
    # (the docstring's "\\[gguf]": rich would read a bare [gguf] as markup and print `pip install -e "."`)
    from depthtools.interop import import_hf  # lazy: keeps the CLI torch-free

    if directory.suffix.lower() == ".gguf":
        from depthtools.interop.gguf_import import import_gguf  # lazy: keeps the CLI torch-free

        summary = import_gguf(directory, name=name, out=out, force=force, max_seq_len=max_seq_len)
    else:
        summary = import_hf(directory, name=name, out=out, force=force, max_seq_len=max_seq_len)
    if as_json:
        print_json(summary)
        return
    _show(f"imported {directory}", summary)


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
