"""Every depth probe by name, one cache rule, and the whole suite over checkpoints (what the CLI runs).

One registry (`ANALYSES`) names each analysis, the arguments its result depends on (with their
defaults) and the tables it saves beside a checkpoint; `depthtools analyze` and the single probe
commands (`lens`, `ablate`, `causal`, ...) all run through `run_analysis`, so they write the same
table names with the same settings and reuse each other's tables:

    similarity, causal, contrib, routing, sequence_profile      one table each, named like the analysis
    lens_logit   -> lens_logit, lens_logit_summary, prediction_depth
    lens_tuned   -> lens_tuned, lens_tuned_summary, prediction_depth_tuned
    ablate_skip, ablate_prune, ablate_mean, ablate_linear        one table each (`ablate --mode M`)
    ablate_swap  (all pairs i < j: DepthBench's permutation score), ablate_swap_adjacent (pairs i, i+1)

Every analysis reads the same fixed evaluation windows (`probe_tokens`: seeded windows of the
checkpoint's recorded data directory) and saves its tables with the settings it ran with
(`table_settings`: the analysis, its arguments, the token-set hash and the weight hash). The cache
rule (`depthtools.analysis.tables.cached`): identical settings -> the saved tables are reused;
anything else -> recomputed and saved over them. So an interrupted `analyze_grid` resumes where it
stopped and a changed setting never reuses a stale result.

Tables saved before the names were unified (the `lens` command's `lens` / `lens_tuned`, the
`ablate` command's `ablate_swap` of adjacent pairs and `ablate_swap_all`) are never reused; readers
(`read_result`: the report and the effective-depth summary) translate them to the current names.

    from depthtools.analysis.suite import analyze_grid
    report = analyze_grid("checkpoints/tiny", n_tokens=2048, seq_len=64)
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from depthtools.errors import DepthToolsError

# Imports tagged `# lazy` below stay inside their functions: the CLI imports this module at start-up (`--help`,
# option defaults, check_sizes), and the probe modules, checkpoint and tokens it calls load torch and TransformerLens.

# One default evaluation set for every probe: ceil(N_TOKENS / seq_len) windows of min(SEQ_LEN, context).
N_TOKENS = 4096
SEQ_LEN = 128
BATCH_SIZE = 8
# The all-pairs swap suite evaluates at most this many pairs, spread evenly (all of them up to L = 11;
# 64 of a 30-layer model's 435): the suite's default stays minutes on CPU (ablate.chosen_pairs).
SWAP_PAIRS_MAX = 64


# -- the evaluation token set and what a saved table depends on ------------------------------------

def eval_tokens(ckpt_dir: str | Path, data: str | Path | None, n_tokens: int, seq_len: int, split: str = "val",
                seed: int = 0, cap: bool = False):
    """The fixed evaluation windows [n, seq_len] of a checkpoint (from `data` or its recorded data dir,
    checked against the checkpoint's tokenizer and data fingerprint: `tokens.checkpoint_data_dir`).
    `cap`: fewer windows when the split holds fewer tokens than asked (`tokens.split_note`)."""
    from depthtools.analysis.tokens import checkpoint_data_dir, sample_windows  # lazy

    if data is not None and Path(data).is_file():  # --text FILE: the model's own tokenizer, no dataset
        from depthtools.analysis.tokens import text_windows  # lazy

        if split == "train":
            raise DepthToolsError(f"--text {data} gives evaluation windows only; the tuned lens (and --split train) "
                                  "need a prepared dataset's train split: pass --data DIR")
        return text_windows(Path(ckpt_dir), Path(data), n_tokens, seq_len, seed=seed, cap=cap)
    from depthtools.analysis.tokens import separator_note  # lazy

    data_dir = checkpoint_data_dir(Path(ckpt_dir), data)
    windows = sample_windows(data_dir, n_tokens, seq_len, split=split, seed=seed, cap=cap)
    note = separator_note(ckpt_dir, data_dir)
    windows.notes = [*windows.notes, *([note] if note else [])]
    return windows


def checkpoint_tokens(ckpt_dir: str | Path, data: str | Path | None = None, n_tokens: int = N_TOKENS,
                      seq_len: int | None = None, split: str = "val", seed: int = 0, cap: bool = False,
                      train_tokens: int | None = None):
    """The evaluation windows of a checkpoint, checked against its config.json only -- before its weights
    are read. Everything a probe can refuse without the model (no such data folder, another tokenizer, a
    checkpoint with no tokenizer for --text, a split shorter than one window, a --seq-len beyond the
    context, ids outside the vocabulary) is refused here in one line, not after minutes of loading.
    `train_tokens`: also check that the train split gives the tuned lens its windows (`--text` has none).
    `probe_tokens(model, tokens=...)` then moves the windows to the loaded model."""
    from depthtools.analysis.tokens import check_token_set, config_limits  # lazy

    context, vocab, label = config_limits(ckpt_dir)
    length = _window_length(context, seq_len, Path(ckpt_dir).name)
    tokens = eval_tokens(ckpt_dir, data, n_tokens, length, split, seed, cap)
    check_token_set(tokens, context, vocab, label)
    if train_tokens is not None:
        check_token_set(eval_tokens(ckpt_dir, data, train_tokens, length, "train", seed), context, vocab, label)
    return tokens


def check_sizes(n_tokens: int, seq_len: int | None, batch_size: int) -> None:
    """The evaluation-set options every probe shares (one-line errors naming the option)."""
    if n_tokens < 1:
        raise DepthToolsError(f"empty token set: --n-tokens must be >= 1, got {n_tokens}")
    if seq_len is not None and seq_len < 2:
        raise DepthToolsError(f"--seq-len must be >= 2 (position 0 is not scored), got {seq_len}")
    if batch_size < 1:
        raise DepthToolsError(f"--batch-size must be >= 1, got {batch_size}")


def window_length(model, seq_len: int | None) -> int:
    """--seq-len, or min(SEQ_LEN, the model's context) when not given; longer than the context is an error."""
    from depthtools.analysis.tables import model_columns  # lazy

    return _window_length(model.config.max_seq_len, seq_len, model_columns(model)["model"])


def _window_length(context: int, seq_len: int | None, name: str) -> int:
    if seq_len is None:
        return min(SEQ_LEN, context)
    if seq_len > context:
        raise DepthToolsError(f"--seq-len {seq_len} exceeds the context {context} of {name}; "
                              f"use --seq-len <= {context}")
    return seq_len


def probe_tokens(model, data: str | Path | None = None, n_tokens: int = N_TOKENS, seq_len: int | None = None,
                 split: str = "val", seed: int = 0, tokens=None):
    """The evaluation windows every probe of `model` reads, validated and on the model's device.
    `tokens`: the windows `checkpoint_tokens` drew before the model was loaded (else drawn here)."""
    from depthtools.analysis.tokens import check_tokens  # lazy

    ckpt_dir = getattr(model, "checkpoint_dir", None)
    if ckpt_dir is None:
        raise DepthToolsError("the model was not loaded from a checkpoint; load it with depthtools.checkpoint.load")
    if tokens is None:
        tokens = eval_tokens(ckpt_dir, data, n_tokens, window_length(model, seq_len), split, seed)
    notes = getattr(tokens, "notes", [])
    tokens = check_tokens(model, tokens)
    tokens.source = token_source(ckpt_dir, data, split)  # read by run_analysis: recorded beside saved tables
    tokens.notes = notes
    return tokens


def token_source(ckpt_dir, data: str | Path | None, split: str) -> dict[str, Any]:
    """Where evaluation tokens came from, for a saved table's record: the text file, or the data folder
    (given or the checkpoint's recorded one) and split."""
    from depthtools.analysis.tokens import recorded_data_dir  # lazy

    if data is not None and Path(data).is_file():
        return {"text": str(Path(data).resolve())}
    folder = Path(data) if data is not None else recorded_data_dir(Path(ckpt_dir))
    return {"data": str(folder.resolve()) if folder is not None else None, "split": split}


def table_settings(name: str, args: dict[str, Any], model, tokens) -> dict[str, Any]:
    """What a saved table depends on: the analysis, its arguments, the token set and the weights
    (and the analysis dtype when it is not float32: the weight hash changes with it too)."""
    from depthtools.analysis.lens import model_fingerprint  # lazy
    from depthtools.analysis.tokens import token_fingerprint  # lazy

    dtype = model_dtype(model)
    return {"analysis": name, **args, "tokens": token_fingerprint(tokens), "tokens_shape": list(tokens.shape),
            "model": model_fingerprint(model), **({"dtype": dtype} if dtype != "float32" else {})}


# The dtypes an analysis may run in. float32 is the default (on CPU bfloat16 matmuls are not faster
# everywhere, and every metric is exact to float32); bfloat16 and float16 halve the weights' memory and
# the activations'. A low-precision model is loaded straight into its dtype (`checkpoint.load(dtype=)`);
# the head's logits are widened to float32 before log-softmax/CE/KL, and the probes' statistics (CKA,
# least squares, angles, norms) widen to float32/float64; every metric sum accumulates in float64
# (docs/probes.md: each metric's error against float32).
DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(model) -> str:
    """The dtype of the model's floating-point parameters ('float32', 'bfloat16', ...)."""
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).replace("torch.", "")
    return "float32"


def check_dtype(dtype: str | None) -> str | None:
    """`dtype` if it is an analysis dtype (or None: as loaded); else a one-line error."""
    if dtype is not None and dtype not in DTYPES:
        raise DepthToolsError(f"unknown --dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return dtype


def cast_model(model, dtype: str | None):
    """The model in analysis dtype `dtype` (None: as loaded)."""
    import torch  # lazy

    if check_dtype(dtype) is None:
        return model
    return model.to(getattr(torch, dtype))


def pending(names: list[str], model, tokens, recompute: bool = False, **options) -> list[str]:
    """The analyses of `names` whose tables are not saved with the settings they would run with."""
    from depthtools.analysis.tables import load_table  # lazy

    if recompute:
        return list(names)
    todo = []
    for name in names:
        settings = table_settings(name, analysis_args(name, **options), model, tokens)
        if any(load_table(model.checkpoint_dir, out, settings) is None for out in ANALYSES[name].outputs):
            todo.append(name)
    return todo


def plan(names: list[str], model, tokens, recompute: bool = False, **options) -> str:
    """ONE line before a run: what will run (saved tables excluded), its cost in forward-pass
    equivalents and an ETA from one timed forward pass (`depthtools.analysis.cost`)."""
    return plan_run(names, model, tokens, recompute, **options).line


@dataclass(frozen=True)
class RunPlan:
    """The plan line, each pending analysis' forward-pass equivalents and the timed forward (seconds of one
    batch) they were converted with: what `analyze_grid` re-times against after its first analysis."""

    line: str
    forwards: dict[str, float]
    forward_s: float


def plan_run(names: list[str], model, tokens, recompute: bool = False, shared_states: bool = False,
             **options) -> RunPlan:
    """`plan`, with the numbers behind its line; `shared_states`: the run shares intact states
    (`analyze_grid`'s `sweep.shared_sweeps` block)."""
    from depthtools.analysis.cost import describe_timed  # lazy
    from depthtools.analysis.tables import model_columns  # lazy

    todo = pending(names, model, tokens, recompute, **options)
    if not todo:
        return RunPlan(f"plan {model_columns(model)['model']}: every table is already saved with these settings "
                       "(reused)", {}, 0.0)
    batch_size = options.get("batch_size", BATCH_SIZE)
    line, costs, forward_s = describe_timed(model, {name: analysis_args(name, **options) for name in todo}, tokens,
                                            batch_size, skip_measured=skip_is_measured(names, model, tokens, **options),
                                            shared=shared_sweep(todo, model, **options), shared_states=shared_states,
                                            skips_from=causal_skips(todo, model, **options))
    reused = len(names) - len(todo)
    return RunPlan(line + (f"; {reused} saved table(s) reused" if reused else ""),
                   {c.name: c.forwards for c in costs}, forward_s)


# -- the single analyses (thin, keyword-complete wrappers so the suite can record their arguments) ---

def run_causal(model, tokens, batch_size=BATCH_SIZE, exclude_first=1, rule=None, future=True, cuts=None,
               progress=None):
    from depthtools.analysis.causal import causal_scores  # lazy

    return causal_scores(model, tokens, batch_size=batch_size, rule=rule, exclude_first=exclude_first,
                         future=future, cuts=cuts, progress=progress)


def run_similarity(model, tokens, batch_size=BATCH_SIZE, exclude_first=1, cka_batch=256, outlier_k=1):
    from depthtools.analysis.geometry import depth_similarity  # lazy

    return depth_similarity(model, tokens, batch_size=batch_size, exclude_first=exclude_first,
                            cka_batch=cka_batch, outlier_k=outlier_k)


def run_contrib(model, tokens, batch_size=BATCH_SIZE, exclude_first=1, jacobian=True, probes=2):
    from depthtools.analysis.contrib import contributions  # lazy

    return contributions(model, tokens, batch_size=batch_size, exclude_first=exclude_first, jacobian=jacobian,
                         probes=probes)


def run_routing(model, tokens, exclude_first=1, long_range_k=4):
    from depthtools.analysis.routing import routing_stats  # lazy

    return routing_stats(model, tokens, exclude_first=exclude_first, long_range_k=long_range_k)


@dataclass(frozen=True)
class Probe:
    """What a runner gets besides its arguments: where the model's data is, and a progress callback."""

    data: str | Path | None = None
    progress: Callable[[float], None] | None = None


def _single(fn: Callable, with_progress: bool = False):
    def runner(model, tokens, probe: Probe, **args):
        return fn(model, tokens, **args, **({"progress": probe.progress} if with_progress else {}))
    return runner


def _lens_logit(model, tokens, probe: Probe, batch_size):
    from depthtools.analysis.lens import lens_analysis  # lazy

    result = lens_analysis(model, tokens, batch_size=batch_size, progress=probe.progress)
    return {"lens_logit": result.depths, "lens_logit_summary": result.summary, "prediction_depth": result.tokens}


def _lens_tuned(model, tokens, probe: Probe, batch_size, lens_steps, lens_tokens, lens_lr, seed):
    """Fit (or reuse) a tuned lens on train-split windows, then evaluate it on the evaluation windows."""
    from depthtools.analysis.lens import check_tuned_lens, fit_tuned_lens, lens_analysis  # lazy
    from depthtools.analysis.tokens import check_tokens  # lazy

    check_tuned_lens(model)  # before drawing the train windows (HC/mHC readout "normed_sum" has nothing to translate)
    ckpt_dir = Path(model.checkpoint_dir)
    train = check_tokens(model, eval_tokens(ckpt_dir, probe.data, lens_tokens, tokens.shape[1] - 1, "train", seed))
    translators = fit_tuned_lens(model, train, ckpt_dir, steps=lens_steps, lr=lens_lr, batch_size=batch_size,
                                 seed=seed, progress=probe.progress)
    result = lens_analysis(model, tokens, translators, batch_size=batch_size)
    return {"lens_tuned": result.depths, "lens_tuned_summary": result.summary, "prediction_depth_tuned": result.tokens}


def _ablate(mode: str):
    def runner(model, tokens, probe: Probe, **args):
        from depthtools.analysis.ablate import ablate  # lazy

        if mode == "prune" and args.get("prune") == "order":
            args = dict(args, skip_delta=measured_skip(model, tokens, args))
        return ablate(model, tokens, mode=mode, progress=probe.progress, **args)
    return runner


def _skip_settings(model, tokens, args: dict[str, Any]) -> dict[str, Any]:
    """The settings an `ablate_skip` table measured with prune's batch size and rules is saved with."""
    return table_settings("ablate_skip", analysis_args("ablate_skip", batch_size=args["batch_size"],
                                                       rules=args.get("rules")), model, tokens)


def measured_skip(model, tokens, args: dict[str, Any]) -> dict[str, list[float]] | None:
    """{rule: single-skip ΔCE per block} from the `ablate_skip` table saved with the settings prune's
    arguments give it (same tokens, weights, batch size, rules), or None: the order curve then
    measures it. The suite runs ablate_skip before ablate_prune, so the default curve costs no sweep."""
    from depthtools.analysis.tables import load_table  # lazy

    ckpt_dir = getattr(model, "checkpoint_dir", None)
    if ckpt_dir is None:
        return None
    try:
        df = load_table(ckpt_dir, "ablate_skip", _skip_settings(model, tokens, args))
    except DepthToolsError:
        return None
    if df is None:
        return None
    df = df[df["mode"] == "skip"]
    return {str(rule): group.sort_values("layer")["delta_ce"].astype(float).tolist()
            for rule, group in df.groupby("rule", sort=False)}


def shared_sweep(names: list[str], model, **options) -> str | None:
    """Of sequence_profile and ablate_skip both run here (inside `sweep.shared_sweeps`, as `analyze_grid`
    runs them), the later one, which finds the default rule's skip sweep already run; else None."""
    if "sequence_profile" not in names or "ablate_skip" not in names:
        return None
    if not (_sweeps_default_rule("sequence_profile", model, **options)
            and _sweeps_default_rule("ablate_skip", model, **options)):
        return None
    return max(("sequence_profile", "ablate_skip"), key=names.index)


def _sweeps_default_rule(name: str, model, **options) -> bool:
    """Whether analysis `name` (sequence_profile, ablate_skip or causal) runs the single-skip plans of the
    architecture's default skip rule: its `rule` is unset or the default, or its `rules` are unset or include it."""
    default, args = model.scheme.skip_rules[0], analysis_args(name, **options)
    if "rules" in args:
        return args["rules"] is None or default in args["rules"]
    return (args["rule"] or default) == default


def causal_skips(names: list[str], model, **options) -> str | None:
    """Of sequence_profile and ablate_skip, the first to run after causal here (inside `sweep.shared_sweeps`)
    whose default-rule skip sweep finds causal's skip runs kept (`sweep.remember_hidden`: the same plans on
    the same batches), so it decodes them without running blocks; else None."""
    if "causal" not in names or not _sweeps_default_rule("causal", model, **options):
        return None
    after = names[names.index("causal") + 1:]
    return next((name for name in after if name in ("sequence_profile", "ablate_skip")
                 and _sweeps_default_rule(name, model, **options)), None)


def skip_is_measured(names: list[str], model, tokens, **options) -> bool:
    """Whether the order prune of this run will find its single-skip sweep (planned before it, or saved)."""
    if "ablate_prune" not in names:
        return False
    args = analysis_args("ablate_prune", **options)
    if args.get("prune") != "order":
        return False
    if "ablate_skip" in names[:names.index("ablate_prune")] and \
            analysis_args("ablate_skip", **options)["rules"] == args["rules"]:
        return True
    return measured_skip(model, tokens, args) is not None


def _sequence_profile(model, tokens, probe: Probe, **args):
    from depthtools.analysis.profile import sequence_profile  # lazy

    return sequence_profile(model, tokens, progress=probe.progress, **args)


@dataclass(frozen=True)
class Analysis:
    """One probe: its arguments with their defaults, the tables it saves, and how to run it."""

    name: str
    args: dict[str, Any]
    run: Callable[..., pd.DataFrame | dict[str, pd.DataFrame]]
    tables: tuple[str, ...] = ()

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.tables or (self.name,)


B = BATCH_SIZE
ANALYSES: dict[str, Analysis] = {a.name: a for a in (
    Analysis("similarity", dict(batch_size=B, exclude_first=1, cka_batch=256, outlier_k=1), _single(run_similarity)),
    Analysis("causal", dict(batch_size=B, exclude_first=1, rule=None, future=True, cuts=None),
             _single(run_causal, with_progress=True)),
    Analysis("contrib", dict(batch_size=B, exclude_first=1, jacobian=True, probes=2), _single(run_contrib)),
    Analysis("routing", dict(exclude_first=1, long_range_k=4), _single(run_routing)),
    Analysis("sequence_profile", dict(batch_size=B, rule=None), _sequence_profile),
    Analysis("lens_logit", dict(batch_size=B), _lens_logit, ("lens_logit", "lens_logit_summary", "prediction_depth")),
    Analysis("lens_tuned", dict(batch_size=B, lens_steps=250, lens_tokens=65536, lens_lr=1e-3, seed=0), _lens_tuned,
             ("lens_tuned", "lens_tuned_summary", "prediction_depth_tuned")),
    Analysis("ablate_skip", dict(batch_size=B, rules=None), _ablate("skip")),
    Analysis("ablate_prune", dict(batch_size=B, rules=None, tau=0.05, max_prune_steps=None, prune="order"),
             _ablate("prune")),
    Analysis("ablate_swap", dict(batch_size=B, pairs="all", swap_pairs_max=SWAP_PAIRS_MAX), _ablate("swap")),
    Analysis("ablate_swap_adjacent", dict(batch_size=B, pairs="adjacent"), _ablate("swap")),
    Analysis("ablate_mean", dict(batch_size=B), _ablate("mean")),
    Analysis("ablate_linear", dict(batch_size=B), _ablate("linear")),
)}
# What `analyze` runs by default (swap: all pairs, or ablate_swap_adjacent with pairs="adjacent"; tuned lens on request).
SUITE = ("similarity", "causal", "contrib", "routing", "sequence_profile", "lens_logit", "ablate_skip",
         "ablate_prune", "ablate_swap")
WRITER = {table: a.name for a in ANALYSES.values() for table in a.outputs}  # table name -> the analysis saving it


def ablate_analysis(mode: str, pairs: str = "adjacent") -> str:
    """The analysis (and table) name of an `ablate --mode` run."""
    from depthtools.analysis.ablate import PAIRS, check_mode  # lazy

    check_mode(mode)
    if pairs not in PAIRS:
        raise DepthToolsError(f"unknown pairs {pairs!r}; valid: {', '.join(PAIRS)}")
    if mode == "swap":
        return "ablate_swap" if pairs == "all" else "ablate_swap_adjacent"
    return f"ablate_{mode}"


def check_prune(curve: str) -> str:
    """`curve` if it names a pruning curve (`ablate.PRUNE_CURVES`: order, greedy); else a one-line error."""
    from depthtools.analysis.ablate import check_prune as check  # lazy

    return check(curve)


# Every argument some analysis takes (not `pairs`: ablate_swap and ablate_swap_adjacent fix it by name).
OPTIONS = sorted({k for a in ANALYSES.values() for k in a.args} - {"pairs"})


def analysis_args(name: str, **options) -> dict[str, Any]:
    """The arguments of analysis `name`: its defaults, overridden by the options it takes (options only
    other analyses take are ignored, so one set of options serves a whole suite; unknown ones are an error)."""
    if name not in ANALYSES:
        raise DepthToolsError(f"unknown analysis {name!r}; valid: {', '.join(ANALYSES)}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise DepthToolsError(f"unknown analysis option(s) {unknown}; valid: {', '.join(OPTIONS)}")
    defaults = ANALYSES[name].args
    return {k: (options[k] if k in options and k != "pairs" else v) for k, v in defaults.items()}


def progress_total(name: str, model, args: dict[str, Any], skip_measured: bool = False) -> float | None:
    """The units a runner's progress callback advances by in total (plans, tuned-lens steps, or 1);
    `skip_measured`: the order prune finds its single-skip sweep saved (`skip_is_measured`)."""
    if name.startswith("ablate_"):
        from depthtools.analysis.ablate import n_plans  # lazy

        mode = name.split("_")[1]
        return n_plans(model, mode, args.get("pairs", "adjacent"), args.get("rules"), args.get("swap_pairs_max"),
                       args.get("prune", "order"), args.get("max_prune_steps"), skip_measured)
    if name == "lens_tuned":
        return args["lens_steps"]
    if name == "causal":
        return model.n_layer  # one step per skipped block
    return 1


@dataclass
class Result:
    """The tables of one analysis of one model, the settings they were saved with, and whether reused."""

    name: str
    tables: dict[str, pd.DataFrame]
    settings: dict[str, Any]
    reused: bool

    @property
    def table(self) -> pd.DataFrame:
        """The main table (the one named like the analysis)."""
        return self.tables[ANALYSES[self.name].outputs[0]]


def run_analysis(name: str, model, tokens, data: str | Path | None = None, recompute: bool = False,
                 save: bool = True, progress: Callable[[float], None] | None = None, **options) -> Result:
    """Run analysis `name` on a checkpoint's model, or reuse its tables saved with the same settings.

    `options` override the analysis' default arguments (those it does not take are ignored), so one
    set of command-line options serves every analysis. recompute=True ignores saved tables.
    """
    from depthtools.analysis.tables import cached  # lazy

    args = analysis_args(name, **options)
    analysis = ANALYSES[name]
    settings = table_settings(name, args, model, tokens)

    def compute() -> dict[str, pd.DataFrame]:
        out = analysis.run(model, tokens, Probe(data=data, progress=progress), **args)
        return out if isinstance(out, dict) else {name: out}

    tables, reused = cached(model.checkpoint_dir, analysis.outputs, settings, compute, recompute=recompute, save=save,
                            source=getattr(tokens, "source", None))
    return Result(name, tables, settings, reused)


# -- running the suite -------------------------------------------------------------------------------

@dataclass
class AnalyzeReport:
    """What `analyze_grid` did: counts, and one line per analysis that did not apply."""

    checkpoints: int = 0
    ran: int = 0
    reused: int = 0
    not_applicable: list[str] = field(default_factory=list)


def choose(only: str | list[str] | None, pairs: str = "all", tuned: bool = False) -> list[str]:
    """The analyses to run: `only` (a comma list or a list of ANALYSES names), else the SUITE (with the
    swap analysis of `pairs`, and lens_tuned when `tuned`)."""
    if only is None:
        swap = "ablate_swap" if pairs == "all" else ablate_analysis("swap", pairs)
        return [swap if n == "ablate_swap" else n for n in SUITE] + (["lens_tuned"] if tuned else [])
    chosen = [s for s in (only.replace(" ", "").split(",") if isinstance(only, str) else only) if s]
    if not chosen:
        raise DepthToolsError(f"--only {only!r} names no analysis; valid: {', '.join(ANALYSES)}")
    unknown = [s for s in chosen if s not in ANALYSES]
    if unknown:
        raise DepthToolsError(f"unknown analysis {unknown}; valid: {', '.join(ANALYSES)}")
    return chosen


def checkpoint_dirs(ckpts: list[str | Path] | None = None, grid: str | Path | None = None) -> list[Path]:
    """Checkpoint directories of --ckpt names/paths and of every checkpoint under --grid (in order, once each)."""
    from depthtools.analysis.tables import checkpoint_dirs as grid_dirs  # lazy
    from depthtools.checkpoint import resolve  # lazy

    if not ckpts and grid is None:
        raise DepthToolsError("give --ckpt NAME (repeatable) or --grid DIR")
    dirs = [Path(resolve(name)) for name in ckpts or []]
    if grid is not None:
        if not Path(grid).is_dir():
            raise DepthToolsError(f"--grid {grid} is not a directory")
        dirs += grid_dirs(grid)
    unique: dict[str, Path] = {}
    for d in dirs:
        unique.setdefault(str(d.resolve()), d)
    return list(unique.values())


def loaded_checkpoints(dirs: list[Path], data: str | Path | None, n_tokens: int, seq_len: int | None, split: str,
                       seed: int, *, cap: bool = False, train_tokens: int | None = None, device: str = "cpu",
                       dtype: str | None = None, skip: Callable[[DepthToolsError], None] | None = None):
    """Yield (ckpt_dir, model, tokens) for each checkpoint of `dirs`, loading one at a time: the loop of
    `analyze_grid` and of the probe commands.

    Each checkpoint's evaluation windows are drawn and checked against its config.json (data, tokenizer, split,
    length: `checkpoint_tokens`) before its weights are read, so a wrong --data costs no load; then the model
    is loaded, cast (`cast_model`) and given those windows (`probe_tokens`). `skip(exc)`: a checkpoint whose
    windows cannot be drawn is handed to it and left out (the CLI over several checkpoints); without it the
    error propagates. Errors of loading propagate in both cases."""
    from depthtools.checkpoint import load  # lazy

    for ckpt_dir in dirs:
        try:
            windows = checkpoint_tokens(ckpt_dir, data, n_tokens, seq_len, split, seed, cap, train_tokens=train_tokens)
        except DepthToolsError as exc:
            if skip is None:
                raise
            skip(exc)
            continue
        model = cast_model(load(ckpt_dir, device=device, dtype=check_dtype(dtype)), dtype)
        yield ckpt_dir, model, probe_tokens(model, data, n_tokens, seq_len, split, seed, tokens=windows)


def _train_tokens(names: list[str], options: dict[str, Any]) -> int | None:
    """The train-split tokens the tuned lens will draw, when it is among `names` (else None)."""
    return analysis_args("lens_tuned", **options)["lens_tokens"] if "lens_tuned" in names else None


RENAMED = {"swap_pairs": "pairs", "tuned_lens": "tuned", "force": "recompute"}  # analyze_grid arguments before issue 19


def analyze_grid(grid: str | Path | None = None, data: str | Path | None = None, n_tokens: int = N_TOKENS,
                 seq_len: int | None = None, split: str = "val", seed: int = 0, batch_size: int = BATCH_SIZE,
                 exclude_first: int = 1, only: str | list[str] | None = None, pairs: str = "all", tau: float = 0.05,
                 tuned: bool = False, recompute: bool = False, device: str = "cpu",
                 ckpts: list[str | Path] | None = None,
                 progress: Callable[[str, int, int], None] | None = None, dtype: str | None = None,
                 on_plan: Callable[[str], None] | None = None, cap: bool = False, **options) -> AnalyzeReport:
    """Run the suite over every checkpoint of a grid directory (and/or `ckpts`); tables saved with
    identical settings are reused.

    `progress(description, done, total)` is called before each analysis and once at the end.
    An analysis that does not apply to an architecture (e.g. linear ablation of a bank state) is
    recorded in `not_applicable`, not raised. `options` are further analysis arguments (lens_steps, ...).
    `dtype` casts each model for the analyses (`cast_model`); `on_plan(line)` receives each checkpoint's
    one-line cost plan (`plan`) before its analyses run, and any note on its evaluation windows. Each
    checkpoint's windows are drawn and checked against its config.json before its weights are loaded
    (`checkpoint_tokens`); `cap` takes fewer windows from a split shorter than `n_tokens` (`tokens.split_note`).
    """
    from depthtools.analysis.sweep import shared_sweeps  # lazy

    renamed = {old: new for old, new in RENAMED.items() if old in options}
    for old, new in renamed.items():
        warnings.warn(f"analyze_grid({old}=...) is deprecated; use {new}=...", DeprecationWarning, stacklevel=2)
    given = {new: options.pop(old) for old, new in renamed.items()}
    pairs, tuned, recompute = given.get("pairs", pairs), given.get("tuned", tuned), given.get("recompute", recompute)
    check_sizes(n_tokens, seq_len, batch_size)
    check_dtype(dtype)
    chosen = choose(only, pairs, tuned)
    dirs = checkpoint_dirs(ckpts, grid)
    report = AnalyzeReport(checkpoints=len(dirs))
    total, step = len(dirs) * len(chosen), 0
    options = dict(options, batch_size=batch_size, exclude_first=exclude_first, tau=tau)
    options.setdefault("seed", seed)
    for name in chosen:  # a bad option is an error here, not a "not applicable" line per checkpoint
        analysis_args(name, **options)
    for ckpt_dir, model, tokens in loaded_checkpoints(dirs, data, n_tokens, seq_len, split, seed, cap=cap,
                                                      train_tokens=_train_tokens(chosen, options), device=device,
                                                      dtype=dtype):
        if on_plan is not None:
            for note in tokens.notes:
                on_plan(f"note: {note}")
        planned = plan_run(chosen, model, tokens, recompute, shared_states=True, **options) \
            if on_plan is not None else None
        if planned is not None:
            on_plan(planned.line)
        with shared_sweeps():  # sequence_profile and ablate_skip's default rule: one sweep
            step = _analyze_checkpoint(ckpt_dir, chosen, model, tokens, data, recompute, options, report, planned,
                                       on_plan, progress, step, total)
    if progress is not None:
        progress("analyze: done", total, total)
    return report


def _analyze_checkpoint(ckpt_dir: Path, chosen: list[str], model, tokens, data, recompute: bool,
                        options: dict[str, Any], report: AnalyzeReport, planned: RunPlan | None,
                        on_plan: Callable[[str], None] | None, progress: Callable[[str, int, int], None] | None,
                        step: int, total: int) -> int:
    """The chosen analyses of one loaded checkpoint (`analyze_grid`'s inner loop); returns the step count."""
    for name in chosen:
        if progress is not None:
            progress(f"{ckpt_dir.name}: {name}", step, total)
        step += 1
        started = time.monotonic()
        try:
            result = run_analysis(name, model, tokens, data=data, recompute=recompute, **options)
        except DepthToolsError as exc:
            report.not_applicable.append(f"{ckpt_dir.name}: {name}: {exc}")
            continue
        if planned is not None and name in planned.forwards and not result.reused:
            _retime(planned, name, time.monotonic() - started, model, tokens, on_plan, options)
            planned = None  # once, after the first analysis that ran
        if result.reused:
            report.reused += 1
        else:
            report.ran += 1
    return step


def _retime(planned: RunPlan, name: str, seconds: float, model, tokens, on_plan: Callable[[str], None],
            options: dict[str, Any]) -> None:
    """After the first analysis: a corrected-ETA line when it took > 20% off its plan (`cost.retime_note`)."""
    from depthtools.analysis.cost import retime_note  # lazy

    names = list(planned.forwards)
    remaining = sum(planned.forwards[n] for n in names[names.index(name) + 1:])
    note = retime_note(model, tokens, options.get("batch_size", BATCH_SIZE), name, seconds, planned.forwards[name],
                       planned.forward_s, remaining)
    if note is not None:
        on_plan(note)


# -- reading saved tables, old names included ---------------------------------------------------------

LENS_SUMMARY_COLUMNS = ("pd_mean", "pd_mean_over_L", "pd_loss_spearman", "n_lens")  # merged by the old `lens`


def _saved(ckpt_dir: Path, name: str) -> tuple[pd.DataFrame | None, dict[str, Any]]:
    from depthtools.analysis.tables import load_settings, load_table  # lazy

    try:
        df = load_table(ckpt_dir, name)
    except DepthToolsError:
        return None, {}
    return df, (load_settings(ckpt_dir, name) or {}) if df is not None else {}


def _old_lens(ckpt_dir: Path, table: str) -> pd.DataFrame | None:
    """A lens table from the old `lens` command (`lens`, or `lens_tuned` with both lenses and the summary
    columns merged into the per-depth rows)."""
    from depthtools.analysis.lens import lens_progress  # lazy

    kind = "tuned" if table.startswith("lens_tuned") else "logit"
    for old in ("lens_tuned", "lens"):
        df, settings = _saved(ckpt_dir, old)
        if df is None or settings.get("analysis") != "lens" or "lens" not in df.columns:
            continue
        rows = df[df["lens"] == kind]
        if rows.empty:
            continue
        depths = rows.drop(columns=[c for c in LENS_SUMMARY_COLUMNS if c in rows.columns]).reset_index(drop=True)
        if not table.endswith("_summary"):
            return depths
        ids = [c for c in ("model", "arch", "n_layer", "d_model") if c in rows.columns]
        summary = rows.iloc[[0]][[*ids, "lens", *[c for c in LENS_SUMMARY_COLUMNS if c in rows.columns]]]
        com, n_lens = lens_progress(depths.sort_values("depth")["ce"].to_numpy())
        L = float(rows["n_layer"].iloc[0])
        return summary.assign(ce_final=float(depths.sort_values("depth")["ce"].iloc[-1]), progress_com=com,
                              n_lens_over_L=n_lens / L).reset_index(drop=True)
    return None


def _old_swap(ckpt_dir: Path, table: str) -> pd.DataFrame | None:
    """A swap table from the old `ablate` command (`ablate_swap`: the pairs it was run with;
    `ablate_swap_all`: all pairs) or from an old `analyze --swap-pairs adjacent`."""
    want = "all" if table == "ablate_swap" else "adjacent"
    for old in ("ablate_swap_all", "ablate_swap"):
        df, settings = _saved(ckpt_dir, old)
        if df is not None and settings.get("analysis") in ("ablate", "ablate_swap") and settings.get("pairs") == want:
            return df
    return None


def read_result(ckpt_dir: str | Path, table: str) -> pd.DataFrame | None:
    """A saved table by its current name, or None when absent or unreadable (no settings compared).

    A table is taken as what its name says only when its settings record the analysis that writes
    that name; tables saved under the old names (before the probe commands and `analyze` shared one
    naming scheme) are translated: old `lens` tables -> lens_logit / lens_tuned (+ _summary), old swap
    tables -> ablate_swap (all pairs) / ablate_swap_adjacent, old `ablate` tables of other modes as saved.
    """
    ckpt_dir = Path(ckpt_dir)
    writer = WRITER.get(table)
    df, settings = _saved(ckpt_dir, table)
    if writer is None:  # not a probe table (tasks_eval, ...): read as saved
        return df
    fixed_pairs = ANALYSES[writer].args.get("pairs")  # an old `analyze --swap-pairs adjacent` saved ablate_swap
    if df is not None and settings.get("analysis") == writer and settings.get("pairs") == fixed_pairs:
        return df
    if table in ("lens_logit", "lens_logit_summary", "lens_tuned", "lens_tuned_summary"):
        return _old_lens(ckpt_dir, table)
    if table in ("ablate_swap", "ablate_swap_adjacent"):
        return _old_swap(ckpt_dir, table)
    if df is not None and table.startswith("ablate_") and settings.get("analysis") == "ablate" \
            and settings.get("mode") == table.split("_", 1)[1]:
        return df
    return None
