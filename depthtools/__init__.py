"""depthtools: does extra depth become extra computation?

Notebook entry points (each returns plain objects or tidy DataFrames):
    ModelConfig, DepthModel, Plan, build_model, list_archs  -- the architecture zoo
    plan_grid                                               -- iso-parameter grid planner
    load, save                                              -- safetensors + JSON checkpoints
    TrainConfig, train_cell, train_grid                     -- the trainer (one cell, a whole grid)
    analyze_grid, summarize_grid                            -- the depth-probe suite over a grid
    grid_report, model_report                               -- self-contained HTML reports
Probes live in depthtools.analysis.* (lens, ablate, causal, geometry, contrib, routing, summary).
"""

import importlib

from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import CheckpointError, DepthToolsError

__version__ = "0.1.0"

# Everything that needs torch is imported on first use, so `import depthtools` and the torch-free
# subpackages (depthtools.data: `data prepare` and its worker processes) do not pay torch's and
# TransformerLens' ~4 s import.
_LAZY = {
    "DepthModel": "depthtools.arch", "Plan": "depthtools.arch", "build_model": "depthtools.arch",
    "get_arch": "depthtools.arch", "list_archs": "depthtools.arch",
    "load": "depthtools.checkpoint", "save": "depthtools.checkpoint", "plan_grid": "depthtools.grid",
    "train_cell": "depthtools.train", "train_grid": "depthtools.train",
    "analyze_grid": "depthtools.analysis.suite", "summarize_grid": "depthtools.analysis.summary",
    "grid_report": "depthtools.report", "model_report": "depthtools.report",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'depthtools' has no attribute {name!r}")


__all__ = [
    "CheckpointError", "DepthModel", "DepthToolsError", "ModelConfig", "Plan", "TrainConfig",
    "build_model", "get_arch", "list_archs", "load", "plan_grid", "save", *_LAZY, "__version__",
]
