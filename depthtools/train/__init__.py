"""The trainer: one cell (`train_cell`) or a whole grid (`train_grid`), with exact resume.

    train_cell(model_cfg, TrainConfig(tokens=60_000), "data/default", "checkpoints/g/preln_L4")
    train_grid("grid.json", root="checkpoints")
    train_grid(get_preset("tiny").grid_spec())

Recipe: `depthtools.config.TrainConfig`. Schedules: `lr_multiplier`. FLOPs/MFU: `flops_per_token`.
"""

from depthtools.config import TrainConfig
from depthtools.train.flops import flops_per_token
from depthtools.train.launch import dry_run, launch_local, launch_ray, submit_cells
from depthtools.train.loop import CellFinishedError, TrainingDivergedError, held_checkpoint, is_finished, train_cell
from depthtools.train.optim import depth_scaling, param_groups
from depthtools.train.schedule import lr_multiplier
from depthtools.train.sweep import grid_status, run_cell, train_grid

__all__ = [
    "CellFinishedError", "TrainConfig", "TrainingDivergedError", "depth_scaling", "flops_per_token",
    "dry_run", "grid_status", "held_checkpoint", "is_finished", "launch_local", "launch_ray", "lr_multiplier", "param_groups",
    "run_cell", "submit_cells", "train_cell", "train_grid",
]
