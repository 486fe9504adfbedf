"""Peak memory of `depthtools import` of a Hugging Face folder, in memory vs streamed (issue 45).

A random-weight Llama-shaped HF folder (default: TinyLlama's width, L8 d2048 ff5632 V32000, GQA 32/4 heads, untied:
0.48B parameters) is written as sharded bfloat16 safetensors, tensor by tensor (the layout `save_pretrained` writes).
It is imported twice, each import in its own child process under its own meter process, which prints the child's
peak RSS (`resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`): once in memory (`import_hf(stream=False)`: every tensor
read, cast to float32, the model built, one float32 model.safetensors) and once streamed (`stream=True`: one tensor
at a time into bf16 shards). The ratios to the model's float32 size are printed, and both checkpoints are checked
to load to the same float32 state, tensor by tensor.

    python benchmarks/bench_import_stream.py [--layers 8] [--d-model 2048] [--tmp /tmp/bench_import_stream]

Writes under --tmp and deletes it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def hf_folder(directory: Path, layers: int, d_model: int, d_ff: int, vocab: int, heads: int, kv_heads: int) -> int:
    """A random bf16 Llama folder (config.json + model-*.safetensors + index), written tensor by tensor; returns
    its parameter count."""
    import torch

    from depthtools.checkpoint import write_sharded
    from depthtools.fsutil import atomic_write_json

    hd = d_model // heads
    shapes = {"model.embed_tokens.weight": (vocab, d_model), "model.norm.weight": (d_model,),
              "lm_head.weight": (vocab, d_model)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d_model,), p + "post_attention_layernorm.weight": (d_model,),
                       p + "self_attn.q_proj.weight": (heads * hd, d_model),
                       p + "self_attn.k_proj.weight": (kv_heads * hd, d_model),
                       p + "self_attn.v_proj.weight": (kv_heads * hd, d_model),
                       p + "self_attn.o_proj.weight": (d_model, heads * hd),
                       p + "mlp.gate_proj.weight": (d_ff, d_model), p + "mlp.up_proj.weight": (d_ff, d_model),
                       p + "mlp.down_proj.weight": (d_model, d_ff)})
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape in shapes.items():
            if len(shape) == 1:
                yield name, (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
            else:
                yield name, (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)

    write_sharded(directory, tensors(), shard_bytes=1 << 30)
    atomic_write_json(directory / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": d_model,
        "intermediate_size": d_ff, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16"})
    return sum(torch.Size(s).numel() for s in shapes.values())


def child(folder: str, out: str, stream: bool) -> None:
    """Import `folder` into `out` (streamed or not); print JSON: seconds and the summary's notes."""
    from depthtools.interop import import_hf

    start = time.perf_counter()
    summary = import_hf(folder, out=out, stream=stream)
    print(json.dumps({"seconds": time.perf_counter() - start, "notes": summary["notes"]}))


def meter(folder: str, out: str, stream: bool) -> None:
    """Run one import child; print its JSON with the child's peak RSS (RUSAGE_CHILDREN: this meter's one child)."""
    args = [sys.executable, __file__, "--child", folder, "--out", out] + (["--stream"] if stream else [])
    done = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print(json.dumps(record))


def measure(folder: Path, out: Path, stream: bool) -> dict:
    args = [sys.executable, __file__, "--meter", str(folder), "--out", str(out)] + (["--stream"] if stream else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def same_state(a: Path, b: Path) -> int:
    """The two checkpoints load to the same float32 tensors (tensor by tensor, from their files); returns the count."""
    import torch
    from safetensors import safe_open

    from depthtools.checkpoint import weight_files

    files_a, files_b = weight_files(a), weight_files(b)
    assert set(files_a) == set(files_b), "different tensor names"
    for name in files_a:
        with safe_open(str(files_a[name]), framework="pt") as ha, safe_open(str(files_b[name]), framework="pt") as hb:
            x, y = ha.get_tensor(name).float(), hb.get_tensor(name).float()
        assert torch.equal(x, y), f"{name} differs"
    return len(files_a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child")
    parser.add_argument("--meter")
    parser.add_argument("--out")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--d-ff", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--tmp", default="/tmp/bench_import_stream")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.out, args.stream)
    if args.meter:
        return meter(args.meter, args.out, args.stream)
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        params = hf_folder(tmp / "hf", args.layers, args.d_model, args.d_ff, args.vocab, args.heads, args.kv_heads)
        f32 = 4 * params
        print(f"Llama L{args.layers} d{args.d_model} ff{args.d_ff} V{args.vocab}: {params / 1e9:.2f}B parameters, "
              f"bf16 folder {2 * params / 1e9:.2f} GB, float32 {f32 / 1e9:.2f} GB; load average {os.getloadavg()}")
        for stream in (False, True):
            record = measure(tmp / "hf", tmp / ("streamed" if stream else "memory"), stream)
            print(f"  {'streamed ' if stream else 'in memory'}: peak RSS {record['peak_rss'] / 1e9:.2f} GB "
                  f"= {record['peak_rss'] / f32:.2f} x float32 size, {record['seconds']:.1f} s; notes {record['notes']}")
        count = same_state(tmp / "memory", tmp / "streamed")
        print(f"  both checkpoints hold the same float32 values ({count} tensors); load average {os.getloadavg()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
