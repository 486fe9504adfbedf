"""`--protocol depthbench` on the single probe commands: each command's DepthBench counterpart.

A probe command with `--protocol depthbench` computes the DepthBench metric(s) that correspond to what it
measures, exactly as `depthtools depthbench --metrics ...` does (depthtools.analysis.depthbench: DepthBench's
skip rules, states, windows of 512 tokens and every position), and prints or saves that table
(`analysis/depthbench.parquet`). A command or mode whose quantity DepthBench does not define is a one-line
error naming both. The mapping (docs/depthbench.md, "Every metric"):

    causal                    causal_score (+ mean/max/top-10)       compute_causal_score.py
    ablate --mode skip        layer_pruning (single-block ΔCE)        compute_layer_pruning.py
    ablate --mode swap        permutation_score (all pairs, + means)  compute_permutation_score.py
    ablate --mode linear      usefulness_score (ratio, 1.1 rule)      compute_usefulness_score.py
    similarity                angular_distance, token_collapse        compute_angular_distance.py, compute_token_collapse.py
    lens                      logit_lens (CE, KL, top-5)              compute_logit_lens.py
    contrib                   jacobian (‖mean J − I‖_F/√d)            compute_jacobian.py
    ablate --mode prune/mean, routing, lens --tuned, contrib --no-jacobian: none (error)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pandas as pd
import typer
from rich.markup import escape

from cli.common import check_device, console, fmt, print_json, table, write_out
from depthtools.analysis.suite import check_sizes, checkpoint_dirs
from depthtools.errors import DepthToolsError

PROTOCOLS = ("depthtools", "depthbench")
PROTOCOL_OPT = typer.Option("depthtools", "--protocol", help="depthtools (this command's metrics) or depthbench "
                                                              "(DepthBench's metric for it, as `depthtools depthbench`).")

# probe (command, ablate mode) -> the DepthBench metrics it corresponds to
DEPTHBENCH_METRICS: dict[tuple[str, Optional[str]], tuple[str, ...]] = {
    ("causal", None): ("causal_score",),
    ("ablate", "skip"): ("layer_pruning",),
    ("ablate", "swap"): ("permutation_score",),
    ("ablate", "linear"): ("usefulness_score",),
    ("similarity", None): ("angular_distance", "token_collapse"),
    ("lens", None): ("logit_lens",),
    ("contrib", None): ("jacobian",),
}
# ... and why a probe has none (the one-line error names both)
NO_DEPTHBENCH: dict[tuple[str, Optional[str]], str] = {
    ("ablate", "prune"): "DepthBench prunes one block at a time only (compute_layer_pruning.py = --mode skip)",
    ("ablate", "mean"): "DepthBench has no mean-ablation script",
    ("routing", None): "DepthBench has no depth-routing statistics script",
    ("lens", "tuned"): "DepthBench's compute_logit_lens.py has no tuned lens",
    ("contrib", "no-jacobian"): "contrib's relative contributions have no DepthBench script; its counterpart is "
                                "the Jacobian (compute_jacobian.py)",
}


def check_protocol(protocol: str) -> bool:
    """True for "depthbench", False for "depthtools"; a one-line error otherwise."""
    if protocol not in PROTOCOLS:
        raise DepthToolsError(f"unknown --protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")
    return protocol == "depthbench"


def probe_metrics(command: str, mode: Optional[str] = None) -> tuple[str, ...]:
    """The DepthBench metrics of `command` (`mode`: the ablate mode, or a variant such as "tuned")."""
    key = (command, mode)
    if key in NO_DEPTHBENCH:
        label = f"{command} --mode {mode}" if command == "ablate" else f"{command} --{mode}" if mode else command
        raise DepthToolsError(f"--protocol depthbench: {label} has no DepthBench metric: {NO_DEPTHBENCH[key]}")
    return DEPTHBENCH_METRICS[key]


def emit_depthbench(frames: list[pd.DataFrame], as_json: bool, out: Optional[Path]) -> None:
    """Print DepthBench tables: --json {"table", "notes"}; else per checkpoint its scalar and per-layer rows,
    a count of its pairwise rows, and its notes."""
    df = pd.concat(frames, ignore_index=True)
    write_out(df, out)
    if as_json:
        print_json({"table": json.loads(df.to_json(orient="records")),
                    "notes": [str(n) for f in frames for n in f.attrs.get("notes", [])]})
        return
    for frame in frames:  # scalars and per-layer rows; pairwise ones (layer_j set) only in --json / --out
        shown, pairs = frame[frame["layer_j"].isna()], frame[frame["layer_j"].notna()]
        rows = [[m, "" if pd.isna(layer) else str(int(layer)), fmt(v)]
                for m, layer, v in zip(shown["metric"], shown["layer"], shown["value"])]
        console.print(table(f"DepthBench metrics — {frame['model'].iloc[0]}", ["metric", "layer", "value"], rows))
        if len(pairs):
            names = ", ".join(dict.fromkeys(pairs["metric"]))
            console.print(f"{len(pairs)} pairwise rows ({names}): see --json or --out", markup=False, highlight=False)
        for note in frame.attrs.get("notes", []):
            console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)

def run_probe(command: str, mode: Optional[str], ckpt, grid, data, n_tokens: int, seq_len: Optional[int], split: str,
              seed: int, batch_size: int, device: str, as_json: bool, out: Optional[Path], save: bool) -> None:
    """`command --protocol depthbench`: its DepthBench metrics per checkpoint (depthbench_checkpoint), printed."""
    from depthtools.analysis.depthbench import depthbench_checkpoint  # lazy: keeps the CLI torch-free

    metrics = list(probe_metrics(command, mode))
    check_sizes(n_tokens, seq_len, batch_size)
    check_device(device)
    frames = [depthbench_checkpoint(d, data, n_tokens, seq_len, split, seed, metrics, batch_size, device, save)
              for d in checkpoint_dirs(ckpt, grid)]
    emit_depthbench(frames, as_json, out)
