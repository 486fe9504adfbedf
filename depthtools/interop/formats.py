"""What a path to import is, and the importer for it: `depthtools import PATH` (and its alias `import-hf`).

    detect_format("runs/hc_400m")          -> "olmo-core-run"   (a folder of stepN/ folders)
    detect_format("runs/hc_400m/step7600") -> "olmo-core-step"  (config.json + model_and_optim/)
    detect_format("TinyLlama")             -> "huggingface"     (config.json + *.safetensors)
    detect_format("tiny-q8_0.gguf")        -> "gguf"

The choice lives here, not in the CLI, so notebooks import the same way. Detection reads only folder
listings and file names: no file content, so it is cheap and cannot be fooled into reading a large file.
Options that only one kind of source takes (`step`, `tokenizer`) are refused for the others in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from depthtools.errors import DepthToolsError
from depthtools.interop.gguf_import import import_gguf
from depthtools.interop.llama import import_hf
from depthtools.interop.olmo_import import import_olmo_core, import_sweep, is_run_dir, is_step_dir

FORMATS = ("olmo-core-run", "olmo-core-step", "huggingface", "gguf")
WHAT = ("an OLMo-core run folder (stepN/ folders) or step folder (config.json + model_and_optim/), a Hugging Face "
        "folder (config.json + *.safetensors) or a .gguf file")


def detect_format(path: str | Path) -> str:
    """One of FORMATS for `path`, or a one-line DepthToolsError saying what PATH may be."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return "gguf"  # its importer refuses a missing or unreadable file in its own words
    if not path.exists():
        raise DepthToolsError(f"{path} does not exist (not a directory or a .gguf file); give {WHAT}")
    if path.is_file():
        raise DepthToolsError(f"{path} is a file but not a .gguf file (not a directory); give {WHAT}")
    if is_step_dir(path):
        return "olmo-core-step"
    if is_run_dir(path):
        return "olmo-core-run"
    if (path / "config.json").is_file():
        return "huggingface"  # its importer names what is missing or unsupported
    raise DepthToolsError(f"{path} is not a Hugging Face model directory (no config.json), an OLMo-core run folder "
                          "(no stepN/ folders) or an OLMo-core step folder (no model_and_optim/)")


def import_path(path: str | Path, name: str | None = None, out: str | Path | None = None, force: bool = False,
                step: int | None = None, tokenizer: str | Path | None = None,
                max_seq_len: int | None = None, stream: bool | None = None) -> dict[str, Any]:
    """Import whatever `path` is (`detect_format`) as a depthtools checkpoint; returns the importer's summary
    with "format" set. `step` and `tokenizer` apply to OLMo-core checkpoints only; `stream` (True: sharded, in
    the source's dtype; False: in memory; None: automatic) to Hugging Face folders only."""
    kind = detect_format(path)
    if stream and kind != "huggingface":
        raise DepthToolsError(f"--stream applies to Hugging Face folders only; {path} is a {kind} checkpoint "
                              "(imported in memory)")
    if kind.startswith("olmo-core"):
        summary = import_olmo_core(path, name=name, out=out, force=force, step=step, tokenizer=tokenizer,
                                   max_seq_len=max_seq_len)
    else:
        for option, value in (("--step", step), ("--tokenizer", tokenizer)):
            if value is not None:
                raise DepthToolsError(f"{option} applies to OLMo-core checkpoints only; {path} is a {kind} checkpoint "
                                      "(its tokenizer files are carried from it)")
        if kind == "gguf":
            summary = import_gguf(path, name=name, out=out, force=force, max_seq_len=max_seq_len)
        else:
            summary = import_hf(path, name=name, out=out, force=force, max_seq_len=max_seq_len, stream=stream)
    return {**summary, "format": kind}


def import_paths(paths: list[str | Path], name: str | None = None, out: str | Path | None = None,
                 force: bool = False, step: int | None = None, tokenizer: str | Path | None = None,
                 max_seq_len: int | None = None, grid: str | None = None,
                 stream: bool | None = None) -> dict[str, Any]:
    """`depthtools import PATH...`: one PATH is `import_path`; several, or `grid`, are the OLMo-core runs of one
    sweep imported as the cells of one grid (`olmo_import.import_sweep`; `out` is then the grid folder)."""
    if len(paths) == 1 and grid is None:
        return import_path(paths[0], name=name, out=out, force=force, step=step, tokenizer=tokenizer,
                           max_seq_len=max_seq_len, stream=stream)
    if stream:
        raise DepthToolsError("--stream applies to one Hugging Face folder; a grid of OLMo-core runs is imported in "
                              "memory")
    if not paths:
        raise DepthToolsError("give at least one PATH to import")
    if name is not None:
        raise DepthToolsError("--name names one checkpoint; several runs are imported as a grid: give --grid NAME")
    for path in paths:
        kind = detect_format(path)
        if not kind.startswith("olmo-core"):
            raise DepthToolsError(f"{path} is a {kind} checkpoint; only OLMo-core runs are imported as a grid "
                                  "(import it on its own with --name)")
    summary = import_sweep(paths, grid=grid, out=out, force=force, step=step, tokenizer=tokenizer,
                           max_seq_len=max_seq_len)
    return {**summary, "format": "olmo-core-sweep"}


__all__ = ["detect_format", "import_path", "import_paths", "FORMATS"]
