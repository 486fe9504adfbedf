"""`depthtools tasks …`: synthetic serial-computation probes (pointer chasing, S5, carry chains).

`tasks sample` shows generated samples with their answers; `tasks eval` scores a checkpoint (--ckpt) or
every checkpoint of a grid (--grid) per task and k — exact-match accuracy, answer loss, and the first
logit-lens depth that decodes the answer — prints a table (or --json) and saves the tidy tables
`tasks_eval` and `tasks_depth_reached` beside each checkpoint (and, for a grid, under <grid>/analysis/).
A thin layer over `depthtools.data.tasks` and `depthtools.analysis.tasks`; registered through SUB_APPS.
Bad input prints one line on stderr and exits with code 2 (the root group in cli/main.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from cli.common import console, fmt, parse_list, print_json, table
from depthtools.data.tasks import TASK_HELP, TASKS, check_k, generate, parse_k, parse_tasks
from depthtools.errors import DepthToolsError

tasks_app = typer.Typer(help="Synthetic serial-computation probes: show samples, evaluate checkpoints per task and k.",
                        no_args_is_help=True)
SUB_APPS = {"tasks": tasks_app}


def _fmt(value) -> str:
    return fmt(value, 3)


def _records(df) -> list[dict[str, Any]]:
    return json.loads(df.to_json(orient="records"))


TASK_NAMES = ", ".join(TASKS)


@tasks_app.command("sample")
def sample_command(
    task: str = typer.Option(..., "--task", "-t", help=f"One of: {TASK_NAMES}."),
    k: int = typer.Option(1, "--k", "-k", help="Difficulty: number of serial steps (>= 1)."),
    n: int = typer.Option(5, "-n", "--n", help="Number of samples."),
    seed: int = typer.Option(0, "--seed", help="Seed (evaluation samples use the same generator)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (text, answer span, prompt, answer)."),
):
    """Show generated samples of one task at difficulty k, with the answer span.

    Example: depthtools tasks sample --task s5 --k 3 -n 5
    """
    check_k(task, k)
    samples = generate(task, k, n, seed)
    if as_json:
        print_json([s.to_dict() for s in samples])
        return
    rows = [[str(i), s.prompt, Text(s.answer, style="bold green"), f"{s.answer_start}:{s.answer_end}",
             str(len(s.text))] for i, s in enumerate(samples)]
    console.print(table(f"{task} (k={k}): {TASK_HELP[task]}", ["#", "prompt", "answer", "span", "bytes"], rows))


@tasks_app.command("eval")
def eval_command(
    ckpt: Optional[str] = typer.Option(None, "--ckpt", help="Checkpoint path or cell name (e.g. preln_L8)."),
    grid: Optional[Path] = typer.Option(None, "--grid", help="Grid directory: evaluate every checkpoint in it."),
    tasks: str = typer.Option(",".join(TASKS), "--tasks", help=f"Comma-separated tasks ({TASK_NAMES})."),
    k: str = typer.Option("1-8", "--k", "-k", help="k values: a range 1-8, a list 1,2,4, or one number."),
    n: int = typer.Option(200, "-n", "--n", help="Samples per task and k."),
    seed: int = typer.Option(0, "--seed", help="Sample seed (every model of a grid sees the same samples)."),
    threshold: float = typer.Option(0.9, "--threshold", help="Accuracy that counts as solved (depth reached)."),
    batch_size: int = typer.Option(64, "--batch-size", help="Sequences per forward batch."),
    save: bool = typer.Option(True, "--save/--no-save", help="Save tasks_eval / tasks_depth_reached tables."),
    force: bool = typer.Option(False, "--force", help="Recompute even when a table with the same settings is saved."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (table rows, depth reached, notes)."),
):
    """Exact-match accuracy, answer loss and logit-lens depth per task and k; largest k solved.

    Accuracy is teacher-forced exact match of the answer and its end marker (identical to greedy
    decoding of the answer span, in one forward pass). k outside the checkpoint's training mix
    measures length generalisation (column in_train_range).

    Example: depthtools tasks eval --ckpt preln_L8 --tasks chase,s5 --k 1-12 -n 200
    Example: depthtools tasks eval --grid checkpoints/tiny --threshold 0.8 --json
    """
    from depthtools.analysis.tasks import evaluate_checkpoint, evaluate_grid  # lazy: keeps the CLI torch-free
    from depthtools.checkpoint import load  # lazy: keeps the CLI torch-free

    if (ckpt is None) == (grid is None):
        raise DepthToolsError("give exactly one of --ckpt NAME or --grid DIR")
    task_list, ks = parse_tasks(parse_list(tasks, "str", "--tasks", "chase,s5")), parse_k(k)
    for name in task_list:
        check_k(name, max(ks))
    if n < 1:
        raise DepthToolsError(f"-n must be >= 1 samples, got {n}")
    if not 0 < threshold <= 1:
        raise DepthToolsError(f"--threshold must lie in (0, 1], got {threshold}")
    args = dict(tasks=task_list, ks=ks, n=n, seed=seed, threshold=threshold, batch_size=batch_size, save=save,
                force=force)
    if ckpt is not None:
        model = load(ckpt)
        df, reached = evaluate_checkpoint(model, **args)
        where = Path(model.checkpoint_dir) / "analysis"
        title = Path(model.checkpoint_dir).name
    else:
        quiet = Console(stderr=True)
        df, reached = evaluate_grid(grid, **args, progress=None if as_json else (
            lambda name, i, total: i < total and quiet.print(f"[{i + 1}/{total}] {name}", highlight=False, markup=False)))
        where, title = Path(grid) / "analysis", str(grid)
    notes = list(df.attrs.get("notes", []))
    if as_json:
        print_json({"table": _records(df), "depth_reached": _records(reached), "notes": notes})
        return
    _show(df, reached, title, threshold)
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    if save:
        console.print(f"saved {where}/tasks_eval.parquet and tasks_depth_reached.parquet", highlight=False)


def _show(df, reached, title: str, threshold: float) -> None:
    from depthtools.analysis.tasks import wide  # lazy: keeps the CLI torch-free

    w = wide(df)
    wide_console = Console(width=max(console.width, 140))
    cols = ["model", "task", "k", "in train", "accuracy", "answer_loss", "lens depth", "lens rel depth", "n"]
    rows = [[r["model"], r["task"], str(r["k"]), "yes" if r["in_train_range"] else "no", _fmt(r.get("accuracy")),
             _fmt(r.get("answer_loss")), _fmt(r.get("lens_first_depth")), _fmt(r.get("lens_first_rel_depth")),
             _fmt(int(r["n_samples"]) if not math.isnan(r.get("n_samples", math.nan)) else None)]
            for r in w.to_dict(orient="records")]
    wide_console.print(table(f"serial-computation probes — {title}", cols, rows))
    rows = [[r["model"], r["arch"], str(r["n_layer"]), str(r["d_model"]), r["task"], str(r["depth_reached"]),
             str(r["k_max_evaluated"])] for r in reached.to_dict(orient="records")]
    wide_console.print(table(f"computational depth reached (largest k with accuracy >= {threshold:g} at every k' <= k)",
                             ["model", "arch", "n_layer", "d_model", "task", "depth reached", "k max evaluated"], rows))
