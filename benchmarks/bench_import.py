"""Start-up cost of the torch-free entry points against the torch-bound one, in fresh interpreters.

`import depthtools.data` (data prepare and its workers) and `import cli.main` (every CLI command before it
runs) used to load torch and TransformerLens through depthtools' and depthtools.analysis' eager imports;
`import depthtools.arch` still does (and must). Each import runs in its own fresh interpreter, `--reps`
times; the table prints the median wall time and its ratio to `depthtools.arch` measured in the same run.

Example (figures in benchmarks/RESULTS.md):
  python benchmarks/bench_import.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("depthtools.arch", "depthtools.data", "cli.main")
CODE = "import sys, {m}; print(int('torch' in sys.modules))"


def time_import(module: str) -> tuple[float, bool]:
    """Wall seconds of a fresh `python -c 'import module'`, and whether torch ended up loaded."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CODE.format(m=module)], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    return time.perf_counter() - t0, out.strip() == "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    time_import("depthtools.arch")  # warm the file cache once
    results = {}
    for _ in range(args.reps):  # interleaved, so a busy moment hits every module alike
        for module in MODULES:
            seconds, torch_loaded = time_import(module)
            results.setdefault(module, ([], torch_loaded))[0].append(seconds)
    base = statistics.median(results["depthtools.arch"][0])
    print(f"{'import':<18} {'median s':>9} {'vs depthtools.arch':>19}  torch loaded")
    for module, (times, torch_loaded) in results.items():
        median = statistics.median(times)
        print(f"{module:<18} {median:>9.2f} {median / base:>18.2f}x  {torch_loaded}")


if __name__ == "__main__":
    main()
