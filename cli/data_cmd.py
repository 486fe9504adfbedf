"""`depthtools data …`: prepare token files from corpora or the user's files, and list which corpora can be used here.

A thin layer over `depthtools.data`; errors are `DepthToolsError` with a one-line message, which
the main CLI prints. Registered in cli/main.py through SUB_APPS (`depthtools data ...`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperCommand

from depthtools.data import CORPORA, MIXES, available_corpora, prepare, prepare_inputs, read_meta
from depthtools.data.corpora import CorpusChecksumWarning
from depthtools.data.inputs import UNIT_BYTES
from depthtools.data.shards import SHARD_TOKENS
from depthtools.data.tokenizer import TOKENIZER_SPECS, is_tokenizer_file
from depthtools.errors import DepthToolsError

INPUT_OPTIONS = ("--input", "-i")
GLOB_HINT = ("a shell glob expands into several words: quote it (--input 'shards/*.parquet') or put the paths "
             "right after one --input")


def spread_inputs(args: list) -> list:
    """The words after one --input/-i value that are not options become inputs too, so an unquoted
    shell glob (`--input shards/*.parquet`, expanded by the shell into `--input a.parquet b.parquet`)
    means what a quoted one means: ["--input", "a", "b", "--name", "x"] -> ["--input", "a", "--input",
    "b", "--name", "x"]. Order is kept; `--` ends the options as usual."""
    out, taking, i = [], False, 0
    while i < len(args):
        word = str(args[i])  # programmatic callers may pass paths
        if word == "--":
            return out + list(args[i:])
        if word in INPUT_OPTIONS and i + 1 < len(args):
            out += [args[i], args[i + 1]]
            taking, i = True, i + 2
            continue
        if taking and not word.startswith("-"):
            out += ["--input", args[i]]
        else:
            out.append(args[i])
            taking = word.startswith("--input=")
        i += 1
    return out


# The usage-error class of the click typer runs on (typer >= 0.2x vendors its own click; BadParameter derives from it).
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class PrepareCommand(TyperCommand):
    """`data prepare`: several paths after one --input (`spread_inputs`); any other stray word is a usage
    error that says how to quote a glob."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, spread_inputs(list(args)))
        except _USAGE_ERROR as exc:
            if "unexpected extra argument" in str(exc.message):
                exc.message = f"{exc.message}; {GLOB_HINT}"
            raise


data_app = typer.Typer(help="Prepare training data from package-shipped corpora or your own local files (no hub downloads) and list corpora.",
                       no_args_is_help=True)
SUB_APPS = {"data": data_app}
_console = Console(stderr=True)


@data_app.command("prepare", cls=PrepareCommand)
def prepare_cmd(
    corpus: Optional[str] = typer.Option(None, "--corpus", "-c", help="Corpus NAME or MIX like 'shakespeare+sympy' (default: 'default', or 'text-dir' with --text-dir)."),
    text_dir: Optional[Path] = typer.Option(None, "--text-dir", help="Folder of your own UTF-8 files; each file is one document."),
    inputs: Optional[List[str]] = typer.Option(None, "--input", "-i", help="Your corpus (repeatable, or several paths after one --input; globs allowed, quoted or not): jsonl[.gz|.zst], parquet, a datasets save_to_disk folder, or a folder of text files. Written as token shards; see docs/data.md."),
    text_field: str = typer.Option("text", "--text-field", help="--input: the record field holding the text (dotted for nested, e.g. meta.body)."),
    domain_field: Optional[str] = typer.Option(None, "--domain-field", help="--input: a record field naming each document's domain (one validation split per domain)."),
    tokenizer: str = typer.Option("byte", "--tokenizer", "-t", help=f"One of: {', '.join(TOKENIZER_SPECS)}, or a local tokenizer.json (any `tokenizers` file)."),
    sep_token: Optional[str] = typer.Option(None, "--sep-token", help="The document separator of a tokenizer file (default: its <|endoftext|>, </s>, ...)."),
    workers: int = typer.Option(1, "--workers", "-w", help="--input: tokenizer worker processes."),
    shard_tokens: int = typer.Option(SHARD_TOKENS, "--shard-tokens", help="--input: tokens per shard file."),
    unit_mb: float = typer.Option(UNIT_BYTES / 2**20, "--unit-mb", hidden=True, help="--input: MB of input per work unit."),
    out: Path = typer.Option(Path("data"), "--out", "-o", help="Parent folder; the dataset lands in OUT/<name>/."),
    max_bytes: Optional[int] = typer.Option(None, "--max-bytes", help="--corpus: cap on each corpus's text in bytes (default: the mix's own cap)."),
    val_fraction: Optional[float] = typer.Option(None, "--val-fraction", help="Share of documents held out for validation (default 0.05 for --corpus, 0.01 for --input)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the train/val document split."),
    name: Optional[str] = typer.Option(None, "--name", help="Dataset folder name (default: from corpus or input, and tokenizer)."),
    force: bool = typer.Option(False, "--force", help="Rebuild a folder that holds a dataset with other settings (or other files)."),
) -> None:
    """Tokenize a corpus into a dataset folder: package corpora (--corpus, --text-dir) as train/val/val_<domain>.bin,
    your own files (--input) as fixed-size token shards, streamed by --workers processes; re-running continues.

    Examples:
      depthtools data prepare --corpus default --tokenizer bpe8k
      depthtools data prepare --input 'fineweb-edu/sample/10BT/*.parquet' --tokenizer gpt-neox/tokenizer.json --workers 16
      depthtools data prepare --input dump.jsonl.zst --domain-field source --name mix
    """
    if tokenizer not in TOKENIZER_SPECS and not is_tokenizer_file(tokenizer):
        raise DepthToolsError(f"--tokenizer {tokenizer!r} is not valid; use one of: {', '.join(TOKENIZER_SPECS)}, "
                              "or a path to a local tokenizer.json")
    log = lambda m: _console.print(m, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
    if inputs:
        if corpus is not None or text_dir is not None or max_bytes is not None:
            raise DepthToolsError("--input reads your files; it does not combine with --corpus, --text-dir or --max-bytes")
        path = prepare_inputs(inputs, out_dir=out, tokenizer=tokenizer, text_field=text_field, domain_field=domain_field,
                              val_fraction=0.01 if val_fraction is None else val_fraction, seed=seed, name=name,
                              workers=workers, shard_tokens=shard_tokens, sep_token=sep_token,
                              unit_bytes=max(1, int(unit_mb * 2**20)), force=force, log=log)
    else:
        if sep_token is not None:
            raise DepthToolsError("--sep-token applies to --input with a tokenizer file")
        corpus = corpus or ("text-dir" if text_dir is not None else "default")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CorpusChecksumWarning)
            path = prepare(corpus, out_dir=out, tokenizer=tokenizer, val_fraction=0.05 if val_fraction is None else val_fraction,
                           seed=seed, max_bytes=max_bytes, text_dir=text_dir, name=name, force=force, log=log)
        for w in caught:
            _console.print(f"warning: {w.message}", style="yellow", markup=False, highlight=False)
    meta = read_meta(path)
    counts = ", ".join(f"{k}={v['tokens']:,}" for k, v in meta["splits"].items())
    typer.echo(f"{path}  tokenizer={meta['tokenizer']['name']} (vocab {meta['tokenizer']['vocab_size']:,})  {counts}")


@data_app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Show every corpus, its domain, licence, source, and whether it can be prepared here (and why not).

    Example: depthtools data list --json
    """
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
