"""The expert-routing part of the `routing` view (depthtools.analysis.experts) on imported MoE models, checked
against transformers' own router logits (output_router_logits=True), read through a plain per-token loop: expert
load, router entropy, and the top-k change when an earlier layer is made the identity in transformers' model.
Also: dense models get no expert rows, and the CLI prints the view."""

from __future__ import annotations

import math

import pytest
import torch
from test_families import VOCAB, build_hf
from test_family_probes import _identity_layer, hf_parts
from typer.testing import CliRunner

from cli.main import app
from depthtools.analysis.routing import routing_stats
from depthtools.interop import from_hf, import_hf

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")

N, T1, EXCLUDE = 3, 11, 1  # token set [N, T+1]; the view reads inputs [:, :-1], positions >= EXCLUDE


def token_set() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N, T1), generator=torch.Generator().manual_seed(11))


def reference_stats(router_logits, k: int, n_experts: int):
    """Per MoE layer: (expert load shares, mean router entropy, per-token top-k sets), by a plain loop over the
    tokens of transformers' [N*T, E] router logits (positions >= EXCLUDE)."""
    T = T1 - 1
    out = []
    for logits in router_logits:
        counts, entropy, sets, n = [0] * n_experts, 0.0, [], 0
        for row, values in enumerate(logits.tolist()):
            if row % T < EXCLUDE:
                continue
            top = max(values)
            weights = [math.exp(v - top) for v in values]
            total = sum(weights)
            p = [w / total for w in weights]
            entropy -= sum(q * math.log(q) for q in p if q > 0)
            chosen = frozenset(sorted(range(n_experts), key=lambda e: -p[e])[:k])
            for e in chosen:
                counts[e] += 1
            sets.append(chosen)
            n += 1
        out.append(([c / (n * k) for c in counts], entropy / n, sets))
    return out


@pytest.mark.parametrize("case", ["qwen2-moe-shared-dense", "mixtral-top2-window"])
def test_expert_routing_matches_transformers_router(tmp_path, case):
    hf = build_hf(case, tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    toks = token_set()
    df = routing_stats(ours, toks, exclude_first=EXCLUDE)
    k, E = ours.backbone.moe_top_k, ours.backbone.moe_experts
    moe_layers = [l for l in range(ours.n_layer) if ours.backbone.is_moe(l)]
    with torch.no_grad():
        intact = reference_stats(hf(toks[:, :-1], output_router_logits=True).router_logits, k, E)
    for l, (load, entropy, _) in zip(moe_layers, intact):
        rows = df[(df["metric"] == "expert_load") & (df["layer"] == l)].sort_values("expert")
        assert rows["value"].tolist() == pytest.approx(load, abs=1e-9)
        got = df[(df["metric"] == "router_entropy") & (df["layer"] == l)]["value"].item()
        assert got == pytest.approx(entropy, abs=1e-5)
        assert df[(df["metric"] == "expert_load_max") & (df["layer"] == l)]["value"].item() == pytest.approx(max(load) * E)
    layers, _, _ = hf_parts(hf)
    changes = []
    for s in range(ours.n_layer):
        handles = _identity_layer(layers[s])
        try:
            with torch.no_grad():
                skipped = reference_stats(hf(toks[:, :-1], output_router_logits=True).router_logits, k, E)
        finally:
            for handle in handles:
                handle.remove()
        for l, (_, _, sets) in zip(moe_layers, skipped):  # (the identity layer's own router still runs: l = s)
            if l <= s:
                continue
            expected = sum(a != b for a, b in zip(sets, intact[moe_layers.index(l)][2])) / len(sets)
            row = df[(df["metric"] == "routing_change_after_skip") & (df["layer"] == s) & (df["layer_j"] == l)]
            assert row["value"].item() == pytest.approx(expected, abs=1e-12), (s, l)
            changes.append(expected)
    assert max(changes) > 0  # skipping moves some routing (the comparison is not vacuous)
    assert df[df["metric"] == "routing_change_after_skip_mean"]["value"].item() == pytest.approx(
        sum(changes) / len(changes))


def test_dense_models_get_no_expert_rows(tmp_path):
    build_hf("llama-bias-gqa", tmp_path / "hf")
    df = routing_stats(from_hf(tmp_path / "hf"), token_set())
    assert df.empty and "no native depth routing" in df.attrs["notes"][0]


def test_routing_command_shows_the_expert_view(tmp_path):
    from test_family_cli import TEXT, tokenizer_json

    build_hf("olmoe-clip", tmp_path / "hf")
    tokenizer_json(tmp_path / "hf" / "tokenizer.json")
    import_hf(tmp_path / "hf", out=tmp_path / "ck")
    (tmp_path / "text.txt").write_text(TEXT, encoding="utf-8")
    result = CliRunner().invoke(app, ["routing", "--ckpt", str(tmp_path / "ck"), "--text", str(tmp_path / "text.txt"),
                                      "--n-tokens", "48", "--seq-len", "12"])
    assert result.exit_code == 0, result.output
    assert "expert routing per MoE block" in result.output and "router_entropy" in result.output
    assert "skipped" in result.output and "routing_change_after_skip_mean" in result.output
