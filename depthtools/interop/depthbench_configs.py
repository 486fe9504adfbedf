"""DepthBench's model configs (`configs/*.json` of keyu-wang-2002/DepthBench) as grid cells: `grid plan --from-depthbench`.

DepthBench describes each shape as a Llama-style JSON (hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size, vocab_size 50280, max_sequence_length 2048, rope_theta,
rms_norm_eps, tie_word_embeddings). Reading those files gives a grid of our architectures at exactly DepthBench's
shapes, so its numbers and ours compare cell by cell. Each file's keys are checked: an unknown shape key or
a value of the wrong type is one line naming the file and the key; keys that describe DepthBench's own block
(block_name, attnres_*, ...) are reported, not applied: the architectures are the plan's `--arch`.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Iterable

from depthtools.arch import canonical_name
from depthtools.arch.registry import baseline_config
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError
from depthtools.fsutil import read_json_object
from depthtools.grid import Cell, cell_name, count_params, parse_seeds

# DepthBench key -> (ModelConfig field, JSON type); all but the optional ones must be present.
SHAPE_KEYS = {"hidden_size": ("d_model", int), "num_hidden_layers": ("n_layer", int),
              "num_attention_heads": ("n_heads", int), "intermediate_size": ("d_ff", int),
              "vocab_size": ("vocab_size", int)}
OPTIONAL_KEYS = {"num_key_value_heads": ("n_kv_heads", int), "max_sequence_length": ("max_seq_len", int),
                 "max_position_embeddings": ("max_seq_len", int), "rope_theta": ("rope_theta", (int, float)),
                 "rms_norm_eps": ("norm_eps", (int, float)), "tie_word_embeddings": ("tie_embeddings", bool)}
# Keys that do not change the shape we train: HF bookkeeping and the Llama constants our `preln` already has.
IGNORED_KEYS = {"architectures", "model_type", "transformers_version", "torch_dtype", "use_cache", "bos_token_id",
                "eos_token_id", "pad_token_id", "initializer_range", "attention_bias", "hidden_act", "head_dim"}
CONSTANTS = {"hidden_act": "silu", "attention_bias": False}


def _typed(value: Any, kind, file: Path, key: str) -> Any:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise DepthToolsError(f"{file}: {key}={value!r} is not {getattr(kind, '__name__', 'a number')}")
    return value


def read_depthbench_config(file: str | Path) -> tuple[dict[str, Any], list[str]]:
    """(ModelConfig fields, notes) of one DepthBench config file; refusals name the file and the key."""
    file = Path(file)
    raw = read_json_object(file, "a DepthBench model config", DepthToolsError)
    missing = [k for k in SHAPE_KEYS if k not in raw]
    if missing:
        raise DepthToolsError(f"{file} lacks {missing}; a DepthBench model config (configs/*.json) states them all")
    fields = {ours: _typed(raw[key], kind, file, key) for key, (ours, kind) in SHAPE_KEYS.items()}
    for key, (ours, kind) in OPTIONAL_KEYS.items():
        if raw.get(key) is not None:
            fields[ours] = _typed(raw[key], kind, file, key)
    for key, value in CONSTANTS.items():
        if key in raw and raw[key] != value:
            raise DepthToolsError(f"{file}: {key}={raw[key]!r} is not expressible (our blocks have {key}={value!r})")
    if raw.get("head_dim") is not None and raw["head_dim"] * fields["n_heads"] != fields["d_model"]:
        raise DepthToolsError(f"{file}: head_dim={raw['head_dim']!r} × num_attention_heads={fields['n_heads']} is not "
                              f"hidden_size={fields['d_model']}")
    block = sorted(k for k in raw if k not in SHAPE_KEYS and k not in OPTIONAL_KEYS and k not in IGNORED_KEYS)
    notes = [f"{file.name}: {', '.join(f'{k}={raw[k]!r}' for k in block)} not applied (DepthBench's block "
             "settings; the architectures are --arch)"] if block else []
    return fields, notes


def depthbench_cells(files: Iterable[str | Path], archs: Iterable[str], seeds: Iterable[int] | None = None,
                     basis: str = "total") -> tuple[list[Cell], list[str]]:
    """(cells, notes): one cell per (architecture, DepthBench config file, seed) at exactly the file's shape.

    `deviation` is measured against the median parameter count (on `basis`) of the architecture's cells, as a
    planned grid's is against its budget. Two files of one depth are refused (they would be one cell name)."""
    files = [Path(f) for f in files]
    if not files:
        raise DepthToolsError("give at least one DepthBench config file (configs/*.json)")
    read = [read_depthbench_config(f) for f in files]
    notes = [n for _, file_notes in read for n in file_notes]
    key = "total" if basis == "total" else "non_embedding"
    cells = []
    for arch in (canonical_name(a) for a in archs):
        shaped = []
        for file, (fields, _) in zip(files, read):
            try:
                cfg = ModelConfig(arch=arch, **fields)
            except DepthToolsError as exc:
                raise DepthToolsError(f"{file}: {exc}") from None
            shaped.append((file, cfg, count_params(cfg)))
        depths = [cfg.n_layer for _, cfg, _ in shaped]
        twice = sorted({d for d in depths if depths.count(d) > 1})
        if twice:
            raise DepthToolsError(f"DepthBench configs {[str(f) for f, c, _ in shaped if c.n_layer in twice]} share "
                                  f"depth {twice[0]}: one grid has one cell per (architecture, depth)")
        middle = statistics.median(counts[key] for _, _, counts in shaped)
        for file, cfg, counts in shaped:
            baseline = baseline_config(cfg)  # Pre-LN of this shape (the cell itself for a Pre-LN cell)
            preln = counts["total"] if baseline is cfg else count_params(baseline)["total"]
            for seed in parse_seeds(seeds):
                cells.append(Cell(
                    name=cell_name(arch, cfg.n_layer, seed), arch=arch, n_layer=cfg.n_layer, d_model=cfg.d_model,
                    n_heads=cfg.n_heads, head_dim=cfg.head_dim, d_ff=cfg.d_ff, params_total=counts["total"],
                    params_non_embedding=counts["non_embedding"], params_extra=counts["total"] - preln,
                    deviation=(counts[key] - middle) / middle, aspect_ratio=cfg.d_model / cfg.n_layer,
                    model=cfg.to_dict(), seed=seed))
    return cells, notes


__all__ = ["read_depthbench_config", "depthbench_cells", "SHAPE_KEYS", "OPTIONAL_KEYS"]
