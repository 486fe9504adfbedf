"""AdamW with the recipe's parameter groups, depth-μP/CompleteP rules, and pickle-free state.

Groups (TrainConfig.decay_groups): "depthtools" (default) decays matrices only; 1-D tensors (norm
gains, ReZero/LayerScale gains, biases) and names matching the scheme's `no_decay_names()` (HC/mHC
routing, AttnRes queries, DWA weights) get weight_decay 0. "depthbench" is DepthBench's grouping
(one OLMo-core AdamW group, wd on every parameter, plus a wd-0 override group for HC/mHC static
routing, `examples/hyper_connections_common.py`): every parameter decays except the names in the
scheme's `static_routing_names()`. For depthmup/completep the parameters inside blocks additionally get
LR × (L/L_base)^(a−1) and eps × (L/L_base)^(−a) (docs/reference/architectures.md §2.8; a and L_base
come from the model's options `depth_exponent` / `base_layers`, defaults as the architecture).

Each group carries `lr_scale`: the trainer sets group lr = peak lr × lr_scale × schedule(step).
`optimizer_tensors` / `load_optimizer_tensors` turn torch's optimizer state_dict into flat
tensors (for safetensors) plus JSON, and back, so a checkpoint never needs pickle.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from depthtools.arch.registry import get_arch
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import CheckpointError


def depth_scaling(cfg: ModelConfig) -> tuple[float, float] | None:
    """(block LR factor, block eps factor) = ((L/L_base)^(a−1), (L/L_base)^(−a)) for the architectures with the
    options depth_exponent a and base_layers L_base (depth-μP, CompleteP; their defaults live in the schema)."""
    spec = get_arch(cfg.arch)
    if "depth_exponent" not in spec.option_schema():
        return None
    opts = spec.options(cfg)
    ratio = cfg.n_layer / int(opts.base_layers)
    return ratio ** (float(opts.depth_exponent) - 1.0), ratio ** (-float(opts.depth_exponent))


def is_decayed(name: str, param: torch.Tensor, no_decay_names: tuple[str, ...]) -> bool:
    """Matrices decay; 1-D parameters and routing parameters named by the scheme do not."""
    return param.dim() >= 2 and not any(part in name for part in no_decay_names)


def is_decayed_depthbench(name: str, static_routing: tuple[str, ...]) -> bool:
    """DepthBench: every parameter decays except HC/mHC static routing (matched on the name's last part)."""
    return name.rsplit(".", 1)[-1] not in static_routing


def decay_rule(model: nn.Module, train_cfg: TrainConfig):
    """(name, param) -> whether AdamW decays it, under train_cfg.decay_groups."""
    if train_cfg.decay_groups == "depthbench":
        static = tuple(model.scheme.static_routing_names())
        return lambda name, param: is_decayed_depthbench(name, static)
    no_decay = tuple(model.scheme.no_decay_names())
    return lambda name, param: is_decayed(name, param, no_decay)


def param_groups(model: nn.Module, train_cfg: TrainConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """AdamW parameter groups and the parameter names in optimizer order (for state flattening)."""
    decayed_by = decay_rule(model, train_cfg)
    scaling = depth_scaling(model.config)
    buckets: dict[tuple[bool, bool], list[tuple[str, nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        in_block = scaling is not None and name.startswith("blocks.")
        buckets.setdefault((decayed_by(name, param), in_block), []).append((name, param))
    groups, names = [], []
    for (decayed, in_block), members in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1])):
        lr_scale, eps_scale = scaling if in_block else (1.0, 1.0)
        groups.append({
            "params": [p for _, p in members],
            "weight_decay": train_cfg.weight_decay if decayed else 0.0,
            "lr_scale": lr_scale,
            "lr": train_cfg.lr_for(model.config.arch) * lr_scale,
            "eps": train_cfg.eps * eps_scale,
            "group": f"{'decay' if decayed else 'no_decay'}{'/blocks' if in_block else ''}",
        })
        names += [n for n, _ in members]
    return groups, names


def build_optimizer(model: nn.Module, train_cfg: TrainConfig, device: torch.device) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over `param_groups` with PyTorch's fused kernel (CUDA and CPU).

    Why fused on CPU too: PyTorch's CPU default is the per-tensor loop, whose cost grows with the
    number of parameter tensors; the fused step is several times faster (benchmarks/RESULTS.md, fused
    AdamW; `python benchmarks/bench_speedups.py optimizer`). Same update rule.
    """
    groups, names = param_groups(model, train_cfg)
    optimizer = torch.optim.AdamW(
        groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps,
        weight_decay=train_cfg.weight_decay, fused=device.type in ("cuda", "cpu") or None,
    )
    return optimizer, names


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten `optimizer.state_dict()` into tensors keyed `optim/<param>/<key>` plus JSON-able groups."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"optim/{names[index]}/{key}"] = value
            else:
                scalars[f"{names[index]}/{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "param_names": names}


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, torch.Tensor],
                           meta: dict[str, Any]) -> None:
    """Inverse of `optimizer_tensors`: restore the optimizer's state in place."""
    if meta.get("param_names") != names:
        raise CheckpointError("optimizer state in train_state does not match the model's parameters")
    index_of = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            name, field = key[len("optim/"):].rsplit("/", 1)
            state.setdefault(index_of[name], {})[field] = value
    for key, value in meta.get("scalars", {}).items():
        name, field = key.rsplit("/", 1)
        state.setdefault(index_of[name], {})[field] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
