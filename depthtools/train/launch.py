"""Run a grid's cells in parallel: a local process pool, a Slurm job array (submitit), or Ray tasks.

    launch_local(spec, root, workers=2, threads=1)             # 2 cells at a time, 1 torch thread each
    submit_cells(spec, root, partition="gpu", gpus_per_cell=1, time="24:00:00")   # Slurm job array
    launch_ray(spec, root, gpus_per_cell=1)                    # pip install ray

All three run `depthtools.train.sweep.run_cell` on one `cell_specs` entry, so a cell behaves the same
wherever it runs and a cell that died is resumed by launching the grid again (finished cells are
skipped before anything is submitted). Cells write only into their own folder; `root` and the
prepared data must be on a filesystem every worker sees. On a 2-core CPU two 1-thread workers beat
one 2-thread worker (tiny models scale badly over intra-op threads), hence `workers` x `threads`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import multiprocessing
import os
import re
import shlex
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from depthtools.errors import DepthToolsError
from depthtools.train.loop import held_checkpoint, tidy_finished
from depthtools.train.sweep import cell_specs, load_spec, prepare_grid_data, run_cell, skipped_summary

Log = Callable[[str], None]


def pending_specs(spec: dict[str, Any], root: str | Path, force: bool = False, tidy: bool = False) -> list[dict[str, Any]]:
    """The cell specs still to train (all of them with force); with tidy, finished cells lose leftover
    train state (launchers pass it; a dry run does not, it changes nothing)."""
    todo = []
    for c in cell_specs(spec):
        out_dir = Path(root) / c["grid"] / c["cell"]["name"]
        if force or held_checkpoint(out_dir) is None:
            todo.append(c)
        elif tidy:
            tidy_finished(out_dir)
    return todo


# -- local process pool --------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel send this worker SIGTERM when the launching process dies, however it dies
    (a SIGKILL'ed `grid train` must not leave cells training in orphans). A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _init_worker(threads: int, parent: int | None = None) -> None:
    """Each pool process runs its cells with `threads` torch (and BLAS) threads, and dies with its parent."""
    if parent is not None:
        _die_with_parent(parent)

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


@contextlib.contextmanager
def _terminate_on_exit(pool: concurrent.futures.ProcessPoolExecutor):
    """Stop the pool's workers when the launcher leaves early: an exception, Ctrl-C, or SIGTERM (turned
    into SystemExit while the pool runs, so `kill <pid of grid train>` stops the cells it started
    instead of leaving them to train on). Interrupted cells resume when the grid is launched again."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except BaseException:
        processes = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(10)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def launch_local(grid, root: str | Path = "checkpoints", data_root: str | Path = "data", workers: int = 2,
                 threads: int = 1, force: bool = False, log: Log | None = None) -> list[dict[str, Any]]:
    """Train the grid's unfinished cells in `workers` processes of `threads` threads; one summary per cell.

    A cell that raises is reported as {"name", "error"} and the others go on.
    """
    if workers < 1 or threads < 1:
        raise DepthToolsError(f"--workers and --threads must be >= 1, got {workers} and {threads}")
    spec = load_spec(grid)
    prepare_grid_data(spec, root, data_root, force)
    todo = pending_specs(spec, root, force, tidy=True)
    results: dict[str, dict[str, Any]] = {}
    context = multiprocessing.get_context("spawn")  # no fork of a process that already runs torch threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                                initargs=(threads, os.getpid())) as pool, _terminate_on_exit(pool):
        futures = {pool.submit(run_cell, c, str(root), str(data_root), threads, force): c["cell"]["name"]
                   for c in todo}
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            try:
                results[name] = future.result()
            except Exception as exc:  # noqa: BLE001 - one failed cell must not stop the grid
                results[name] = {"name": name, "error": f"{type(exc).__name__}: {exc}", "skipped": False}
            if log is not None:
                log(_describe(results[name]))
    return _with_skipped(spec, root, results, log)


def _with_skipped(spec: dict[str, Any], root: str | Path, results: dict[str, dict[str, Any]],
                  log: Log | None) -> list[dict[str, Any]]:
    """One summary per cell in spec order: the run's results, and for each cell the launcher left alone
    why (`held_checkpoint`: finished, imported, or damaged and so not retrained without --force), logged."""
    out = []
    for cell in spec["cells"]:
        if cell.name not in results:
            out_dir = Path(root) / spec.get("name", "grid") / cell.name
            held = held_checkpoint(out_dir)
            results[cell.name] = ({"name": cell.name, "skipped": True} if held is None
                                  else skipped_summary(cell.name, out_dir, held))
            if log is not None:
                log(_describe(results[cell.name]))
        out.append(results[cell.name])
    return out


def _describe(summary: dict[str, Any]) -> str:
    if summary.get("error"):
        return f"failed {summary['name']}: {summary['error']}"
    if summary.get("skipped"):
        return f"skip {summary['name']} ({summary.get('why', 'finished')})"
    return f"done {summary['name']}: val loss {summary['val_loss']:.4f} ({summary['elapsed_s']:.0f}s)"


# -- Slurm (submitit) ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SlurmResources:
    """What each cell asks the scheduler for (one node; one task per GPU when gpus_per_cell > 1)."""

    partition: str | None = None
    gpus_per_cell: int = 1
    cpus_per_cell: int = 8
    time: str = "24:00:00"
    mem_gb: int | None = None
    max_parallel: int = 64  # cells running at once (slurm_array_parallelism)

    @property
    def timeout_min(self) -> int:
        return parse_time(self.time)

    def describe(self) -> str:
        parts = [f"partition={self.partition or '(default)'}", f"gpus={self.gpus_per_cell}",
                 f"cpus={self.cpus_per_cell}", f"time={self.time}", f"tasks={max(1, self.gpus_per_cell)}"]
        return " ".join(parts + ([f"mem={self.mem_gb}G"] if self.mem_gb else []))


def parse_time(text: str) -> int:
    """Slurm time ("90", "2:00:00", "1-12:00:00", "1-12") as whole minutes."""
    match = re.fullmatch(r"\s*(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\s*", str(text))
    if not match:
        raise DepthToolsError(f"cannot read time {text!r}; use minutes, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in match.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        minutes = days * 1440 + a * 60 + (b or 0) + (c or 0) / 60
    elif c is not None:  # HH:MM:SS
        minutes = a * 60 + b + c / 60
    elif b is not None:  # MM:SS
        minutes = a + b / 60
    else:  # MM
        minutes = a
    return max(1, int(round(minutes)))


class CellJob:
    """`run_cell` as a submitit job that requeues itself on timeout or preemption (it then resumes)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return run_cell(*args, **kwargs)

    def checkpoint(self, *args: Any, **kwargs: Any):
        from submitit.helpers import DelayedSubmission  # optional dependency

        return DelayedSubmission(self, *args, **kwargs)


def cell_command(grid_path: str | Path | None, spec_cell: dict[str, Any], root, data_root, gpus: int) -> str:
    """The shell command equivalent to one submitted cell (what `--dry-run` prints)."""
    grid = [str(grid_path)] if grid_path else ["--preset", spec_cell["grid"]]
    prefix = f"torchrun --nproc_per_node={gpus} -m cli" if gpus > 1 else "depthtools"
    args = ["grid", "train", *grid, "--cells", spec_cell["cell"]["name"], "--root", str(root),
            "--data-root", str(data_root)]
    return f"{prefix} {shlex.join(args)}"


def dry_run(grid, root, data_root, resources: SlurmResources, grid_path=None,
            force: bool = False) -> list[dict[str, str]]:
    """What would be submitted, one dict per unfinished cell: cell, command, resources, out_dir."""
    return [{"cell": c["cell"]["name"], "command": cell_command(grid_path, c, root, data_root, resources.gpus_per_cell),
             "resources": resources.describe(), "out_dir": str(Path(root) / c["grid"] / c["cell"]["name"])}
            for c in pending_specs(load_spec(grid), root, force)]


def dry_run_lines(grid, root, data_root, resources: SlurmResources, grid_path=None, force: bool = False) -> list[str]:
    """`dry_run` as tab-separated lines: cell, command, resources, -> output folder."""
    return [f"{d['cell']}\t{d['command']}\t{d['resources']}\t-> {d['out_dir']}"
            for d in dry_run(grid, root, data_root, resources, grid_path, force)]


def _executor(folder: Path, resources: SlurmResources, cluster: str | None):
    """A submitit executor for `cluster` ("slurm", "local", or None = auto) with the cell resources."""
    try:
        import submitit  # optional dependency
    except ImportError:
        raise DepthToolsError("the slurm launcher needs submitit: pip install submitit") from None
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
    except RuntimeError as exc:  # e.g. no sbatch on this machine
        raise DepthToolsError(f"cannot use the {cluster} scheduler here: {exc}") from None
    tasks = max(1, resources.gpus_per_cell)
    params = dict(timeout_min=resources.timeout_min, nodes=1, tasks_per_node=tasks,
                  cpus_per_task=max(1, resources.cpus_per_cell // tasks), gpus_per_node=resources.gpus_per_cell,
                  slurm_array_parallelism=resources.max_parallel, name="depthtools-cell")
    if resources.partition:
        params["slurm_partition"] = resources.partition
    if resources.mem_gb:
        params["mem_gb"] = resources.mem_gb
    executor.update_parameters(**params)
    return executor


def submit_cells(grid, root: str | Path = "checkpoints", data_root: str | Path = "data",
                 resources: SlurmResources = SlurmResources(), cluster: str | None = "slurm", force: bool = False,
                 folder: str | Path | None = None) -> list[tuple[str, Any]]:
    """Submit the unfinished cells as one job array; returns [(cell name, submitit job)].

    cluster="local" runs the same jobs as local subprocesses (submitit's LocalExecutor), which is
    how the tests exercise this path without Slurm. Logs go to `<root>/<grid>/_submitit/`.
    """
    spec = load_spec(grid)
    prepare_grid_data(spec, root, data_root, force)
    todo = pending_specs(spec, root, force, tidy=True)
    if not todo:
        return []
    folder = Path(folder or Path(root) / spec.get("name", "grid") / "_submitit")
    executor = _executor(folder, resources, cluster)
    n, distributed = len(todo), resources.gpus_per_cell > 1
    jobs = executor.map_array(CellJob(), todo, [str(Path(root).resolve())] * n, [str(Path(data_root).resolve())] * n,
                              [None] * n, [force] * n, [distributed] * n)
    return [(c["cell"]["name"], job) for c, job in zip(todo, jobs)]


# -- Ray -----------------------------------------------------------------------------------------
def launch_ray(grid, root: str | Path = "checkpoints", data_root: str | Path = "data", gpus_per_cell: int = 1,
               cpus_per_cell: int = 1, threads: int | None = None, address: str | None = None, force: bool = False,
               log: Log | None = None) -> list[dict[str, Any]]:
    """Run the unfinished cells as Ray tasks (one process, up to one GPU each) and wait for them all."""
    try:
        import ray  # optional dependency
    except ImportError:
        raise DepthToolsError("the ray launcher needs Ray, which is not installed: pip install ray") from None
    if gpus_per_cell > 1:
        raise DepthToolsError("the ray launcher runs one process per cell; use --gpus-per-cell 0 or 1, "
                              "or --launcher slurm for multi-GPU cells")
    spec = load_spec(grid)
    prepare_grid_data(spec, root, data_root, force)
    ray.init(address=address, ignore_reinit_error=True)
    task = ray.remote(num_gpus=gpus_per_cell, num_cpus=cpus_per_cell)(run_cell)
    refs = {c["cell"]["name"]: task.remote(c, str(Path(root).resolve()), str(Path(data_root).resolve()), threads, force)
            for c in pending_specs(spec, root, force, tidy=True)}
    results = {}
    for name, ref in refs.items():
        try:
            results[name] = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - report every cell
            results[name] = {"name": name, "error": f"{type(exc).__name__}: {exc}", "skipped": False}
        if log is not None:
            log(_describe(results[name]))
    return _with_skipped(spec, root, results, log)


__all__ = ["CellJob", "SlurmResources", "dry_run", "dry_run_lines", "launch_local", "launch_ray", "parse_time",
           "submit_cells"]
