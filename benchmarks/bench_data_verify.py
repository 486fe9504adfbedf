"""Time of the data check at a run's start or resume (`check_data_files`), with and without the digest cache.

A single-file dataset of `--mb` MB of random uint16 tokens (a `meta.json` holding its sha256) is written to a
temporary folder; then, in shuffled rounds, the same run measures:

    full      changed_data_files(cached=False): every byte read and hashed (the check before the cache;
              still what shards.verify does)
    cold      the cached check with no .verified.json yet: one full read, plus writing the cache
    warm      the cached check with the cache written: one stat per file, one small JSON read

The file stays in the page cache (the script just wrote it), so `full` is the best case of a read: on a dataset
larger than memory, or on a network filesystem, a full read costs more and the ratio grows.

Usage: python benchmarks/bench_data_verify.py [--mb 200] [--reps 5] [--dir PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import depthtools.data.digest_cache as dc
from depthtools.data.prepare import changed_data_files, check_data_files


def make_dataset(folder: Path, mb: int) -> dict:
    """`folder/train.bin` of `mb` MB of random tokens and the meta dict that records its sha256."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 50000, size=mb * 2**19, dtype=np.uint16).tobytes()
    (folder / "train.bin").write_bytes(data)
    return {"splits": {"train": {"file": "train.bin", "tokens": len(data) // 2,
                                 "sha256": hashlib.sha256(data).hexdigest()}}}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the dataset is written (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        meta = make_dataset(folder, args.mb)
        time.sleep(dc.RACY_S + 0.1)  # settled: a file touched just before its hash is not cached
        cache = folder / dc.CACHE_FILE

        def full():
            assert changed_data_files(folder, meta) == []

        def cold():
            cache.unlink(missing_ok=True)
            check_data_files(folder, meta)
            assert cache.is_file()

        def warm():
            check_data_files(folder, meta)

        check_data_files(folder, meta)  # warm-up (page cache, imports)
        times: dict[str, list[float]] = {"full": [], "cold": [], "warm": []}
        ratios = []
        for _ in range(args.reps):
            order = list(times)
            random.shuffle(order)
            this = {}
            for name in order:
                if name == "warm":
                    check_data_files(folder, meta)  # the cache exists whatever ran before
                this[name] = timed({"full": full, "cold": cold, "warm": warm}[name])
                times[name].append(this[name])
            ratios.append(this["full"] / this["warm"])
    print(f"data check at run start, one {args.mb} MB file, {args.reps} rounds, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'check':<6} {'median ms':>10} {'min ms':>10}")
    for name, values in times.items():
        print(f"{name:<6} {1e3 * statistics.median(values):>10.2f} {1e3 * min(values):>10.2f}")
    print(f"full / warm (median of same-round ratios): {statistics.median(ratios):.0f}x")


if __name__ == "__main__":
    main()
