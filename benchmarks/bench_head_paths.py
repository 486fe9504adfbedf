"""Benchmark: one sweep plan's head + metrics on the two head paths, same process, alternated.

On a random-weight SmolLM-135M-shaped Llama (V 49,152; `bench_real_size.build_checkpoint`, 2 layers: only the head
matters) and one batch of 8 × 128 windows (1,016 scored rows), times, --reps times each in turn:

    chunked    headmetrics.row_metrics (CE, KL against the reference, top-1) over vocabulary chunks
    full       the full float32 log-softmax with the sweep's per-plan sums (sweep._Sums.add)
    matmul     the head alone (model.head), the floor of both

and prints the medians and full / chunked. `cost.time_parts` times whichever path the sweep takes
(`headmetrics.chunked_head`); this shows why that matters for the plan.

    PYTHONPATH=$PWD python benchmarks/bench_head_paths.py [--reps 3 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_real_size import build_checkpoint  # noqa: E402

from depthtools.analysis.headmetrics import Head, Reference, row_metrics  # noqa: E402
from depthtools.analysis.sweep import Reference as SweepReference, _Sums, scored_logprobs, scored_rows  # noqa: E402
from depthtools.analysis.tokens import split_inputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build_checkpoint(Path(tmp), 128, layers=2)
    model.eval()
    tokens = torch.randint(0, model.config.vocab_size, (8, 129), generator=torch.Generator().manual_seed(0))
    inputs, targets = split_inputs(tokens)
    targets = targets.flatten()
    times: dict[str, list[float]] = {"chunked": [], "full": [], "matmul": []}
    with torch.no_grad():
        states = model.run_states(inputs)
        logp = scored_logprobs(model.head(states[-1])).roll(1, 0)  # a reference that differs from the plan
        head = Head.of(model)
        chunked_ref, full_ref = Reference.of(logp, head=head), SweepReference.of(logp)
        runs = {
            "chunked": lambda: row_metrics(head, scored_rows(model, states[-1]), targets, chunked_ref),
            "full": lambda: _Sums().add(scored_logprobs(model.head(states[-1])), full_ref, targets, inputs.shape[0]),
            "matmul": lambda: model.head(states[-1]),
        }
        for _ in range(args.reps):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"{targets.numel()} rows x V {model.config.vocab_size}, {args.threads} thread(s), median of {args.reps}:")
    for name, seconds in median.items():
        print(f"  {name:8s} {seconds:.3f} s")
    print(f"full / chunked: {median['full'] / median['chunked']:.2f}x")


if __name__ == "__main__":
    main()
