"""Plain progress lines for long commands whose output is not a terminal (a log file, nohup, Slurm).

rich draws its live progress bars only on a terminal; elsewhere it prints nothing until the end, so a
`depthtools demo > log` showed nothing for ten minutes. Long commands (`demo`, `grid train`,
`analyze`, and every probe command: `PlainProgress`) check `is_plain()` and then print one line per finished
stage or cell instead, each stamped with the time since the command started, flushed as it happens (rich
flushes every print), and at least one line a minute while a stage runs.
"""

from __future__ import annotations

import threading
import time

from cli.common import console


def is_plain(out=None) -> bool:
    """True when the command's output (`out`, default stdout's console) is not a terminal, so live bars
    would show nothing."""
    return not (console if out is None else out).is_terminal


def elapsed(seconds: float) -> str:
    """0:07, 12:05, 1:02:33 (h:mm:ss once past an hour)."""
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class PlainLog:
    """`log(text)` prints `[elapsed] text` literally (on `out`, default the app's stdout console);
    `log.every(text)` prints only if `every_s` seconds passed since the last line (for per-step events,
    so a long cell still shows it is alive)."""

    def __init__(self, every_s: float = 60.0, out=None):
        self.t0 = time.monotonic()
        self.every_s = every_s
        self.last = float("-inf")
        self.out = console if out is None else out  # the probe commands log to stderr (stdout: --json)

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        self.last = now
        self.out.print(f"[{elapsed(now - self.t0)}] {text}", markup=False, highlight=False, soft_wrap=True)

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


class PlainProgress:
    """A probe's progress bar without a terminal: a line when it starts and ends, and in between a line at
    least every `every_s` seconds, whether or not the probe reports steps (a daemon thread watches, so a
    probe that runs for minutes between callbacks -- similarity's statistics, one causal batch -- still
    shows it is alive). Used like rich's bar: `with bar: ... advance(n)`."""

    def __init__(self, description: str, total: float | None, log: PlainLog | None = None, every_s: float = 60.0):
        self.description, self.total, self.done = description, total, 0.0
        self.log = log if log is not None else PlainLog(every_s)
        self.log.every_s = every_s
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def status(self) -> str:
        """`name ckpt: 12/30 (40%), 1:05 elapsed`, or without a count when the total is unknown."""
        took = elapsed(time.monotonic() - self.started)
        if self.total:
            return (f"{self.description}: {self.done:.0f}/{self.total:.0f} "
                    f"({100 * self.done / self.total:.0f}%), {took} elapsed")
        return f"{self.description}: running, {took} elapsed"

    def advance(self, amount: float) -> None:
        self.done += amount

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.log.every_s / 4)):
            self.log.every(self.status())

    def __enter__(self) -> "PlainProgress":
        self.log(f"{self.description}: started" + (f", {self.total:.0f} steps" if self.total else ""))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self.log(f"{self.description}: done in {elapsed(time.monotonic() - self.started)}")
