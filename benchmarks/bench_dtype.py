"""Benchmark (issue 45 item 3): every saved metric in bfloat16 and float16 against float32, at real shapes.

Random-weight Llamas built locally with transformers (nothing downloads), saved with `save_pretrained`,
imported by `import_hf` and loaded by `checkpoint.load(dtype=...)` — the path a user's folder takes, the
low-precision models loaded straight into their dtype:

    smollm   SmolLM-135M's shape: L 30, d 576, 9/3 heads, MLP 1536, V 49,152 (stored float32)
    1b       Llama-3.2-1B's shape: L 16, d 2048, 32/8 heads, MLP 8192, V 128,256 (stored bfloat16)

On one seeded token set per model, each analysis of the suite (`suite.SUITE`, cheap settings: the swap
pairs, prune steps and Jacobian probes capped) runs once per dtype (`suite.run_analysis`, nothing saved);
then for every table and numeric column it prints max |bfloat16 − float32| and max |float16 − float32|
over the rows (the column's largest |float32| value beside them, for scale).

    python benchmarks/bench_dtype.py [--shape smollm|1b|both] [--seqs 2 --seq-len 32] [--probes a,b]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "smollm": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                   rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu"),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5,
               rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu"),
}
SHAPES["tiny"] = dict(SHAPES["smollm"], vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)  # a quick check of the script itself
STORED = {"smollm": torch.float32, "1b": torch.bfloat16, "tiny": torch.float32}
CHEAP = dict(swap_pairs_max=4, max_prune_steps=4, probes=1)
DTYPES = ("float32", "bfloat16", "float16")


def build(folder: Path, shape: str, seq_len: int) -> Path:
    """The random Llama of `shape`, saved by transformers and imported: the checkpoint folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from depthtools.interop.llama import import_hf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPES[shape])).to(STORED[shape]).eval()
    hf.save_pretrained(folder / "hf", safe_serialization=True)
    del hf
    import_hf(folder / "hf", out=folder / "ckpt", max_seq_len=max(seq_len, 128))
    return folder / "ckpt"


def run_all(ckpt: Path, dtype: str, names: list[str], seqs: int, seq_len: int) -> dict[str, pd.DataFrame]:
    """Every table of `names` computed in `dtype` (nothing saved), one shared sweep as `analyze` runs them."""
    from depthtools.analysis import suite
    from depthtools.analysis.sweep import shared_sweeps
    from depthtools.checkpoint import load

    model = load(ckpt, dtype=dtype)
    tokens = torch.randint(0, model.config.vocab_size, (seqs, seq_len + 1), generator=torch.Generator().manual_seed(0))
    tables = {}
    with shared_sweeps():
        for name in names:
            t0 = time.perf_counter()
            result = suite.run_analysis(name, model, tokens, recompute=True, save=False, batch_size=seqs, **CHEAP)
            tables.update(result.tables)
            print(f"  [{dtype} {name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    return tables


SKIP = {"n_layer", "n_tokens", "layer", "layer2", "layer_j", "depth", "n_removed", "seed", "d_model", "rel_depth",
        "rel_depth_j", "token", "seq", "n_pairs_total"}


def _keys(df: pd.DataFrame) -> list[str]:
    """The columns that identify a row: text columns and the integer positions (layer, depth, token, ...)."""
    return [c for c in df.columns if not pd.api.types.is_float_dtype(df[c]) and c not in ("value",)]


def diffs(ref: pd.DataFrame, other: pd.DataFrame) -> dict[str, tuple[float, float, float]]:
    """Per metric — a numeric column, or a long table's `metric` value — (max |other − ref| over the rows
    matched on their key columns, the same for a third table filled in later, max |ref|); NaNs skipped."""
    keys = _keys(ref)
    both = ref.merge(other, on=keys, how="inner", suffixes=("", "_low"))
    out = {}
    groups = both.groupby("metric") if "metric" in both.columns and "value" in both.columns else [(None, both)]
    for metric, rows in groups:
        for column in ([("value")] if metric is not None else [c for c in ref.columns if c not in keys]):
            if column in SKIP or f"{column}_low" not in rows or not pd.api.types.is_numeric_dtype(rows[column]):
                continue
            x, y = rows[column].astype("float64").to_numpy(), rows[f"{column}_low"].astype("float64").to_numpy()
            ok = ~(np.isnan(x) | np.isnan(y))
            if ok.any():
                name = column if metric is None else str(metric)
                out[name] = (float(np.abs(x[ok] - y[ok]).max()), float(np.abs(x[ok]).max()))
    return out


def report(shape: str, runs: dict[str, dict[str, pd.DataFrame]]) -> None:
    print(f"{shape}: max |low − float32| per saved table and metric (|float32| max for scale)")
    print(f"  {'table.metric':<48} {'bfloat16':>10} {'float16':>10} {'|f32| max':>10}")
    for table, ref in runs["float32"].items():
        bf = diffs(ref, runs["bfloat16"].get(table, ref.iloc[0:0]))
        fp = diffs(ref, runs["float16"].get(table, ref.iloc[0:0]))
        for metric, (d_bf, scale) in bf.items():
            d_fp = fp.get(metric, (float("nan"),))[0]
            print(f"  {table + '.' + metric:<48} {d_bf:10.2e} {d_fp:10.2e} {scale:10.3g}")


def main() -> None:
    from depthtools.analysis import suite

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["smollm", "1b", "tiny", "both"], default="both")
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seqs-1b", type=int, default=1, help="sequences for the 1B shape (fewer: time)")
    parser.add_argument("--probes", default=None, help="comma-separated analyses (default: the suite)")
    parser.add_argument("--probes-1b", default="lens_logit,ablate_skip",
                        help="analyses on the 1B shape (default: the cheaper ones)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = ["smollm", "1b"] if args.shape == "both" else [args.shape]
    print(f"{args.threads} thread(s), CPU, load average {os.getloadavg()[0]:.1f}; cheap settings {CHEAP}", flush=True)
    for shape in shapes:
        names = (args.probes or args.probes_1b) if shape == "1b" else (args.probes or ",".join(suite.SUITE))
        seqs = args.seqs_1b if shape == "1b" else args.seqs
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            ckpt = build(Path(tmp), shape, args.seq_len)
            print(f"[{shape}: build + save_pretrained + import: {time.perf_counter() - t0:.1f} s; "
                  f"{seqs}x{args.seq_len} tokens]", flush=True)
            runs = {dtype: run_all(ckpt, dtype, names.split(","), seqs, args.seq_len) for dtype in DTYPES}
        report(shape, runs)


if __name__ == "__main__":
    main()
