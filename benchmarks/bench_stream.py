"""Streaming weights (issue 45 item 3): peak memory of every probe on a streamed model, and streamed vs in-memory time.

(a) A random-weight Llama-shaped model (default: TinyLlama-1.1B's shape, L22 d2048 ff5632 V32000, GQA 32/4 heads;
    Llama-3.2-3B's: --layers 28 --d-model 3072 --d-ff 8192 --vocab 128256), written as sharded bf16 safetensors
    tensor by tensor (never the whole model in float32), is probed streamed with budget 0 (every block read at every
    use): each probe of `analyze` (the SUITE) in its own child process, which prints its peak RSS (VmHWM:
    getrusage's maxrss is inherited from the parent across fork and exec) and wall time; the peak is compared with
    the model's float32 size. Target: <= 0.35 for every probe. A "load" row is a child that only loads the model
    (the fixed part of every peak).
(b) A model that fits (SmolLM-135M's shape: L30 d576 V49152, or --small-layers), float32: the logit lens and the skip
    sweep, in memory and streamed, same run. Target: streamed / in-memory <= 1.3.

    python benchmarks/bench_stream.py [--layers 22] [--d-model 2048] [--small-layers 30] [--tmp /tmp/bench_stream]
        [--threads 1]   (every child on one torch thread: on a shared 2-core machine the ratios of (b) swing
                         0.2-4.4 with two threads at load 3-6, 0.65-1.39 with one)

Writes its models under --tmp and deletes them at the end. Each probe runs with its cheapest settings (CHEAP: one
permutation pair, one prune step, one Jacobian probe, one causal cut) on --big-tokens (default 2 sequences of 16
model inputs) in (a) and 2 sequences of 32 in (b) (the tuned lens is left out of (a): it trains on a prepared
dataset's train split, which a random model has none of; tests/test_stream.py checks it streamed against in-memory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from depthtools import checkpoint as ck  # noqa: E402
from depthtools.analysis.suite import ANALYSES, SUITE, run_analysis  # noqa: E402
from depthtools.arch import DepthModel  # noqa: E402
from depthtools.config import ModelConfig  # noqa: E402
from depthtools.fsutil import atomic_write_json  # noqa: E402

CHEAP = dict(batch_size=2, cka_batch=64, jacobian=True, probes=1, lens_steps=1, lens_tokens=64, max_prune_steps=1,
             swap_pairs_max=1, cuts=None)
PROBES = [name for name in ANALYSES if name != "lens_tuned"]
LOAD_ONLY = "load"  # a child that loads the model and runs no probe


def random_checkpoint(directory: Path, cfg: ModelConfig, dtype: torch.dtype, sharded: bool, seed: int = 0) -> int:
    """A checkpoint of random weights (std 0.02, norms 1) written tensor by tensor; returns its float32 bytes."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in ck.model_state(DepthModel(cfg)).items()}
    gen = torch.Generator().manual_seed(seed)

    def tensors():
        for name, shape in shapes.items():
            if len(shape) == 1:
                yield name, torch.ones(shape, dtype=dtype)
            else:
                yield name, (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(dtype)

    directory.mkdir(parents=True, exist_ok=True)
    if sharded:
        ck.write_sharded(directory, tensors(), shard_bytes=1 << 30)
    else:
        ck.atomic_save_tensors(directory / ck.WEIGHTS, dict(tensors()))
    atomic_write_json(directory / ck.CONFIG, {"model": cfg.to_dict(), "params": {}, "depthtools_version": "bench"})
    return sum(4 * torch.Size(s).numel() for s in shapes.values())


def peak_rss() -> int:
    """This process' peak resident memory in bytes: VmHWM of /proc/self/status (the high-water mark of this
    process' own address space), not getrusage's maxrss, which Linux keeps across fork and exec: a child would
    report its parent's peak (the writer of the model) when that is larger. getrusage off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(directory: str, probes: list[str], stream: bool, budget: int | None, repeats: int = 1,
          shape: tuple[int, int] = (2, 33)) -> None:
    """Run `probes` on the checkpoint (streamed or not), `repeats` times in turn, on `shape` random tokens (sequences,
    model inputs + 1); print JSON: seconds per probe and pass, and the peak RSS. LOAD_ONLY runs nothing."""
    torch.manual_seed(0)
    if os.environ.get("BENCH_STREAM_THREADS"):  # --threads: fewer threads suffer less from a shared machine's load
        torch.set_num_threads(int(os.environ["BENCH_STREAM_THREADS"]))
    model = ck.load(directory, stream=stream, budget=budget)
    tokens = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    probes = [name for name in probes if name != LOAD_ONLY]
    seconds: dict[str, list[float]] = {name: [] for name in probes}
    cpu: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(repeats):
        for name in probes:
            start, start_cpu = time.perf_counter(), time.process_time()
            run_analysis(name, model, tokens, save=False, recompute=True, **CHEAP)
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            peak = peak_rss()
            print(f"      {name}: {seconds[name][-1]:.1f} s, peak RSS so far {peak / 1e9:.2f} GB", file=sys.stderr,
                  flush=True)
    peak = peak_rss()
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_rss": peak, "reads": getattr(model.stream, "reads", 0)}))


def run_child(directory: Path, probes: list[str], stream: bool, budget: int | None = None, repeats: int = 1,
              shape: tuple[int, int] = (2, 33), timeout: float | None = None) -> dict | None:
    """A child's JSON (`child`), or None when it ran past `timeout` seconds (it is killed)."""
    args = [sys.executable, __file__, "--child", str(directory), "--probes", ",".join(probes), "--repeats", str(repeats),
            "--tokens", f"{shape[0]}x{shape[1]}"]
    args += ["--stream"] if stream else []
    args += ["--budget", str(budget)] if budget is not None else []
    try:
        out = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True, timeout=timeout,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def big_model(tmp: Path, args: argparse.Namespace) -> None:
    """(a): the model written as sharded bf16, then each probe streamed (budget 0) in a child of its own."""
    d = args.d_model
    heads, kv = (d // 128, 8) if d >= 3072 else (d // 64, max(1, d // 512))  # Llama-3.2-3B / TinyLlama
    big = ModelConfig(arch="preln", vocab_size=args.vocab, d_model=d, n_layer=args.layers, n_heads=heads,
                      n_kv_heads=kv, d_ff=args.d_ff or int(2.75 * d), max_seq_len=64)
    start = time.perf_counter()
    f32 = random_checkpoint(tmp / "big", big, torch.bfloat16, sharded=True)
    shape = tokens_shape(args.big_tokens)
    print(f"(a) {f32 / 4 / 1e9:.2f}B params (L{big.n_layer} d{d} ff{big.d_ff} V{big.vocab_size}), float32 size "
          f"{f32 / 1e9:.2f} GB, sharded bf16 written in {time.perf_counter() - start:.0f} s; streamed, budget 0, "
          f"{shape[0]} x {shape[1] - 1} tokens, each probe in its own child:", flush=True)
    rows = []
    for name in [LOAD_ONLY, *args.big_probes.split(",")]:
        start = time.perf_counter()
        result = run_child(tmp / "big", [name], stream=True, budget=0, shape=shape, timeout=args.probe_timeout)
        wall = time.perf_counter() - start
        if result is None:
            print(f"    {name}: killed after {wall:.0f} s (--probe-timeout)", flush=True)
            rows.append(f"| {name} | timed out | - | {wall:.0f} |")
            continue
        ratio = result["peak_rss"] / f32
        print(f"    {name}: peak RSS {result['peak_rss'] / 1e9:.2f} GB = {ratio:.3f} x float32 (target <= 0.35); "
              f"probe {sum(result['seconds'].get(name, [0.0])):.0f} s, child {wall:.0f} s; {result['reads']} unit "
              f"reads", flush=True)
        rows.append(f"| {name} | {result['peak_rss'] / 1e9:.2f} GB | **{ratio:.3f}** | "
                    f"{sum(result['seconds'].get(name, [0.0])):.0f} ({wall:.0f}) | {result['reads']} |")
    print("| probe | peak RSS | / float32 size (<= 0.35) | probe s (child s) | unit reads |\n|---|---|---|---|---|")
    print("\n".join(rows))
    shutil.rmtree(tmp / "big")


def tokens_shape(text: str) -> tuple[int, int]:
    """"NxT" (N sequences of T model inputs) -> the token tensor's shape (N, T + 1)."""
    n, t = (int(v) for v in text.lower().split("x"))
    return n, t + 1


def small_model(tmp: Path, layers: int, repeats: int, rounds: int) -> None:
    """(b): lens and skip sweep, in memory and streamed (default budget), in `rounds` alternating pairs of children,
    each running them `repeats` times; the first pass (streamed: every block read from the file) and the best pass
    are reported, as wall and as CPU seconds of the child (less sensitive to a shared machine's load)."""
    small = ModelConfig(arch="preln", vocab_size=49152, d_model=576, n_layer=layers, n_heads=9, n_kv_heads=3,
                        d_ff=1536, max_seq_len=64, tie_embeddings=True)
    random_checkpoint(tmp / "small", small, torch.float32, sharded=False)
    probes = ["lens_logit", "ablate_skip"]
    print(f"(b) L{layers} d576 V49152 float32 (tied), {rounds} rounds x {repeats} passes; streamed / in-memory:")
    for round_ in range(rounds):
        memory = run_child(tmp / "small", probes, stream=False, repeats=repeats)
        streamed = run_child(tmp / "small", probes, stream=True, repeats=repeats)
        for name in probes:
            ratios = []
            for kind in ("seconds", "cpu"):
                a, b = memory[kind][name], streamed[kind][name]
                ratios.append(f"{kind} first {b[0]:.2f}/{a[0]:.2f} = {b[0] / a[0]:.2f}, best {min(b):.2f}/{min(a):.2f} "
                              f"= {min(b) / min(a):.2f}")
            print(f"    round {round_ + 1} {name}: " + "; ".join(ratios))
        print(f"    round {round_ + 1} peak RSS in-memory {memory['peak_rss'] / 1e9:.2f} GB, "
              f"streamed {streamed['peak_rss'] / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--probes", default=",".join(PROBES))
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--budget", type=int)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d-ff", type=int, help="default 2.75 d (TinyLlama; Llama-3.2-3B: --d-model 3072 --d-ff 8192)")
    parser.add_argument("--big-probes", default=",".join(SUITE), help="the probes of (a) (default: analyze's suite; "
                        "ablate_swap_adjacent, ablate_mean and ablate_linear may be added)")
    parser.add_argument("--big-tokens", default="2x16", help="(a)'s token set: N sequences x T model inputs")
    parser.add_argument("--probe-timeout", type=float, default=1800, help="(a): kill a probe's child after this many "
                        "seconds")
    parser.add_argument("--tokens", default="2x32", help="a child's token set (internal)")
    parser.add_argument("--threads", type=int, help="torch threads in every child (default: torch's)")
    parser.add_argument("--small-layers", type=int, default=30)
    parser.add_argument("--tmp", default="/tmp/bench_stream")
    parser.add_argument("--skip-big", action="store_true")
    parser.add_argument("--skip-small", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.probes.split(","), args.stream, args.budget, args.repeats,
                     tokens_shape(args.tokens))
    tmp = Path(args.tmp)
    if args.threads:
        os.environ["BENCH_STREAM_THREADS"] = str(args.threads)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"threads {args.threads or torch.get_num_threads()}; uptime: {uptime}")
    try:
        if not args.skip_big:
            big_model(tmp, args)
        if not args.skip_small:
            small_model(tmp, args.small_layers, args.repeats, args.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
