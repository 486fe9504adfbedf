"""Tokenization throughput and memory of `data prepare --input` (issue 21), against `tokenizers` alone.

Inputs are jsonl files generated in a temporary folder from real text (the installed sympy's .py
sources, cut into 1-8 KB documents, repeated with shifted cuts to reach the sizes asked for), and a
byte-level BPE (8,192 tokens) trained on 4 MB of it, saved as a plain tokenizer.json.

    baseline     one process: read the jsonl, json.loads, `Tokenizer.encode_batch` on ~1 MB batches
                 (tokenizers' own thread pool on every core), ids -> uint16, append to one file
    baseline-1   the same with TOKENIZERS_PARALLELISM=false (one thread)
    baseline-f   the same with `encode_batch_fast` (no character offsets), what the workers call
    prepare w=N  `prepare_inputs(..., workers=N)` end to end: split, shards, manifest, checksums

Throughput is input bytes / wall seconds, each command in a fresh process, in alternating rounds
(the median is printed). A control measures the machine's parallel capacity before and after: the
throughput of N processes of a pure Python loop over one (N on idle cores; a shared machine gives
less, and no tokenizer can scale beyond it). Memory: peak RSS of the preparing process and of its largest worker
(getrusage of the waited-for children) for a small and a large input.

    python benchmarks/bench_tokenize.py                       # 32 MB throughput, RSS at 10 MB and 200 MB
    python benchmarks/bench_tokenize.py --throughput-mb 16 --large-mb 100 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FILE_MB = 16  # size of each generated jsonl file


def source_text() -> str:
    import sympy

    files = sorted(Path(sympy.__file__).parent.rglob("*.py"))
    return "".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def make_inputs(folder: Path, megabytes: float, text: str, seed: int = 0) -> list[Path]:
    """jsonl files of about `megabytes` MB: documents of 1-8 KB cut from `text` at shifting offsets."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    target, written, files, pos = int(megabytes * 1e6), 0, [], 0
    out = None
    while written < target:
        if out is None or out.tell() >= FILE_MB * 1e6:
            if out is not None:
                out.close()
            files.append(folder / f"part-{len(files):05d}.jsonl")
            out = open(files[-1], "w", encoding="utf-8")
        size = int(rng.integers(1000, 8000))
        if pos + size > len(text):
            pos = int(rng.integers(0, 997))  # the next pass cuts the text elsewhere
        line = json.dumps({"text": text[pos:pos + size], "id": written}) + "\n"
        out.write(line)
        written += len(line.encode("utf-8"))
        pos += size
    out.close()
    return files


BASELINE = r"""
import json, resource, sys, time, numpy as np
from pathlib import Path
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1]); fast = sys.argv[2] == "fast"; out = open(sys.argv[3], "wb")
encode = tok.encode_batch_fast if fast else tok.encode_batch
t0 = time.perf_counter(); n = 0
for path in sys.argv[4:]:
    batch, chars = [], 0
    with open(path, "rb") as f:
        for line in f:
            n += len(line)
            text = json.loads(line)["text"]; batch.append(text); chars += len(text)
            if chars >= 1 << 20:
                for e in encode(batch, add_special_tokens=False): out.write(np.asarray(e.ids, dtype=np.uint16).tobytes())
                batch, chars = [], 0
    for e in encode(batch, add_special_tokens=False): out.write(np.asarray(e.ids, dtype=np.uint16).tobytes())
out.close()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime}))
"""

PREPARE = r"""
import json, resource, shutil, sys, time
from depthtools.data import prepare_inputs
tok, out, workers, unit_mb = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
files = sys.argv[5:]
shutil.rmtree(out, ignore_errors=True)
t0 = time.perf_counter()
prepare_inputs(files, out_dir=out, name="bench", tokenizer=tok, workers=workers, val_fraction=0.01,
               unit_bytes=int(unit_mb * 2**20))
seconds = time.perf_counter() - t0
import os
n = sum(os.path.getsize(f) for f in files)
me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"bytes": n, "seconds": seconds, "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _spin(_=None) -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(10_000_000):
        x += i
    return time.perf_counter() - t0


def capacity(workers: int) -> float:
    """What `workers` processes of pure Python arithmetic get done together vs one alone (the machine's
    parallel capacity right now: about `workers` on idle cores, less when the cores are shared)."""
    from multiprocessing import get_context

    one = min(_spin() for _ in range(2))
    with get_context("fork").Pool(workers) as pool:
        together = max(pool.map(_spin, range(workers)))
    return workers * one / together


def run(code: str, args: list[str], env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    if proc.returncode:
        raise SystemExit(f"benchmark command failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--throughput-mb", type=float, default=32)
    parser.add_argument("--small-mb", type=float, default=10)
    parser.add_argument("--large-mb", type=float, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--unit-mb", type=float, default=4, help="work unit size of prepare_inputs")
    args = parser.parse_args()

    from depthtools.data.tokenizer import BPETokenizer

    with tempfile.TemporaryDirectory(prefix="bench_tokenize-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        text = source_text()
        tok = BPETokenizer.train([text[i:i + 4000] for i in range(0, 4_000_000, 4000)], vocab_size=8192)
        tok_path = tmp / "tok" / "tokenizer.json"
        tok_path.parent.mkdir()
        tok.save(tok_path.parent)
        through = [str(p) for p in make_inputs(tmp / "through", args.throughput_mb, text)]
        print(f"cpus={os.cpu_count()} text source: sympy .py files ({len(text) / 1e6:.1f} MB); tokenizer bpe "
              f"{tok.vocab_size} tokens; setup {time.perf_counter() - t0:.1f}s", flush=True)

        results: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        caps = [capacity(args.workers)]
        print(f"parallel capacity of {args.workers} processes (pure Python loop): {caps[0]:.2f}x one", flush=True)
        for r in range(args.rounds):
            order = [("baseline encode_batch", BASELINE, [str(tok_path), "plain", str(tmp / "base.bin"), *through]),
                     ("baseline encode_batch 1 thread", BASELINE, [str(tok_path), "plain", str(tmp / "base.bin"), *through]),
                     ("baseline encode_batch_fast", BASELINE, [str(tok_path), "fast", str(tmp / "base.bin"), *through]),
                     ("prepare --workers 1", PREPARE, [str(tok_path), str(tmp / "out"), "1", str(args.unit_mb), *through]),
                     (f"prepare --workers {args.workers}", PREPARE, [str(tok_path), str(tmp / "out"), str(args.workers), str(args.unit_mb), *through])]
            if r % 2:
                order.reverse()
            for label, code, argv in order:
                res = run(code, argv, {"TOKENIZERS_PARALLELISM": "false"} if "1 thread" in label else None)
                mbs = res["bytes"] / res["seconds"] / 1e6
                results.setdefault(label, []).append(mbs)
                cpu.setdefault(label, []).append(res["bytes"] / res["cpu_s"] / 1e6)
                print(f"round {r}: {label:31s} {res['bytes'] / 1e6:7.1f} MB in {res['seconds']:6.1f}s = {mbs:5.2f} MB/s"
                      f" ({cpu[label][-1]:.2f} MB per CPU-second, imports included)", flush=True)
        caps.append(capacity(args.workers))
        print(f"parallel capacity of {args.workers} processes after the rounds: {caps[1]:.2f}x one", flush=True)
        base = statistics.median(results["baseline encode_batch"])
        one = statistics.median(results["baseline encode_batch 1 thread"])
        print(f"\nthroughput on {args.throughput_mb:g} MB (median of {args.rounds} round(s)):")
        for label, values in results.items():
            m = statistics.median(values)
            print(f"  {label:31s} {m:5.2f} MB/s  {m / base:4.2f}x baseline  {m / one:4.2f}x 1 thread  "
                  f"{statistics.median(cpu[label]):5.2f} MB/CPU-s")

        print("\npeak RSS (preparing process / largest worker):")
        for mb in (args.small_mb, args.large_mb):
            files = [str(p) for p in make_inputs(tmp / f"rss{mb:g}", mb, text, seed=1)]
            res = run(PREPARE, [str(tok_path), str(tmp / f"out{mb:g}"), str(args.workers), str(args.unit_mb), *files])
            shutil.rmtree(tmp / f"out{mb:g}", ignore_errors=True)
            print(f"  {res['bytes'] / 1e6:7.1f} MB input: {res['rss_mb']:6.0f} MB / {res['worker_rss_mb']:6.0f} MB "
                  f"({res['bytes'] / res['seconds'] / 1e6:.2f} MB/s, {res['seconds']:.0f}s)", flush=True)
            for p in files:
                os.unlink(p)


if __name__ == "__main__":
    main()
