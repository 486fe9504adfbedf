"""The embedded default: data -> iso-parameter grid -> training -> probe suite -> report, in one call.

`run_demo("demo")` prepares the preset's corpus, trains every cell of its grid on CPU, runs the
analysis suite and the effective-depth summary, and writes `reports/<preset>/index.html`. Every
stage reuses what is done (finished cells are skipped, interrupted ones resume, saved tables with
the same settings are not recomputed), so re-running after a crash or Ctrl-C continues.

Progress is reported as one overall fraction: `on_progress(stage, fraction_of_whole_demo, detail)`,
and, for logs, as plain milestone lines: `log(line)` once per stage started and finished and per
cell trained, skipped or analysed (what `depthtools demo` prints when its output is not a terminal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from depthtools.analysis.suite import analyze_grid
from depthtools.analysis.summary import summarize_grid
from depthtools.analysis.tasks import evaluate_grid
from depthtools.presets import get_preset
from depthtools.report import grid_report
from depthtools.train.launch import launch_local
from depthtools.train.sweep import grid_data_dir, load_spec, train_grid

# Share of the whole demo's wall time each stage takes (measured on the demo preset, 2 CPU cores),
# so one progress bar moves at a roughly even pace.
STAGE_WEIGHTS = {"data": 0.03, "train": 0.75, "analyze": 0.17, "summary": 0.01, "tasks": 0.02, "report": 0.02}

TASK_SAMPLES = 64  # per task and k: enough to tell 0.1 from 0.5 accuracy, cheap on CPU

OnProgress = Callable[[str, float, str], None]


@dataclass
class DemoResult:
    """Where the demo put things and how long each stage took (seconds)."""

    grid_dir: Path
    report: Path
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class _Stages:
    """Maps a stage's own progress (0..1) onto the overall fraction and times each stage."""

    def __init__(self, on_progress: OnProgress | None, stages: list[str], log: Callable[[str], None] | None = None):
        weights = {s: STAGE_WEIGHTS[s] for s in stages}
        total = sum(weights.values())
        self.start, acc = {}, 0.0
        for s in stages:
            self.start[s] = acc / total
            acc += weights[s]
        self.weight = {s: w / total for s, w in weights.items()}
        self.on_progress = on_progress
        self.seconds: dict[str, float] = {}
        self._t0: dict[str, float] = {}
        self.log = log or (lambda _line: None)

    def update(self, stage: str, fraction: float, detail: str = "") -> None:
        if stage not in self._t0:
            self._t0[stage] = time.perf_counter()
            self.log(f"{stage}: {detail or 'started'}")
        if self.on_progress is not None:
            overall = self.start[stage] + self.weight[stage] * min(max(fraction, 0.0), 1.0)
            self.on_progress(stage, overall, detail)

    def done(self, stage: str, detail: str = "done") -> None:
        self.update(stage, 1.0, detail)
        self.seconds[stage] = round(time.perf_counter() - self._t0[stage], 2)
        self.log(f"{stage}: done in {self.seconds[stage]:.0f}s" + ("" if detail == "done" else f" ({detail})"))


def _train_progress(stages: _Stages, spec: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """Turns the trainer's per-cell events into the train stage's fraction (cells weighted equally)."""
    n_cells = max(len(spec["cells"]), 1)

    def relay(event: dict[str, Any]) -> None:
        index = event.get("cell_index", 0)
        kind, cell = event.get("event"), event.get("cell", "")
        if kind == "done":
            val = f", val loss {event['val_loss']:.4f}" if event.get("val_loss") is not None else ""
            stages.log(f"train: {cell} trained ({index + 1}/{n_cells}{val})")
        elif kind == "skip":
            stages.log(f"train: {cell} already trained ({index + 1}/{n_cells})")
        elif kind == "start" and event.get("step"):
            stages.log(f"train: {cell} resuming from step {event['step']}")
        within = 1.0 if event.get("event") in ("skip", "done") else (
            event.get("step", 0) / max(event.get("total_steps", 1), 1))
        loss = f" loss {event['train_loss']:.3f}" if "train_loss" in event else ""
        stages.update("train", (index + within) / n_cells, f"{event.get('cell', '')} step "
                      f"{event.get('step', 0)}/{event.get('total_steps', '?')}{loss}")
    return relay


def run_demo(preset: str = "demo", root: str | Path = "checkpoints", data_root: str | Path = "data",
             reports_root: str | Path = "reports", on_progress: OnProgress | None = None,
             tasks: bool = True, workers: int = 1, log: Callable[[str], None] | None = None) -> DemoResult:
    """Run the whole embedded default for a preset and return where the report is.

    `log(line)` gets a milestone line per stage started and finished and per cell done (see module doc).

    `workers` > 1 trains cells in that many 1-thread processes (the local launcher): on a small CPU
    model, two 1-thread workers on 2 cores beat one 2-thread process. Progress then moves per cell.
    """
    chosen = get_preset(preset)
    spec = load_spec(chosen.grid_spec())
    grid_dir = Path(root) / spec["name"]
    probes = ["analyze", "summary"] if chosen.probes else []  # text probes: not for models trained on tasks alone
    stages = _Stages(on_progress, ["data", "train", *probes, *(["tasks"] if tasks else []), "report"], log)
    notes: list[str] = []

    stages.update("data", 0.0, f"preparing corpus {chosen.data.get('corpus', 'default')}")
    grid_data_dir(spec, data_root)
    stages.done("data")

    if workers > 1:
        notes += _train_in_pool(spec, root, data_root, workers, stages)
    else:
        train_grid(spec, root=root, data_root=data_root, progress=_train_progress(stages, spec))
    stages.done("train")

    if probes:
        analysis = analyze_grid(grid_dir, **chosen.analysis, progress=_analyze_progress(stages))
        notes += analysis.not_applicable
        stages.done("analyze")

        stages.update("summary", 0.0, "effective-depth summary")
        summarize_grid(grid_dir, n_boot=200)
        stages.done("summary")

    if tasks:
        notes += _evaluate_tasks(grid_dir, stages, **{"n": TASK_SAMPLES, **chosen.task_eval})
        stages.done("tasks")

    stages.update("report", 0.0, "writing the grid report")
    out = Path(reports_root) / preset / "index.html"
    grid_report(grid_dir, out, title=f"depthtools demo — preset {preset}")
    stages.done("report", str(out))
    return DemoResult(grid_dir=grid_dir, report=out, seconds=stages.seconds, notes=notes)


def _analyze_progress(stages: _Stages) -> Callable[[str, int, int], None]:
    """analyze_grid's per-analysis calls ("cell: analysis") as the stage's fraction, and a log line when
    it moves on to the next checkpoint (so a log gets one line per cell, not one per analysis)."""
    current = [None]

    def show(what: str, done: int, total: int) -> None:
        stages.update("analyze", done / max(total, 1), what)
        cell = what.split(":")[0]
        if current[0] is not None and cell != current[0]:
            stages.log(f"analyze: {current[0]} done ({done}/{total} analyses)")
        current[0] = cell
    return show


def _train_in_pool(spec: dict[str, Any], root, data_root, workers: int, stages: _Stages) -> list[str]:
    """Train the grid with the local process-pool launcher; a failed cell becomes a note (the report lists it)."""
    n_cells, finished = max(len(spec["cells"]), 1), []

    def log(line: str) -> None:
        finished.append(line)
        stages.update("train", len(finished) / n_cells, line)
        stages.log(f"train: {line} ({len(finished)}/{n_cells})")

    stages.update("train", 0.0, f"training {len(spec['cells'])} cells in {workers} worker processes")
    results = launch_local(spec, root=root, data_root=data_root, workers=workers, threads=1, log=log)
    return [f"training failed for {r['name']}: {r['error']}" for r in results if r.get("error")]


def _evaluate_tasks(grid_dir: Path, stages: _Stages, **settings) -> list[str]:
    """The synthetic serial-computation tasks on every cell (accuracy, answer loss, lens depth per k);
    `settings` are evaluate_grid's (n, and the preset's tasks and ks)."""
    def show(what: str, done: int, total: int) -> None:
        stages.update("tasks", done / max(total, 1), f"depth tasks: {what}")
        if what != "done":
            stages.log(f"tasks: {what} ({done + 1}/{total})")

    df, _ = evaluate_grid(grid_dir, **settings, progress=show)
    return list(df.attrs.get("notes", []))
