"""Plain progress lines for long commands whose output is not a terminal (a log file, nohup, Slurm).

rich draws its live progress bars only on a terminal; elsewhere it prints nothing until the end, so a
`depthtools demo > log` showed nothing for ten minutes. Long commands (`demo`, `grid train`,
`analyze`) check `is_plain()` and then print one line per finished stage or cell instead, each
stamped with the time since the command started, flushed as it happens (rich flushes every print).
"""

from __future__ import annotations

import time

from cli.common import console


def is_plain() -> bool:
    """True when the command's output is not a terminal, so live bars would show nothing."""
    return not console.is_terminal


def elapsed(seconds: float) -> str:
    """0:07, 12:05, 1:02:33 (h:mm:ss once past an hour)."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class PlainLog:
    """`log(text)` prints `[elapsed] text` literally; `log.every(text)` prints only if `every_s` seconds
    passed since the last line (for per-step events, so a long cell still shows it is alive)."""

    def __init__(self, every_s: float = 60.0):
        self.t0 = time.monotonic()
        self.every_s = every_s
        self.last = float("-inf")

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        self.last = now
        console.print(f"[{elapsed(now - self.t0)}] {text}", markup=False, highlight=False, soft_wrap=True)

    def every(self, text: str) -> None:
        if time.monotonic() - self.last >= self.every_s:
            self(text)


class PlainTrainDisplay:
    """The `grid train` progress callback without a terminal: a line when a cell starts, resumes, is
    skipped or finishes (with its val loss and time), and a step line at most every `every_s` seconds."""

    def __init__(self, n_cells: int, every_s: float = 60.0):
        self.log = PlainLog(every_s)
        self.n_cells = n_cells
        self.total_steps: dict[str, int] = {}
        self.started: dict[str, float] = {}

    def __enter__(self) -> "PlainTrainDisplay":
        self.log(f"training {self.n_cells} cell(s); one line per cell (output is not a terminal)")
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __call__(self, event: dict) -> None:
        cell, kind = str(event.get("cell", "?")), event["event"]
        where = f"cell {event.get('cell_index', 0) + 1}/{self.n_cells} {cell}"
        if kind == "skip":
            why = event.get("why", "finished")
            self.log(f"{where}: already finished, skipped" if why == "finished" else f"{where}: skipped: {why}")
        elif kind == "start":
            self.total_steps[cell], self.started[cell] = event.get("total_steps", 0), time.monotonic()
            step = event.get("step", 0)
            self.log(f"{where}: " + (f"resuming from step {step}/{self.total_steps[cell]}" if step
                                     else f"started, {self.total_steps[cell]} steps"))
        elif kind == "step":
            val = f", val {event['val_loss']:.3f}" if event.get("val_loss") is not None else ""
            self.log.every(f"{where}: step {event.get('step')}/{self.total_steps.get(cell, '?')}, "
                           f"loss {event.get('train_loss', float('nan')):.3f}{val}")
        elif kind == "done":
            took = time.monotonic() - self.started.get(cell, time.monotonic())
            val = f", val loss {event['val_loss']:.4f}" if event.get("val_loss") is not None else ""
            self.log(f"{where}: done in {elapsed(took)}{val}")
