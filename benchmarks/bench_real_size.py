"""Benchmark: the probes at a real model's size — a random-weight SmolLM-135M-like Llama, imported exactly.

Built locally (nothing downloads): transformers' own `LlamaConfig` with SmolLM-135M's shape (30 layers,
d 576, 9 heads / 3 kv heads, MLP 1536, vocab 49152, tied embeddings), `LlamaForCausalLM` with random
weights, `save_pretrained` into a temporary folder, then depthtools' `import_hf` and `checkpoint.load`
— the path a user's real folder takes. On one fixed token set (random ids, --seqs × --seq-len) it
times, in the same process:

    forward      one plain forward pass of the batch(es) (best of --reps): the unit of every ratio
    lens         the logit lens at all 31 depths (`lens_analysis`, chunked over tokens)
    skip cached  the single-skip sweep with prefix reuse (`sweep`, 30 plans) — what `ablate --mode skip` runs
    skip naive   the same 30 plans, each re-running all 30 blocks (`reuse_prefix=False`)

and prints seconds, the ratio of each to the plain forward, the cached/naive ratio (target <= 0.6x),
the cost plan's predicted forward-pass equivalents (`depthtools.analysis.cost`) beside the measured
ones, and the peak RSS of the process after each stage.

Usage: python benchmarks/bench_real_size.py [--seqs 8 --seq-len 64 --batch 8 --threads 2 --reps 2]

--suite (issue 47): instead, run the whole default suite as `analyze` runs it (`suite.SUITE`, its default
arguments, `--n-tokens` tokens in windows of `--seq-len`, tables saved beside the temporary checkpoint so
the prune curve reuses the skip sweep as in `analyze`), and print per probe the forward-pass equivalents
the cost plan predicts and those measured (wall time / one timed forward of one batch, the plan's unit),
the wall time, and the totals (also with the seconds the plan's own timings take before the probes, which
`analyze` spends too); then the forward re-timed, so a drifting machine shows. --layers and
--vocab shrink the model and --n-tokens the token set for quick iteration; --only runs some probes;
--prune greedy times the opt-in greedy curve; --dtype bfloat16|float16 runs it as `analyze --dtype` does;
--local-forward also divides each probe's time by a forward timed just before it (ratios that carry less of
a loaded machine's drift); --old DIR also prints the plan the code at DIR (a checkout of main before issue 47)
makes for the same checkpoint and tokens; --plan-only prints the plans and runs nothing.
--count-gemm also counts each probe's float32 matrix-multiply FLOPs (every aten mm/addmm/bmm/baddbmm the probe
dispatches, forward-mode tangents included; attention's own products are not counted) and times the GEMMs of
one forward alone (the model's weights, the batch's shapes, replayed in order): their rate gives each probe's
GEMM floor, the seconds its GEMMs alone take on this machine now, whatever else is made faster. Counting slows
the run (~12 %), so its wall times are not the suite's: time the suite without it.

    python benchmarks/bench_real_size.py --suite [--layers 30 --vocab 49152 --n-tokens 4096 --seq-len 128]

--lens-cost (issues 45 and 47): the logit lens at all depths and the 30-plan skip sweep on three head paths:
a full [rows, V] log-softmax per depth/plan (`chunked_head=False`, fused off), the fused row metrics (the C
kernel, `headmetrics.fused_metrics`: the CPU default) and the vocabulary-chunked head, in forward equivalents
of the same run, and the largest difference of every lens and sweep metric from the full path.

    python benchmarks/bench_real_size.py --lens-cost [--seqs 8 --seq-len 64]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis import headmetrics  # noqa: E402
from depthtools.analysis.cost import analysis_cost, duration, head_ratio, time_parts  # noqa: E402
from depthtools.analysis.lens import lens_analysis  # noqa: E402
from depthtools.analysis.suite import analysis_args  # noqa: E402
from depthtools.analysis.sweep import sweep  # noqa: E402
from depthtools.analysis.tokens import split_inputs  # noqa: E402
from depthtools.arch import Plan  # noqa: E402
from depthtools.checkpoint import load  # noqa: E402

SMOLLM_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu")


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def build_checkpoint(folder: Path, seq_len: int, layers: int | None = None, vocab: int | None = None):
    """The random-weight Llama folder (transformers' save_pretrained), imported and loaded by depthtools
    (`layers` / `vocab` override SmolLM-135M's 30 / 49152 for quick runs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from depthtools.interop.llama import import_hf

    torch.manual_seed(0)
    shape = dict(SMOLLM_135M, **({"num_hidden_layers": layers} if layers else {}),
                 **({"vocab_size": vocab} if vocab else {}))
    hf = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    hf.save_pretrained(folder / "hf", safe_serialization=True)
    del hf
    import_hf(folder / "hf", out=folder / "ckpt", max_seq_len=max(seq_len, 128))
    return load(folder / "ckpt"), n_params


OLD_PLAN = r"""
import sys, torch
from depthtools.analysis import suite
from depthtools.checkpoint import load
ckpt, n_seqs, seq_len, names, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","), \
    int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
model = load(ckpt)
tokens = torch.randint(0, model.config.vocab_size, (n_seqs, seq_len + 1), generator=torch.Generator().manual_seed(0))
print(suite.plan(names, model, tokens, recompute=True, batch_size=batch))
"""


def old_plan(code: Path, ckpt: Path, n_seqs: int, seq_len: int, names: list[str], batch: int) -> str:
    """The plan line the code at `code` (a checkout of main before issue 47, read only) prints for the same run."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    result = subprocess.run([sys.executable, "-c", OLD_PLAN, str(ckpt), str(n_seqs), str(seq_len), ",".join(names),
                             str(batch), str(torch.get_num_threads())], env=env, cwd=str(code), capture_output=True,
                            text=True)
    return result.stdout.strip() if result.returncode == 0 else f"(failed: {result.stderr.strip()[-500:]})"


def forward_now(model, tokens, args) -> float:
    """One forward of one batch as the plan counts it (L blocks + the head with its metrics), timed now: the
    unit of --local-forward's ratios, which then carry the machine's drift between probes less. With
    --cpu-time: this process's CPU seconds of the same work (best of 2), which other processes' load
    changes far less than wall time."""
    if not args.cpu_time:
        t_block, t_head = time_parts(model, tokens, args.batch)  # best of 2: the first also makes the reference
        return model.n_layer * t_block + t_head
    from depthtools.analysis.sweep import scored_logprobs
    inputs = split_inputs(tokens[:args.batch])[0]
    best = math.inf
    with torch.no_grad():
        ref = scored_logprobs(model.head(model.run_states(inputs)[-1])).roll(1, 0)  # as time_parts: not timed
        p_ref = ref.exp()
        for _ in range(2):  # the plan's unit: L blocks + one head with log-softmax, KL and argmax
            t0 = time.process_time()
            lp = scored_logprobs(model.head(model.run_states(inputs)[-1]))
            float((p_ref * (ref - lp)).sum())
            lp.argmax(-1)
            best = min(best, time.process_time() - t0)
    return best


aten = torch.ops.aten
GEMMS = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)


def _operands(func, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The two factors of one aten matrix product: mm(a, b), bmm(a, b), addmm(c, a, b), baddbmm(c, a, b)."""
    return (args[1], args[2]) if func in (aten.addmm, aten.baddbmm) else (args[0], args[1])


def _gemm_flops(func, args) -> int:
    """FLOPs (2 per multiply-add) of one aten matrix product."""
    a, b = _operands(func, args)
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class GemmCount(TorchDispatchMode):
    """Counts the FLOPs of every matrix product dispatched inside (`flops`), and with `record` keeps each
    mm's (input shape, weight operand) in order so `forward_gemm_rate` can time the products alone."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.flops, self.record, self.products = 0, record, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func._overloadpacket
        if packet in GEMMS:
            self.flops += _gemm_flops(packet, args)
            if self.record and packet in (aten.mm, aten.addmm):
                a, b = _operands(packet, args)
                self.products.append((tuple(a.shape), b))
        return func(*args, **(kwargs or {}))


def forward_gemm_rate(model, tokens, batch: int, reps: int = 3) -> tuple[float, float]:
    """(GEMM FLOPs, seconds) of one forward's matrix products alone: the products a plain forward of one batch
    dispatches (recorded under `GemmCount`), replayed in order on the model's own weight operands with inputs of
    the recorded shapes, best of `reps`. Their ratio is the float32 GEMM rate the suite's blocks and heads get."""
    inputs = split_inputs(tokens[:batch])[0]
    with torch.no_grad():
        with GemmCount(record=True) as counter:
            model.run(inputs)
        shapes = {shape for shape, _ in counter.products}
        operands = {shape: torch.randn(shape) for shape in shapes}
        outputs = [torch.empty(shape[0], b.shape[1]) for shape, b in counter.products]
        return counter.flops, best(lambda: [torch.mm(operands[shape], b, out=out)
                                            for (shape, b), out in zip(counter.products, outputs)], reps)


def dtype_forward_ratio(full, low, tokens, batch: int, dtype: str) -> str:
    """One forward of one batch (`time_parts`: L blocks and the head with its metrics) of the float32 model and of
    the same checkpoint in `dtype`, timed interleaved in this process, as a line with their ratio."""
    seconds = {"float32": math.inf, dtype: math.inf}
    for _ in range(2):
        for name, m in (("float32", full), (dtype, low)):
            t_block, t_head = time_parts(m, tokens, batch)
            seconds[name] = min(seconds[name], m.n_layer * t_block + t_head)
    return (f"one forward of one batch: float32 {seconds['float32'] * 1000:.0f} ms, {dtype} {seconds[dtype] * 1000:.0f} "
            f"ms ({seconds[dtype] / seconds['float32']:.2f}x, same run)")


def run_suite(args) -> None:
    """The default suite on the real-size model: per probe, planned and measured forward equivalents and time."""
    from depthtools.analysis import suite
    from depthtools.analysis.cost import describe_timed
    from depthtools.analysis.sweep import shared_sweeps

    seq_len = args.seq_len or suite.SEQ_LEN
    names = list(suite.SUITE) if args.only is None else args.only.split(",")
    options = dict(batch_size=args.batch, prune=args.prune)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, n_params = build_checkpoint(Path(tmp), seq_len, args.layers, args.vocab)
        L, V = model.n_layer, model.config.vocab_size
        n_seqs = math.ceil(args.n_tokens / seq_len)
        tokens = torch.randint(0, V, (n_seqs, seq_len + 1), generator=torch.Generator().manual_seed(0))
        if args.dtype != "float32":  # what `analyze --dtype` runs: the checkpoint loaded straight into the dtype
            low = load(Path(tmp) / "ckpt", dtype=getattr(torch, args.dtype))
            print(dtype_forward_ratio(model, low, tokens, args.batch, args.dtype), flush=True)
            model = low
        print(f"[build + save_pretrained + import + load: {time.perf_counter() - t0:.1f} s]", flush=True)
        analyses = {name: suite.analysis_args(name, **options) for name in names}
        t_plan = time.perf_counter()  # analyze times its plan before the probes: part of the suite's wall time
        skip_measured = suite.skip_is_measured(names, model, tokens, **options)
        line, costs, _ = describe_timed(model, analyses, tokens, args.batch, skip_measured=skip_measured,
                                        shared=suite.shared_sweep(names, model, **options), shared_states=True,
                                        skips_from=suite.causal_skips(names, model, **options))
        t_plan = time.perf_counter() - t_plan
        t_block, t_head = time_parts(model, tokens, args.batch)
        forward_s = L * t_block + t_head  # the plan's unit: one forward of one batch with the head's metrics
        rate_before = forward_gemm_rate(model, tokens, args.batch) if args.count_gemm else None
        print(f"SmolLM-135M-shaped Llama (random weights, {n_params / 1e6:.1f}M parameters, L={L}, V={V}), "
              f"{n_seqs}x{seq_len} tokens, batch {args.batch}, {args.threads} thread(s), {args.dtype}, CPU")
        print(line, flush=True)
        if args.plan_only:
            for name, cost in zip(names, costs):
                print(f"  {name:<18} {('≤' if cost.upper_bound else '') + f'{cost.forwards:.1f}':>10} forward equivalents")
            if args.old is not None:
                print("before issue 47 (the same checkpoint, tokens and options, the code at --old):", flush=True)
                print(old_plan(args.old, Path(tmp) / "ckpt", n_seqs, seq_len, names, args.batch), flush=True)
            return
        rows, flops = [], {}
        with shared_sweeps():  # as analyze_grid runs one model's analyses
            for name, cost in zip(names, costs):
                local = forward_now(model, tokens, args) if args.local_forward else forward_s
                clock = time.process_time if args.cpu_time else time.perf_counter
                counter = GemmCount() if args.count_gemm else contextlib.nullcontext()
                t0 = clock()
                with counter:
                    suite.run_analysis(name, model, tokens, recompute=True, **options)
                seconds = clock() - t0
                flops[name] = counter.flops if args.count_gemm else None
                rows.append((name, cost.forwards, cost.upper_bound, seconds, local))
                print(f"  [{name}: {seconds:.1f} s; load average {os.getloadavg()[0]:.1f}"
                      + (f"; one forward just before: {local * 1000:.0f} ms]" if args.local_forward else "]"), flush=True)
        t_block2, t_head2 = time_parts(model, tokens, args.batch)
        forward_after = L * t_block2 + t_head2
        rate_after = forward_gemm_rate(model, tokens, args.batch) if args.count_gemm else None
        if args.old is not None:
            print("before issue 47 (the same checkpoint, tokens and options, the code at --old):", flush=True)
            print(old_plan(args.old, Path(tmp) / "ckpt", n_seqs, seq_len, names, args.batch), flush=True)
    print(f"{'probe':<18} {'planned fwd':>12} {'measured fwd':>13} {'ratio':>7} {'wall':>12}"
          + (f" {'ratio (local fwd)':>18}" if args.local_forward else ""))
    for name, planned, bound, seconds, local in rows:
        measured = seconds / forward_s
        ratio = f"{measured / planned:7.2f}" if planned > 0 else f"{'—':>7}"  # 0: shared with an earlier probe
        local_ratio = f"{seconds / local / planned:18.2f}" if planned > 0 else f"{'—':>18}"
        print(f"{name:<18} {('≤' if bound else '') + f'{planned:.1f}':>12} {measured:13.1f} "
              f"{ratio} {duration(seconds):>12}" + (f" {local_ratio}" if args.local_forward else ""))
    planned, seconds = sum(r[1] for r in rows), sum(r[3] for r in rows)
    print(f"{'total':<18} {planned:12.1f} {seconds / forward_s:13.1f} {seconds / forward_s / planned:7.2f} "
          f"{duration(seconds):>12}")
    print(f"with the plan's timings before the probes ({t_plan:.1f} s): {duration(seconds + t_plan)}")
    print(f"one forward of one batch: {forward_s * 1000:.0f} ms before the suite, {forward_after * 1000:.0f} ms "
          f"after ({forward_after / forward_s:.2f}x: machine drift)")
    if args.count_gemm:
        print_gemm_floor(rows, flops, rate_before, rate_after)


def print_gemm_floor(rows, flops: dict, rate_before: tuple[float, float], rate_after: tuple[float, float]) -> None:
    """Per probe: its GEMM FLOPs and the seconds they alone take at the faster of the two measured rates (a floor:
    the replayed products run on full-batch shapes, preallocated outputs, nothing between them)."""
    rate = max(f / s for f, s in (rate_before, rate_after))
    print(f"float32 GEMM rate of one forward's products alone: {rate_before[0] / rate_before[1] / 1e9:.0f} GFLOP/s "
          f"before, {rate_after[0] / rate_after[1] / 1e9:.0f} after (their GEMMs: {rate_before[1] * 1000:.0f} ms of one "
          f"forward); floors at {rate / 1e9:.0f}")
    print(f"{'probe':<18} {'GEMM TFLOP':>11} {'GEMM floor':>12} {'wall (counted)':>15} {'floor / wall':>13}")
    total = 0.0
    for name, _, _, seconds, _ in rows:
        floor = flops[name] / rate
        total += flops[name]
        print(f"{name:<18} {flops[name] / 1e12:11.2f} {duration(floor):>12} {duration(seconds):>15} "
              f"{floor / seconds if seconds else 0:13.2f}")
    print(f"{'total':<18} {total / 1e12:11.2f} {duration(total / rate):>12}; ten minutes of GEMMs alone need "
          f"{total / 600 / 1e9:.0f} GFLOP/s")


def run_lens_cost(args) -> None:
    """Issue 45/47: the logit lens at all depths and the skip sweep on three head paths -- full [rows, V]
    log-probs per depth/plan (chunked_head=False, fused off), the fused row metrics (the C kernel, the CPU
    default) and the vocabulary-chunked head (`headmetrics`) -- in forward-pass equivalents of the same run, with
    the largest difference of every metric from the full path."""
    from depthtools.analysis.lens import LENS_METRICS

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, n_params = build_checkpoint(Path(tmp), args.seq_len, args.layers, args.vocab)
        print(f"[build + save_pretrained + import + load: {time.perf_counter() - t0:.1f} s]", flush=True)
    L, V = model.n_layer, model.config.vocab_size
    tokens = torch.randint(0, V, (args.seqs, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs = tokens[:, :-1]

    @torch.no_grad()
    def forward():
        for lo in range(0, args.seqs, args.batch):
            model.run(inputs[lo:lo + args.batch])

    forward()
    t_fwd = best(forward, args.reps)
    print(f"SmolLM-135M-shaped Llama (random weights, {n_params / 1e6:.1f}M parameters, L={L}, V={V}), "
          f"{args.seqs}x{args.seq_len} tokens, batch {args.batch}, {args.threads} thread(s), float32, CPU; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"  plain forward {t_fwd:.2f} s (the unit)", flush=True)
    lens, sweeps = {}, {}
    plans = [Plan.skipping(l) for l in range(L)]
    labels = (("full log-softmax", False, False), ("fused row metrics", False, True),
              ("chunked head", True, True))
    for label, chunked, fused in labels:
        headmetrics.FUSED = fused
        t0 = time.perf_counter()
        lens[label] = lens_analysis(model, tokens, batch_size=args.batch, chunked_head=chunked).depths
        t_lens = time.perf_counter() - t0
        print(f"  {label:<22} lens {t_lens:7.2f} s = {t_lens / t_fwd:5.1f} forward equivalents (target <= 8)",
              flush=True)
    base = lens[labels[0][0]]
    for label, *_ in labels[1:]:
        print(f"  lens max |{label} − full| per metric (mean over tokens, any depth): "
              + ", ".join(f"{m} {float((base[m] - lens[label][m]).abs().max()):.1e}" for m in LENS_METRICS), flush=True)
    if args.no_sweep:
        return
    for label, chunked, fused in labels:
        headmetrics.FUSED = fused
        t0 = time.perf_counter()
        sweeps[label] = sweep(model, tokens, plans, batch_size=args.batch, chunked_head=chunked)
        t_sweep = time.perf_counter() - t0
        print(f"  {label:<22} skip sweep ({L} plans) {t_sweep:7.2f} s = {t_sweep / t_fwd:5.1f} forward equivalents",
              flush=True)
    base = sweeps[labels[0][0]]
    for label, *_ in labels[1:]:
        worst = {m: max(abs(getattr(x, m) - getattr(y, m)) for x, y in zip(base.plans, sweeps[label].plans))
                 for m in ("ce", "kl", "top1_agree", "top1_acc")}
        print(f"  skip sweep max |{label} − full| per metric: " + ", ".join(f"{m} {v:.1e}" for m, v in worst.items()))
    headmetrics.FUSED = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default 64; --suite: 128)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--suite", action="store_true", help="time the whole default suite per probe")
    parser.add_argument("--no-sweep", action="store_true", help="--lens-cost: the lens only")
    parser.add_argument("--lens-cost", action="store_true", help="the lens and skip sweep before/after the "
                        "vocabulary-chunked head, in forward equivalents, with each metric's largest difference")
    parser.add_argument("--layers", type=int, default=None, help="--suite: layers (default 30)")
    parser.add_argument("--vocab", type=int, default=None, help="--suite: vocabulary (default 49152)")
    parser.add_argument("--n-tokens", type=int, default=4096, help="--suite: evaluation tokens")
    parser.add_argument("--only", default=None, help="--suite: comma-separated probes (default: the suite)")
    parser.add_argument("--prune", default="order", help="--suite: pruning curve (order, greedy)")
    parser.add_argument("--plan-only", action="store_true", help="--suite: print the plans, run nothing")
    parser.add_argument("--cpu-time", action="store_true", help="--suite --local-forward: CPU seconds of this process "
                        "(probe and forward) instead of wall time, for a machine other processes load")
    parser.add_argument("--local-forward", action="store_true", help="--suite: also time one forward just before "
                        "each probe and print each probe's ratio against it (a loaded machine drifts)")
    parser.add_argument("--count-gemm", action="store_true", help="--suite: count each probe's matrix-product FLOPs "
                        "and print its GEMM floor at this machine's measured rate (counting slows the run)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="--suite: the analysis dtype (analyze --dtype; --count-gemm counts float32 products only)")
    parser.add_argument("--old", type=Path, default=None, help="--suite: also print the plan of the code at this "
                        "checkout (e.g. /work/main before issue 47) for the same run")
    args = parser.parse_args()
    if args.count_gemm and args.dtype != "float32":
        parser.error("--count-gemm times float32 products; run it without --dtype")
    torch.set_num_threads(args.threads)
    if args.suite:
        run_suite(args)
        return
    args.seq_len = args.seq_len or 64
    if args.lens_cost:
        run_lens_cost(args)
        return
    stages = []

    def done(name: str, seconds: float) -> None:
        stages.append((name, seconds, peak_rss_mib()))
        print(f"  [{name}: {seconds:.2f} s, peak RSS {stages[-1][2]:.0f} MiB]", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, n_params = build_checkpoint(Path(tmp), args.seq_len)
        done("build + save_pretrained + import + load", time.perf_counter() - t0)
    L, V = model.n_layer, model.config.vocab_size
    tokens = torch.randint(0, V, (args.seqs, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs = tokens[:, :-1]
    plans = [Plan.skipping(l) for l in range(L)]

    @torch.no_grad()
    def forward():
        for lo in range(0, args.seqs, args.batch):
            model.run(inputs[lo:lo + args.batch])

    forward()  # warm-up (allocator, kernels)
    t_fwd = best(forward, args.reps)
    done("plain forward", t_fwd)
    t_lens = best(lambda: lens_analysis(model, tokens, batch_size=args.batch), 1)
    done("logit lens (31 depths)", t_lens)
    t_cached = best(lambda: sweep(model, tokens, plans, batch_size=args.batch, reuse_prefix=True), 1)
    done("skip sweep, prefix-cached (30 plans)", t_cached)
    t_naive = best(lambda: sweep(model, tokens, plans, batch_size=args.batch, reuse_prefix=False), 1)
    done("skip sweep, naive re-runs (30 plans)", t_naive)

    n_seqs, T = args.seqs, args.seq_len
    t_block, t_head = time_parts(model, tokens, args.batch)
    h = t_head / t_block

    def predicted(h_: float) -> dict[str, float]:  # sequence_profile: the cost of one skip rule's sweep
        return {name: analysis_cost(name, model, analysis_args(name, batch_size=args.batch), n_seqs, T,
                                    args.batch, h_).forwards / math.ceil(n_seqs / args.batch)
                for name in ("lens_logit", "sequence_profile")}
    print(f"SmolLM-135M-like Llama (random weights, {n_params / 1e6:.1f}M parameters, L={L}, d=576, V={V}), "
          f"{n_seqs}x{T} tokens, batch {args.batch}, {args.threads} thread(s), float32, CPU")
    for name, seconds, rss in stages:
        ratio = f"{seconds / t_fwd:7.2f}x forward" if name != stages[0][0] else " " * 16
        print(f"  {name:<42} {seconds:8.2f} s  {ratio}   peak RSS {rss:7.0f} MiB")
    print(f"skip sweep cached / naive = {t_cached / t_naive:.3f}x (target <= 0.6x)")
    for label, h_ in (("timed head+metrics", h), ("parameter ratio", head_ratio(model))):
        p = predicted(h_)
        print(f"cost plan ({label}, h = {h_:.1f} blocks): lens {p['lens_logit']:.1f} forward equivalents "
              f"(measured {t_lens / t_fwd:.1f}), skip sweep {p['sequence_profile']:.1f} (measured {t_cached / t_fwd:.1f})")


if __name__ == "__main__":
    main()
