"""Save an upstream OLMo-core Transformer with OLMo-core's own checkpoint function (tests/test_olmo_core_e2e.py).

`upstream_config(style)` builds a tiny Llama- or OLMo-2-style `TransformerConfig` with OLMo-core's own config
classes. Run under torchrun (`python -m torch.distributed.run --nproc_per_node=2 tests/olmo_core_writer.py STYLE
STATE OUT`), every rank builds that model, loads the weights of STATE (a safetensors file the test wrote from its
reference model), shards it with FSDP2 over a CPU gloo mesh (so the tensors are really split between the ranks),
and saves it with an AdamW state through `olmo_core.distributed.checkpoint.save_model_and_optim_state`.
"""

from __future__ import annotations

import sys


def upstream_config(style: str):
    """A tiny OLMo-core TransformerConfig: "llama" (Llama-like, GQA) or "olmo2" (reordered norms, QK-norm)."""
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    common = dict(d_model=32, vocab_size=64, n_layers=2, n_heads=4, hidden_size_multiple_of=16, layer_norm_eps=1e-6)
    if style == "llama":
        return TransformerConfig.llama_like(**common, n_kv_heads=2)
    if style == "olmo2":
        return TransformerConfig.llama_like(**common, block_name=TransformerBlockType.reordered_norm, qk_norm=True)
    raise ValueError(style)


def main(style: str, state_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = upstream_config(style).build(init_device="cpu")
    model.load_state_dict(load_file(state_file))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_model_and_optim_state(out, model, optim)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
