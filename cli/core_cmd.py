"""Core commands: `archs`, `grid plan`, `info`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from cli.app import app, grid_app
from cli.common import console, err_console, parse_list, print_json, table
from depthtools.data import read_meta
from depthtools.data.budget import NOMINAL_VOCAB, check_vocab
from depthtools.errors import DepthToolsError
from depthtools.fsutil import check_name
from depthtools.presets import PRESETS, get_preset
from depthtools.profiles import apply_to_spec


@app.command("archs")
def archs_command(
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the docs' markdown table (generated from the registry)."),
):
    """List the registered architectures.

    Example: depthtools archs --json
    """
    from depthtools.arch import list_archs  # lazy: keeps the CLI torch-free
    from depthtools.arch.cpu_kernels import kernel_status  # lazy: keeps the CLI torch-free

    if markdown:
        from depthtools.arch.doc_table import registry_markdown_table  # lazy: keeps the CLI torch-free

        print(registry_markdown_table())
        return

    kernels = kernel_status()  # which path each CPU kernel library takes (C or torch ops); builds nothing
    rows = [
        {
            "name": s.name, "family": s.family, "description": s.description, "extra_params": s.extra_formula,
            "paper": s.paper, "in_depthbench": s.in_depthbench, "aliases": list(s.aliases),
            "cpu_kernels": {lib: kernels[lib] for lib in getattr(s.scheme, "kernel_libraries", ())},
        }
        for s in list_archs()
    ]
    if as_json:
        print_json(rows)
        return
    console.print(table(
        "depthtools architectures", ["name", "family", "description", "extra params", "paper", "DepthBench"],
        [[r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else ""), r["family"], r["description"],
          r["extra_params"], r["paper"], "yes" if r["in_depthbench"] else ""] for r in rows],
    ))
    console.print("CPU kernels (fused paths on CPU): " + "; ".join(f"{lib}: {path}" for lib, path in kernels.items()))


@grid_app.command("plan")
def grid_plan_command(
    files: Optional[List[Path]] = typer.Argument(None, help="With --from-depthbench: DepthBench model configs (configs/*.json)."),
    from_depthbench: bool = typer.Option(False, "--from-depthbench", help="Plan one cell per architecture and DepthBench config FILE at exactly its shape (docs/olmo-core.md)."),
    arch: str = typer.Option("preln", "--arch", help="Architecture(s), comma-separated (see `depthtools archs`)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Parameter budget, e.g. 405.4M, 1.6M, 200k."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Depths, e.g. 16,20,24,28,32."),
    aspect_ratios: Optional[str] = typer.Option(None, "--aspect-ratios", help="Instead of depths: d_model/n_layer targets."),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="Vocabulary size (default: the --data tokenizer's, else 256 for bytes)."),
    data: Optional[Path] = typer.Option(None, "--data", help="A prepared data folder: its tokenizer sets the vocabulary, every cell's budget is checked against its tokens, and `grid train` uses it."),
    data_root: Path = typer.Option(Path("data"), "--data-root", help="Where a preset's prepared data is looked for."),
    basis: str = typer.Option("total", "--basis", help="Budget counts 'total' or 'non_embedding' parameters."),
    tolerance: float = typer.Option(0.03, "--tolerance", help="Allowed relative deviation from the budget."),
    n_heads: Optional[int] = typer.Option(None, "--n-heads", help="Fixed head count (default 16 unless --head-dim)."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Fixed head size instead of a fixed head count."),
    head_dim_multiple: int = typer.Option(2, "--head-dim-multiple", help="head_dim must be a multiple of this."),
    n_kv_heads: Optional[int] = typer.Option(None, "--n-kv-heads", help="Key/value heads (GQA); default = n_heads."),
    ffn_multiple: int = typer.Option(16, "--ffn-multiple", help="d_ff = ratio·d rounded up to this multiple (0: no rounding)."),
    ffn_ratio: float = typer.Option(8 / 3, "--ffn-ratio", help="d_ff / d_model before rounding."),
    max_seq_len: int = typer.Option(256, "--max-seq-len", help="Context length of the models."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="Training seeds, e.g. 0,1,2: one cell per (arch, depth, seed); seed s > 0 is named <arch>_L<n>_s<s> (default: the preset's, else 0)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="A named grid (see `depthtools grid presets`)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Recipe profile for every cell: depthbench = DepthBench's recipe and architecture options (docs/depthbench.md); recorded in the spec's train section."),
    name: Optional[str] = typer.Option(None, "--name", help="Grid name (directory under checkpoints/)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the grid spec JSON that `grid train` consumes."),
    as_json: bool = typer.Option(False, "--json", help="Print the cells as JSON."),
):
    """Plan an iso-parameter grid: for each depth, the width closest to the budget (exact counts).

    Examples:
      depthtools grid plan --arch preln --budget 405.4M --vocab-size 50280 --n-heads 16
        --head-dim-multiple 2 --ffn-multiple 16 --layers 16,20,24,28,32 --json
      depthtools grid plan --preset tiny --out grid.json
      depthtools grid plan --preset demo --seeds 0,1,2 --out demo3.json
      depthtools grid plan --preset afternoon --profile depthbench --name afternoon-depthbench --out db.json
      depthtools grid plan --from-depthbench configs/llama_400m_L16.json configs/llama_400m_L24.json
        configs/llama_400m_L32.json --arch preln,hc --profile depthbench --name db400m --out db400m.json
    """
    from depthtools.grid import grid_spec, parse_seeds, plan_grid, save_grid  # lazy: keeps the CLI torch-free

    if name is not None:  # before planning, which can take a while
        check_name(name, "grid name (--name)")
    meta = _data_meta(data)
    seeds = parse_seeds(parse_list(seeds, "int", "--seeds", "0,1,2")) if seeds is not None else None
    if files and not from_depthbench:
        raise DepthToolsError(f"grid plan takes FILE arguments only with --from-depthbench (got {files[0]})")
    if from_depthbench:
        if preset is not None or budget is not None or layers is not None or aspect_ratios is not None:
            raise DepthToolsError("--from-depthbench takes the shapes from its files: drop --preset, --budget, "
                                  "--layers and --aspect-ratios")
        from depthtools.interop.depthbench_configs import depthbench_cells  # lazy: keeps the CLI torch-free

        archs = parse_list(arch, "str", "--arch", "preln,hc")
        planned, notes = depthbench_cells(files or [], archs, seeds, basis)
        for note in notes:
            console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        spec = grid_spec(planned, name=name or "depthbench", plan={"from_depthbench": [str(f) for f in files or []],
                                                                   "arch": archs, "basis": basis},
                         data={"dir": str(data.expanduser().resolve())} if data is not None else None)
        cells = spec["cells"]
    elif preset is not None:
        spec = get_preset(preset).grid_spec(name=name, seeds=seeds)
        if data is not None:
            spec["data"] = {"dir": str(data.expanduser().resolve())}
        cells = spec["cells"]
    else:
        if budget is None or (layers is None and aspect_ratios is None):
            raise DepthToolsError("give --budget and --layers (or --aspect-ratios), or a --preset")
        if n_heads is not None and n_heads < 1:  # 0 is a value, not "unset": never replaced by the default
            raise DepthToolsError(f"--n-heads must be a positive integer, got {n_heads}")
        if vocab_size is None:
            vocab_size = int(meta["tokenizer"]["vocab_size"]) if meta else 256
        plan_args = dict(
            arch=parse_list(arch, "str", "--arch", "preln,hc"), budget=budget, vocab_size=vocab_size,
            layers=parse_list(layers, "int", "--layers", "16,20,24"),
            aspect_ratios=parse_list(aspect_ratios, "float", "--aspect-ratios", "76,42.7,28"), basis=basis,
            tolerance=tolerance, n_heads=n_heads if (n_heads is not None or head_dim) else 16, head_dim=head_dim,
            head_dim_multiple=head_dim_multiple, n_kv_heads=n_kv_heads, ffn_ratio=ffn_ratio,
            ffn_multiple=ffn_multiple or None, max_seq_len=max_seq_len, seeds=parse_seeds(seeds),
        )
        cells = plan_grid(**plan_args)
        spec = grid_spec(cells, name=name or "grid", plan={k: v for k, v in plan_args.items()},
                         data={"dir": str(data.expanduser().resolve())} if data is not None else None)
        cells = spec["cells"]
    if profile is not None:
        spec = apply_to_spec(spec, profile)
        cells = spec["cells"]
    _check_plan_data(spec, data_root)
    if out is not None:
        save_grid(spec, out)
    if as_json:
        print_json(cells)
        return
    console.print(table(
        f"grid {spec['name']} ({len(cells)} cells)",
        ["name", "seed", "n_layer", "d_model", "heads", "head_dim", "d_ff", "params", "non-emb", "extra", "deviation", "d/L"],
        [[c["name"], c.get("seed", 0), c["n_layer"], c["d_model"], c["n_heads"], c["head_dim"], c["d_ff"], f"{c['params_total']:,}",
          f"{c['params_non_embedding']:,}", f"{c['params_extra']:,}", f"{c['deviation']:+.2%}",
          f"{c['aspect_ratio']:.1f}"] for c in cells],
    ))
    if out is not None:
        console.print(f"wrote {out}", markup=False, highlight=False)


def _data_meta(data: Optional[Path]):
    if data is None:
        return None

    return read_meta(data)


def _check_plan_data(spec, data_root: Path) -> None:
    """Refuse a plan whose vocabulary does not fit its data's tokenizer, or whose cells' token budgets
    exceed the recipe's max_epochs of the data (depthtools.data.budget; warnings above one epoch are
    logged); say what a preset's data needs when it is not prepared yet."""
    from depthtools.grid import Cell  # lazy: keeps the CLI torch-free
    from depthtools.train.sweep import check_grid_data  # lazy: keeps the CLI torch-free

    data = dict(spec.get("data") or {})
    if not data:  # a plan that names no data: `grid train` checks it against the data it is given
        return
    spec = {**spec, "cells": [Cell(**c) for c in spec["cells"]]}
    if "dir" in data:
        folder = Path(data["dir"]).expanduser()
        folder = folder if folder.is_absolute() else data_root / folder
        if (folder / "meta.json").is_file():
            check_grid_data(spec, folder)
            return
        needs = f"; it needs {data['needs']}" if data.get("needs") else ""
        how = f"; prepare it with: {data['prepare'].replace('DATA_ROOT', str(data_root))}" if data.get("prepare") else ""
        console.print(f"note: no prepared data in {folder} yet{needs}{how}", markup=False, highlight=False, soft_wrap=True)
        return
    tokenizer = data.get("tokenizer", "byte")
    if tokenizer in NOMINAL_VOCAB:  # known before anything is prepared (a trained BPE has at most this many)
        where = "the --input files" if "input" in data else f"corpus {data.get('corpus', 'default')!r}"
        for cell in spec["cells"]:
            check_vocab(cell.model_config().vocab_size, {"name": tokenizer, "vocab_size": NOMINAL_VOCAB[tokenizer]},
                        where, cell.name)


@grid_app.command("presets")
def grid_presets_command(as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """List the named grids: what each holds, its training seeds and its measured cost.

    Example: depthtools grid presets
    """
    rows = [{"name": p.name, "archs": ",".join(p.plan["arch"]), "layers": ",".join(map(str, p.plan["layers"])),
             "budget": p.plan["budget"], "seeds": ",".join(map(str, p.plan.get("seeds", [0]))),
             "description": p.description} for p in PRESETS.values()]
    if as_json:
        print_json(rows)
        return
    for r in rows:
        console.print(f"[bold]{escape(r['name'])}[/]: {escape(r['description'])}\n    archs {escape(r['archs'])}; "
                      f"layers {r['layers']}; budget {r['budget']:,}; seeds {r['seeds']}", highlight=False)


@app.command("info")
def info_command(
    ckpt: str = typer.Option(..., "--ckpt", help="Checkpoint path or cell name (e.g. hc_L8)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Show a checkpoint's config, sizes and training summary.

    Example: depthtools info --ckpt preln_L4
    """
    from depthtools.checkpoint import checkpoint_summary  # lazy: keeps the CLI torch-free

    summary = checkpoint_summary(ckpt)
    if summary["weights"] != "ok":
        err_console.print(f"[bold yellow]warning:[/] {escape(str(summary['weights']))}; this checkpoint cannot be "
                          "loaded or probed (restore the file, or retrain the cell with --force)", highlight=False,
                          soft_wrap=True)
    if as_json:
        print_json(summary)
        return
    rows = [[k, v] for k, v in summary.items() if not isinstance(v, dict)]
    for section in ("model", "params", "training", "eval", "source"):
        for k, v in (summary.get(section) or {}).items():
            rows.append([f"{section}.{k}", v])
    console.print(table(f"checkpoint {summary['name']}", ["field", "value"], rows))
