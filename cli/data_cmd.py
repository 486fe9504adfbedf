"""`depthtools data …`: prepare token files from corpora and list which corpora can be used here.

A thin layer over `depthtools.data`; errors are `DepthToolsError` with a one-line message, which
the main CLI prints. Registered in cli/main.py through SUB_APPS (`depthtools data ...`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from depthtools.data import CORPORA, MIXES, available_corpora, prepare, read_meta
from depthtools.data.corpora import CorpusChecksumWarning
from depthtools.data.tokenizer import TOKENIZER_SPECS
from depthtools.errors import DepthToolsError

data_app = typer.Typer(help="Prepare training data from package-shipped corpora (no hub downloads) and list corpora.",
                       no_args_is_help=True)
SUB_APPS = {"data": data_app}
_console = Console(stderr=True)


@data_app.command("prepare")
def prepare_cmd(
    corpus: Optional[str] = typer.Option(None, "--corpus", "-c", help="Corpus NAME or MIX like 'shakespeare+sympy' (default: 'default', or 'text-dir' with --text-dir)."),
    text_dir: Optional[Path] = typer.Option(None, "--text-dir", help="Folder of your own UTF-8 files; each file is one document."),
    tokenizer: str = typer.Option("byte", "--tokenizer", "-t", help=f"One of: {', '.join(TOKENIZER_SPECS)}."),
    out: Path = typer.Option(Path("data"), "--out", "-o", help="Parent folder; the dataset lands in OUT/<name>/."),
    max_bytes: Optional[int] = typer.Option(None, "--max-bytes", help="Cap on each corpus's text in bytes (default: the mix's own cap)."),
    val_fraction: float = typer.Option(0.05, "--val-fraction", help="Share of documents held out for validation."),
    seed: int = typer.Option(0, "--seed", help="Seed of the train/val document split."),
    name: Optional[str] = typer.Option(None, "--name", help="Dataset folder name (default: from corpus and tokenizer)."),
    force: bool = typer.Option(False, "--force", help="Rebuild a folder that holds a dataset with other settings (or other files)."),
) -> None:
    """Extract, split by whole documents, tokenize and write train/val/val_<domain>.bin + meta.json."""
    if tokenizer not in TOKENIZER_SPECS:
        raise DepthToolsError(f"--tokenizer {tokenizer!r} is not valid; use one of: {', '.join(TOKENIZER_SPECS)}")
    corpus = corpus or ("text-dir" if text_dir is not None else "default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CorpusChecksumWarning)
        path = prepare(corpus, out_dir=out, tokenizer=tokenizer, val_fraction=val_fraction, seed=seed,
                       max_bytes=max_bytes, text_dir=text_dir, name=name, force=force, log=lambda m: _console.print(m, markup=False, highlight=False, soft_wrap=True))
    for w in caught:
        _console.print(f"warning: {w.message}", style="yellow", markup=False, highlight=False)
    meta = read_meta(path)
    counts = ", ".join(f"{k}={v['tokens']:,}" for k, v in meta["splits"].items())
    typer.echo(f"{path}  tokenizer={meta['tokenizer']['name']}  {counts}")


@data_app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Show every corpus, its domain, licence, source, and whether it can be prepared here (and why not)."""
    rows = []
    for a in available_corpora():
        c = CORPORA.get(a.name)
        rows.append({"name": a.name, "domain": c.domain if c else "text/code", "license": c.license if c else "yours",
                     "source": c.source if c else "dir:<--text-dir>", "version": c.package_version if c else None,
                     "available": a.available, "reason": a.reason})
    mixes = {k: list(v[0]) for k, v in MIXES.items()}
    if as_json:
        typer.echo(json.dumps({"corpora": rows, "mixes": mixes}, indent=2))
        return
    table = Table(title="depthtools corpora")
    for col in ("name", "domain", "source", "license", "available"):
        table.add_column(col)
    for r in rows:
        status = f"[green]yes[/] ({r['reason']})" if r["available"] else f"[red]no[/] ({r['reason']})"
        table.add_row(r["name"], r["domain"], r["source"], r["license"], status)
    Console().print(table)
    for k, v in mixes.items():
        typer.echo(f"mix {k!r} = {'+'.join(v)}")
