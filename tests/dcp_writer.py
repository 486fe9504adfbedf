"""Write a DCP checkpoint from every rank of a CPU gloo group, as FSDP2 training does (tests/test_dcp.py).

Run under torchrun: `python -m torch.distributed.run --nproc_per_node=N tests/dcp_writer.py OUT [STATE]`. The model
entries are DTensors sharded by rows (FSDP's layout) and by columns, with sizes that do not divide evenly, a
replicated plain tensor (written once, by rank 0) and a bfloat16 tensor; beside them an optimizer section with
sharded moments, a step tensor and plain Python values (pickled bytes entries), as a trainer saves them.
`full_model()` gives the same model tensors whole, for the test to compare with. With STATE (a safetensors file)
the model entries are that file's tensors instead, every tensor of one or more dimensions sharded by rows (FSDP's
layout; fewer rows than ranks leave some ranks an empty shard), as a DepthBench run's model state is saved.
"""

from __future__ import annotations

import sys

import torch


def full_model() -> dict[str, torch.Tensor]:
    """The model state every rank shards: seeded, so the test can rebuild it."""
    gen = torch.Generator().manual_seed(44)
    return {
        "embeddings.weight": torch.randn(7, 6, generator=gen),  # 7 rows: uneven over 2, 3 and 4 ranks
        "blocks.0.attention.w_out.weight": torch.randn(6, 5, generator=gen),
        "blocks.0.attention_norm.weight": torch.randn(6, generator=gen),
        "lm_head.w_out.weight": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
    }


def sharded(full: dict[str, torch.Tensor], mesh) -> dict:
    """Rows sharded (FSDP), one weight by columns, the norm replicated as a plain tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "embeddings.weight": distribute_tensor(full["embeddings.weight"], mesh, [Shard(0)]),
        "blocks.0.attention.w_out.weight": distribute_tensor(full["blocks.0.attention.w_out.weight"], mesh, [Shard(1)]),
        "blocks.0.attention_norm.weight": full["blocks.0.attention_norm.weight"],
        "lm_head.w_out.weight": distribute_tensor(full["lm_head.w_out.weight"], mesh, [Shard(0)]),
    }


def optimizer(mesh) -> dict:
    """An optimizer section as a trainer saves it: sharded moments, a step tensor, plain values."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"state": {"embeddings.weight": {"exp_avg": distribute_tensor(torch.ones(7, 6), mesh, [Shard(0)]),
                                            "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["embeddings.weight"]}]}


def rows_sharded(state: dict[str, torch.Tensor], mesh) -> dict:
    """Every tensor of a state dict with at least one dimension sharded by rows; scalars replicated."""
    from torch.distributed.tensor import Shard, distribute_tensor

    return {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() else v for k, v in state.items()}


def main(out: str, state_file: str | None = None) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = rows_sharded(load_file(state_file), mesh) if state_file else sharded(full_model(), mesh)
    dcp.save({"model": model, "optim": optimizer(mesh)}, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
