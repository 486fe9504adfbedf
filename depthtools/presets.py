"""Named grids (tolerances are wider than DepthBench's ±3% where small widths make the width grain
coarse, or where an architecture's extra parameters are absorbed by a narrower width): shapes, recipe and data in one place so `--preset NAME` means the same everywhere.

tiny:            CI-sized (~0.25M params, 3 depths), 60k tokens per cell: 43 s for all 12 cells on 2 idle CPU cores (measured).
demo:            the embedded default: 3 archs x 3 depths x 3 seeds, 600k tokens per cell (design study in
                 benchmarks/RESULTS.md: no configuration that fits 15 minutes resolves a depth effect
                 beyond seed noise, and the report says so).
cpu-small:       ~1.6M params, DepthBench's ten architectures x 4 depths: ~68 h of training on 2 CPU cores.
afternoon:       preln, hc, attnres at L4..L32 x 3 seeds: 2 h 02 min of training on 2 CPU cores (measured).
deep:            preln and hc at L6/L24/L96 (the `--ckpt hc_L96` example).
tasks:           the depth-task grid (issue 17): preln at L2/L4/L8 x 3 seeds (~0.12M params) trained on the S5
                 composition stream with a k curriculum; L8 solves k=4 and L2 k=2, beyond seed noise; 18 min 58 s
                 on 2 CPU cores (measured: benchmarks/RESULTS.md, "Depth tasks that are learned").
hop:             pointer chasing that is learned (issue 17): the tasks grid's shapes x 2 seeds on the hop
                 stream (k-hop lookups in a 10-entry table), 8,000 steps per cell; L8 solves k=2, L2 and L4
                 k=1; 16 min 31 s on 2 idle CPU cores (measured: benchmarks/RESULTS.md, "Pointer chasing").
depthbench-400m: the paper's shapes (V=50280, 16 heads, d_ff multiple 16, L16..L32), for GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from depthtools.errors import DepthToolsError

DEPTHBENCH_TEN = ("preln", "periln", "lns", "deepnorm", "keel", "hc", "mhc", "attnres", "blockattnres", "moda")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    plan: dict[str, Any]  # keyword arguments of depthtools.grid.plan_grid
    train: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields
    data: dict[str, Any] = field(default_factory=dict)  # corpus / tokenizer
    analysis: dict[str, Any] = field(default_factory=dict)  # depthtools.analysis.suite.analyze_grid arguments
    # The text probe suite (lens, ablations, ...) reads text windows: off for grids trained on tasks alone.
    probes: bool = True
    # depthtools.analysis.tasks.evaluate_grid arguments for the demo's depth-task stage (tasks, ks, n)
    task_eval: dict[str, Any] = field(default_factory=dict)

    def grid_spec(self, name: str | None = None, seeds=None) -> dict[str, Any]:
        """Plan the preset's cells and return the grid spec (see depthtools.grid.grid_spec).

        `seeds` replaces the preset's training seeds (its plan's `seeds`, default [0]).
        """
        from depthtools.arch import list_archs  # lazy: keeps the preset table (and the CLI) torch-free
        from depthtools.grid import grid_spec, parse_seeds, plan_grid  # lazy: as above

        known = {s.name for s in list_archs()}
        plan = dict(self.plan)
        plan["arch"] = [a for a in plan["arch"] if a in known]
        plan["seeds"] = parse_seeds(seeds if seeds is not None else plan.get("seeds"))
        cells = plan_grid(**plan)
        return grid_spec(cells, name=name or self.name, train=self.train, data=self.data, plan=plan)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny", "CI-sized: ~0.25M params, 3 depths, 43 s for all 12 cells on 2 idle CPU cores (measured)",
        plan=dict(arch=["preln", "lns", "hc", "attnres"], budget=250_000, vocab_size=256, layers=[2, 4, 8],
                  n_heads=2, head_dim_multiple=2, ffn_multiple=8, tolerance=0.06, max_seq_len=64),
        train=dict(tokens=60_000, batch_size=8, seq_len=64, lr=3e-3, eval_every=50, eval_tokens=8192,
                   log_every=10, depth_stats_every=25, checkpoint_every=50),
        data=dict(corpus="default", tokenizer="byte"),
        analysis=dict(n_tokens=1024, seq_len=64, batch_size=8),
    ),
    "demo": Preset(
        "demo", "embedded default: preln, hc, attnres at L2/L4/L8 x 3 training seeds (~0.25M params, 600k tokens "
        "per cell), so every comparison carries its seed noise; 10 min on 2 idle CPU cores (measured)",
        plan=dict(arch=["preln", "hc", "attnres"], budget=250_000, vocab_size=256, layers=[2, 4, 8], seeds=[0, 1, 2],
                  n_heads=2, head_dim_multiple=2, ffn_multiple=8, tolerance=0.06, max_seq_len=128),
        train=dict(tokens=600_000, batch_size=16, seq_len=128, lr=3e-3, eval_every=50, eval_tokens=16384,
                   log_every=10, depth_stats_every=25, checkpoint_every=50,
                   task_mix=dict(fraction=0.05, tasks=["chase", "s5", "add"], k_min=1, k_max=4)),
        data=dict(corpus="default", tokenizer="byte"),
        analysis=dict(n_tokens=2048, seq_len=128, batch_size=8),
    ),
    "cpu-small": Preset(
        "cpu-small", "~1.6M params, DepthBench's ten architectures x 4 depths, 20 tokens/param: ~136 cell-hours of "
        "training measured on this CPU (~68 h on 2 cores): for a many-core box or a GPU, not an afternoon",
        plan=dict(arch=list(DEPTHBENCH_TEN), budget=1_600_000, vocab_size=256, layers=[4, 8, 16, 32],
                  n_heads=2, head_dim_multiple=2, ffn_multiple=16, tolerance=0.05, max_seq_len=256),
        train=dict(tokens_per_param=20, batch_size=32, seq_len=256, lr=2e-3, eval_every=250, eval_tokens=131072,
                   log_every=25, depth_stats_every=250, checkpoint_every=250),
        data=dict(corpus="default", tokenizer="byte"),
        analysis=dict(n_tokens=16384, seq_len=256, batch_size=8),
    ),
    "afternoon": Preset(
        "afternoon", "preln, hc, attnres at L4/L8/L16/L32 x 3 training seeds (~0.42M params, 2.5M tokens per cell): "
        "the CPU grid for DepthBench's question with seed noise; 2 h 02 min of training measured on 2 CPU cores (results in the README)",
        plan=dict(arch=["preln", "hc", "attnres"], budget=420_000, vocab_size=256, layers=[4, 8, 16, 32],
                  seeds=[0, 1, 2], n_heads=2, head_dim_multiple=2, ffn_multiple=8, tolerance=0.06, max_seq_len=128),
        train=dict(tokens=2_500_000, batch_size=16, seq_len=128, lr=3e-3, eval_every=200, eval_tokens=32768,
                   log_every=10, depth_stats_every=200, checkpoint_every=200),
        data=dict(corpus="default", tokenizer="byte"),
        analysis=dict(n_tokens=4096, seq_len=128, batch_size=8),
    ),
    "deep": Preset(
        "deep", "preln and hc at L6/L24/L96 (~0.68M params, d_model 24 at L96), 200k tokens per cell: the cells "
        "behind `depthtools ablate --ckpt hc_L96 --mode skip`",
        plan=dict(arch=["preln", "hc"], budget=680_000, vocab_size=256, layers=[6, 24, 96], n_heads=2,
                  head_dim_multiple=2, ffn_multiple=8, tolerance=0.05, max_seq_len=128),
        train=dict(tokens=200_000, batch_size=16, seq_len=128, lr=3e-3, eval_every=50, eval_tokens=16384,
                   log_every=10, depth_stats_every=50, checkpoint_every=50),
        data=dict(corpus="default", tokenizer="byte"),
        analysis=dict(n_tokens=4096, seq_len=128, batch_size=8),
    ),
    "tasks": Preset(
        "tasks", "depth tasks that are learned: preln at L2/L4/L8 x 3 training seeds (~0.12M params) on the S5 "
        "composition stream alone (answer-only loss, k curriculum 1..6, 5,000 steps); L8 solves k=4, L2 k=2, beyond "
        "seed noise; 19 min on 2 CPU cores (measured)",
        plan=dict(arch=["preln"], budget=125_000, vocab_size=256, layers=[2, 4, 8], seeds=[0, 1, 2], n_heads=2,
                  head_dim_multiple=2, ffn_multiple=8, tolerance=0.08, max_seq_len=64),
        train=dict(tokens=5_000 * 32 * 64, batch_size=32, seq_len=64, lr=3e-3, eval_every=0, eval_tokens=2048,
                   log_every=100, depth_stats_every=0, checkpoint_every=500,
                   task_mix=dict(fraction=1.0, tasks=["s5"], k_min=1, k_max=6, answer_only=True,
                                 curriculum=dict(threshold=0.9, every=100, n=64))),
        data=dict(corpus="default", tokenizer="byte"),
        probes=False,
        task_eval=dict(tasks=["s5"], ks="1-6", n=200),
    ),
    "hop": Preset(
        "hop", "pointer chasing that is learned: preln at L2/L4/L8 x 2 training seeds (~0.12M params) on the hop "
        "stream alone (follow a 10-entry table k times; answer-only loss, k curriculum 1..6, 8,000 steps, lr 1e-3); "
        "L8 solves k=2, L2 and L4 k=1, beyond seed noise at k=2; 16.5 min on 2 idle CPU cores (measured)",
        plan=dict(arch=["preln"], budget=125_000, vocab_size=256, layers=[2, 4, 8], seeds=[0, 1], n_heads=2,
                  head_dim_multiple=2, ffn_multiple=8, tolerance=0.08, max_seq_len=64),
        # lr 1e-3, short warmup: at the tasks preset's 3e-3 a 2-layer model never learned hop k=1 in 2,500 steps
        train=dict(tokens=8_000 * 32 * 64, batch_size=32, seq_len=64, lr=1e-3, warmup_fraction=0.02, eval_every=0,
                   eval_tokens=2048, log_every=100, depth_stats_every=0, checkpoint_every=500,
                   task_mix=dict(fraction=1.0, tasks=["hop"], k_min=1, k_max=6, answer_only=True,
                                 curriculum=dict(threshold=0.9, every=100, n=64))),
        data=dict(corpus="default", tokenizer="byte"),
        probes=False,
        task_eval=dict(tasks=["hop"], ks="1-6", n=200),
    ),
    "depthbench-400m": Preset(
        "depthbench-400m", "the paper's 400M shapes and recipe (GPUs); data: FineWeb-Edu tokenized with the "
        "GPT-NeoX/OLMo 50k tokenizer, prepared beforehand (docs/data.md)",
        plan=dict(arch=list(DEPTHBENCH_TEN), budget=405_400_000, vocab_size=50280, layers=[16, 20, 24, 28, 32],
                  n_heads=16, head_dim_multiple=2, ffn_multiple=16, tolerance=0.04, max_seq_len=2048),
        train=dict(tokens_per_param=20, batch_size=512, micro_batch_size=16, seq_len=2048, lr=2e-3,
                   lr_overrides={"lns": 1e-2}, warmup_fraction=0.1, final_lr_fraction=0.1, eval_every=500,
                   eval_tokens=4_194_304, log_every=10, depth_stats_every=500, checkpoint_every=500, compile="on",
                   max_epochs=1),
        # The paper's data cannot ship with a package: the grid refuses to train until it is prepared.
        data=dict(dir="fineweb-edu-olmo",
                  needs="FineWeb-Edu (DepthBench: sample-100BT) tokenized with the GPT-NeoX/OLMo tokenizer "
                        "(50,280 tokens; GPT-NeoX-20B's 50,277 also fits), about 8.1-8.4B train tokens "
                        "per cell (20 tokens/param x 405M params +-4%, one epoch)",
                  prepare="depthtools data prepare --input 'fineweb-edu/sample/100BT/*.parquet' "
                          "--tokenizer PATH/tokenizer.json --workers 16 --name fineweb-edu-olmo --out DATA_ROOT"),
        analysis=dict(n_tokens=65536, seq_len=1024, batch_size=4),
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DepthToolsError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]
