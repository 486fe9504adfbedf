"""Same-run check (issue 47): every table the default suite saves, old code against new, on the same models and tokens.

The old code is a read-only checkout of main (default /work/main, `--old`); the new code is this
repository. Each side runs in its own subprocess (PYTHONPATH = that checkout) on its own copy of the same
checkpoints, calling `suite.run_analysis` for every analysis of `suite.SUITE` with recompute=True on the same
seeded token windows, so each saves its tables under <copy>/analysis/ as `analyze` does. Then, per saved
table, the rows are matched in order and the script prints the largest absolute difference over every
numeric column (NaN = NaN counts as equal) and whether the text columns agree.

The pruning table is compared curve by curve: Gromov's rows against the new default run, and the old greedy
rows against a third run of the new code with `prune="greedy"` (the curve that became opt-in). The
single-skip-order rows are compared where the old code has them (main after issue 47's default change), else
listed as new.

Models: tiny checkpoints built here (nothing downloads): a Pre-LN and an HC (4 streams) DepthModel, and a
random-weight Llama imported through `import_hf` (the path a pretrained model takes).

    python benchmarks/suite_same_run.py [--old /work/main] [--layers 6] [--n-tokens 256] [--seq-len 32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DRIVER = r"""
import json, sys
import torch
from depthtools.analysis import suite
from depthtools.checkpoint import load

ckpt, names, n_seqs, seq_len, options = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]), \
    json.loads(sys.argv[5])
torch.set_num_threads(1)
model = load(ckpt)
tokens = torch.randint(0, model.config.vocab_size, (n_seqs, seq_len + 1), generator=torch.Generator().manual_seed(0))
try:  # the new code runs one model's analyses as analyze_grid does, sharing sweeps; the old code has no such block
    from depthtools.analysis.sweep import shared_sweeps
except ImportError:
    from contextlib import nullcontext as shared_sweeps
with shared_sweeps():
    for name in names:
        suite.run_analysis(name, model, tokens, recompute=True, **options)
"""


def build_checkpoints(folder: Path, layers: int, context: int) -> list[Path]:
    """Tiny Pre-LN and HC DepthModels and an imported random Llama, saved as depthtools checkpoints."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from depthtools import checkpoint as ck
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig
    from depthtools.interop.llama import import_hf

    out = []
    for arch in ("preln", "hc"):
        model = DepthModel(ModelConfig(arch=arch, vocab_size=256, d_model=32, n_layer=layers, n_heads=4,
                                       max_seq_len=context), seed=0)
        with torch.no_grad():  # move every parameter off its init (zero-init gates would hide differences)
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        ck.save(model, folder / f"{arch}_L{layers}")
        out.append(folder / f"{arch}_L{layers}")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                                      tie_word_embeddings=True)).eval()
    hf.save_pretrained(folder / "hf", safe_serialization=True)
    import_hf(folder / "hf", out=folder / f"llama_L{layers}", max_seq_len=context)
    out.append(folder / f"llama_L{layers}")
    return out


def run_side(code: Path, ckpt: Path, names: list[str], n_seqs: int, seq_len: int, options: dict) -> float:
    """Run the suite's analyses with the code at `code` on checkpoint `ckpt`; seconds taken."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", DRIVER, str(ckpt), ",".join(names), str(n_seqs), str(seq_len),
                             json.dumps(options)], env=env, cwd=str(code), capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{code} failed on {ckpt.name}:\n{result.stderr[-3000:]}")
    return time.perf_counter() - t0


WORST_SHOWN = 1e-6  # a numeric column differing by more is named with its difference


def max_abs_diff(old: pd.DataFrame, new: pd.DataFrame) -> tuple[float, list[str]]:
    """(largest |old − new| over the numeric columns both share, text columns that differ and numeric columns
    that differ by more than WORST_SHOWN); inf when the row counts differ or NaN meets a number."""
    if len(old) != len(new):
        return math.inf, [f"{len(old)} vs {len(new)} rows"]
    worst, text = 0.0, []
    for column in old.columns:
        if column not in new.columns:
            text.append(f"{column} missing")
            continue
        a, b = old[column].reset_index(drop=True), new[column].reset_index(drop=True)
        if pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b) and not pd.api.types.is_bool_dtype(a):
            x, y = a.astype("float64").to_numpy(), b.astype("float64").to_numpy()
            both_nan = np.isnan(x) & np.isnan(y)
            diff = np.where(both_nan, 0.0, np.abs(x - y))
            column_worst = float(np.nan_to_num(diff, nan=math.inf).max(initial=0.0))
            if column_worst > WORST_SHOWN:
                text.append(f"{column} {column_worst:.1e}")
            worst = max(worst, column_worst)
        elif not a.astype(str).equals(b.astype(str)):
            text.append(column)
    return worst, text


def compare(old_dir: Path, new_dir: Path, greedy_dir: Path) -> list[tuple[str, float, list[str]]]:
    """Per saved table of the old run: (table, max abs difference, differing text columns)."""
    rows = []
    for path in sorted((old_dir / "analysis").glob("*.parquet")):
        old = pd.read_parquet(path)
        new = pd.read_parquet(new_dir / "analysis" / path.name) if (new_dir / "analysis" / path.name).exists() else None
        if new is None:
            rows.append((path.stem, math.inf, ["missing in the new run"]))
            continue
        if path.stem == "ablate_prune" and "method" in old:
            greedy = pd.read_parquet(greedy_dir / "analysis" / path.name)
            for method, other in (("gromov", new), ("skip_order", new), ("greedy", greedy)):
                if not (old["method"] == method).any():  # an old run whose default has no such curve
                    continue
                rows.append((f"ablate_prune[{method}]", *max_abs_diff(
                    old[old["method"] == method], other[other["method"] == method].drop(columns=["prune"], errors="ignore"))))
            continue
        rows.append((path.stem, *max_abs_diff(old, new)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, default=Path("/work/main"), help="checkout of the old code (read only)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--n-tokens", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    from depthtools.analysis import suite

    names = list(suite.SUITE)
    n_seqs = math.ceil(args.n_tokens / args.seq_len)
    options = {"batch_size": args.batch}
    worst_all = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for ckpt in build_checkpoints(tmp / "built", args.layers, max(args.seq_len, 32)):
            sides = {side: tmp / side / ckpt.name for side in ("old", "new", "greedy")}
            for copy in sides.values():
                shutil.copytree(ckpt, copy)
            t_old = run_side(args.old, sides["old"], names, n_seqs, args.seq_len, options)
            t_new = run_side(ROOT, sides["new"], names, n_seqs, args.seq_len, options)
            run_side(ROOT, sides["greedy"], ["ablate_prune"], n_seqs, args.seq_len, {**options, "prune": "greedy"})
            print(f"{ckpt.name}: {n_seqs}x{args.seq_len} tokens, batch {args.batch}; suite {t_old:.1f} s old "
                  f"({args.old}), {t_new:.1f} s new ({ROOT})")
            for table, worst, text in compare(sides["old"], sides["new"], sides["greedy"]):
                worst_all = max(worst_all, worst)
                flag = "" if worst <= 1e-6 and not text else "   <-- DIFFERS"
                print(f"  {table:<28} max |old - new| = {worst:.3g}{'; text differs: ' + ', '.join(text) if text else ''}"
                      f"{flag}")
            new_only = pd.read_parquet(sides["new"] / "analysis" / "ablate_prune.parquet")
            old_prune = pd.read_parquet(sides["old"] / "analysis" / "ablate_prune.parquet")
            if "method" not in old_prune or not (old_prune["method"] == "skip_order").any():
                print(f"  ablate_prune[skip_order]     new default curve, "
                      f"{int((new_only['method'] == 'skip_order').sum())} rows (no old counterpart)")
    print(f"largest difference over every saved table: {worst_all:.3g} (bound 1e-6: "
          f"{'OK' if worst_all <= 1e-6 else 'EXCEEDED'})")


if __name__ == "__main__":
    main()
