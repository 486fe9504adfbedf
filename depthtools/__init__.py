"""depthtools: does extra depth become extra computation?

Notebook entry points (each returns plain objects or tidy DataFrames):
    ModelConfig, DepthModel, Plan, build_model, list_archs  -- the architecture zoo
    plan_grid                                               -- iso-parameter grid planner
    load, save                                              -- safetensors + JSON checkpoints
"""

from depthtools.arch import DepthModel, Plan, build_model, get_arch, list_archs
from depthtools.config import ModelConfig
from depthtools.errors import CheckpointError, DepthToolsError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "DepthModel", "DepthToolsError", "ModelConfig", "Plan",
    "build_model", "get_arch", "list_archs", "__version__",
]
