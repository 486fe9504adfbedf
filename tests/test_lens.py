"""Logit lens, tuned lens and prediction depth (depthtools.analysis.lens)."""

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from depthtools.analysis import (
    TunedLens,
    fit_tuned_lens,
    lens_analysis,
    load_tuned_lens,
    logit_lens,
    prediction_depths,
    sample_windows,
    train_tuned_lens,
)
from depthtools.arch import DepthModel, list_archs
from depthtools.config import ModelConfig

from tiny_models import VOCAB, one_thread, tiny, windows  # noqa: F401 (fixture)

ARCHS = [spec.name for spec in list_archs()]
METRICS = ["ce", "kl_final_lens", "kl_lens_final", "entropy", "top1_agree", "top5_overlap", "target_rank"]


@pytest.mark.parametrize("arch", ARCHS)
def test_final_depth_lens_is_the_model_output(arch):
    model, toks = tiny(arch), windows()
    df = logit_lens(model, toks, batch_size=2, chunk_tokens=7)
    assert list(df["depth"]) == list(range(model.n_layer + 1)) and df["rel_depth"].iloc[-1] == 1.0
    final = df.iloc[-1]
    with torch.no_grad():
        logits = model(toks[:, :-1])[:, 1:]
    ce = F.cross_entropy(logits.flatten(0, 1), toks[:, 2:].flatten()).item()
    assert final["ce"] == pytest.approx(ce, rel=1e-10)
    assert final["kl_final_lens"] == 0 and final["kl_lens_final"] == 0
    assert final["top1_agree"] == 1 and final["top5_overlap"] == 1
    assert (df[METRICS[:4]] >= -1e-12).all().all() and (df["target_rank"] >= 1).all()


def test_chunking_and_batching_do_not_change_the_lens():
    model, toks = tiny("hc"), windows(5)
    a = logit_lens(model, toks, batch_size=5, chunk_tokens=4096)
    b = logit_lens(model, toks, batch_size=2, chunk_tokens=3)
    pd.testing.assert_frame_equal(a, b, rtol=1e-10)


def test_zero_translators_are_the_logit_lens():
    model, toks = tiny("preln"), windows()
    zero = TunedLens(model.n_layer, model.config.d_model)
    logit = lens_analysis(model, toks)
    tuned = lens_analysis(model, toks, zero)
    pd.testing.assert_frame_equal(logit.depths.drop(columns="lens"), tuned.depths.drop(columns="lens"))
    assert (tuned.depths["lens"] == "tuned").all()
    assert (logit.prediction_depth == tuned.prediction_depth).all()


def test_prediction_depth_is_the_start_of_the_stable_tail():
    top1 = torch.tensor([
        [7, 1, 7, 7],  # depth 0
        [7, 2, 3, 7],  # depth 1
        [7, 9, 7, 5],  # depth 2
        [7, 9, 7, 7],  # depth 3 = final
    ])
    assert prediction_depths(top1).tolist() == [0, 2, 2, 3]


def test_lens_summary_columns():
    model, toks = tiny("preln"), windows(4)
    result = lens_analysis(model, toks)
    row = result.summary.iloc[0]
    assert 0 <= row["pd_mean_over_L"] <= 1 and row["pd_mean"] == pytest.approx(result.prediction_depth.mean())
    assert len(result.prediction_depth) == len(result.token_loss) == 4 * 11
    tokens = result.tokens  # the per-token table `analyze` saves (prediction_depth.parquet)
    assert list(tokens.columns) == ["model", "arch", "n_layer", "d_model", "lens", "token", "prediction_depth", "loss"]
    assert (tokens["prediction_depth"].to_numpy() == result.prediction_depth).all()
    assert (tokens["loss"].to_numpy() == result.token_loss).all() and (tokens["lens"] == "logit").all()
    assert -1 <= row["pd_loss_spearman"] <= 1 or pd.isna(row["pd_loss_spearman"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Pre-LN model briefly trained on the fixture corpus, with train/val token sets."""
    from depthtools.data import prepare

    data = prepare(corpus="text-dir", text_dir="tests/fixtures/tiny_corpus", out_dir=tmp_path_factory.mktemp("data"))
    train = sample_windows(data, 100_000, 32, split="train", seed=0)
    val = sample_windows(data, 1024, 32, split="val", seed=0)
    model = DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=32, n_layer=4, n_heads=4, max_seq_len=64), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(120):
        batch = train[torch.randint(len(train), (16,), generator=gen)]
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), train, val


def test_trained_tuned_lens_beats_the_logit_lens_at_every_depth(trained, tmp_path):
    model, train, val = trained
    lens = fit_tuned_lens(model, train, tmp_path, steps=120, lr=1e-3, batch_size=16)
    logit = logit_lens(model, val)
    tuned = logit_lens(model, val, lens)
    L = model.n_layer
    assert (tuned["kl_final_lens"][:L].to_numpy() < logit["kl_final_lens"][:L].to_numpy()).all()
    assert tuned["kl_final_lens"].iloc[L] == 0
    assert all(p.requires_grad for p in model.parameters())  # the model was only frozen while training
    # saved beside the checkpoint and reused with the same settings; other settings retrain
    assert (tmp_path / "analysis" / "tuned_lens.safetensors").is_file()
    again = fit_tuned_lens(model, train, tmp_path, steps=120, lr=1e-3, batch_size=16)
    assert torch.equal(again.weight, lens.weight) and torch.equal(again.bias, lens.bias)
    assert load_tuned_lens(tmp_path, {"steps": 1}) is None
    other = fit_tuned_lens(model, train, tmp_path, steps=3, lr=1e-3, batch_size=16)
    assert not torch.equal(other.weight, lens.weight)


def test_tuned_lens_training_leaves_the_model_untouched():
    model, toks = tiny("attnres"), windows(4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lens = train_tuned_lens(model, toks, steps=3, batch_size=2)
    assert lens.weight.abs().sum() > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plot_helpers_return_axes():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from depthtools.analysis import ablate, plot_ablation, plot_lens, plot_prune_curve

    model, toks = tiny("preln"), windows()
    assert isinstance(plot_lens(logit_lens(model, toks), "ce"), Axes)
    assert isinstance(plot_ablation(ablate(model, toks, mode="skip")), Axes)
    assert isinstance(plot_prune_curve(ablate(model, toks, mode="prune", tau=float("inf"))), Axes)


def _old_lens_logits(model, rows, depth, translators, buffer=None):
    """The logit lens before issue 44: ln_final(readout(z_l)) through `readout_logits` (the reference); no buffer."""
    logits = model.readout_logits(rows)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _old_scored_rows(model, states, translators):
    return [model.readout(s)[:, 1:].flatten(0, 1) for s in states]


@pytest.mark.parametrize("arch", ARCHS)
def test_logit_lens_through_final_hidden_is_unchanged_where_a_readout_exists(arch, monkeypatch):
    """Issue 44: the logit lens decodes final_hidden(z_l); on every registered architecture (default
    options, float32 as the models are analysed) that is the old ln_final(readout(z_l)) bit for bit."""
    import depthtools.analysis.lens as lens

    model, toks = tiny(arch).float(), windows()
    # the full-vocabulary path on both sides: what is compared is the rows decoded (the chunked head's
    # rounding against a float64 log-softmax is tests/test_headmetrics.py's)
    new = lens.lens_analysis(model, toks, batch_size=2, chunk_tokens=7, chunked_head=False)
    monkeypatch.setattr(lens, "_scored_rows", _old_scored_rows)
    monkeypatch.setattr(lens, "_lens_logits", _old_lens_logits)
    old = lens.lens_analysis(model, toks, batch_size=2, chunk_tokens=7, chunked_head=False)
    pd.testing.assert_frame_equal(new.depths, old.depths, check_exact=True)
    assert (new.prediction_depth == old.prediction_depth).all() and (new.token_loss == old.token_loss).all()


@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_logit_lens_runs_on_a_normed_sum_head_and_ends_at_the_model_output(arch):
    """Issue 44: HC/mHC with readout "normed_sum" (DepthBench's head, Σ_s ln_final(H_s)) have no readout
    vector; the logit lens decodes the head itself, so at depth L it is the model's own output exactly,
    and each depth l is unembed(Σ_s ln_final(H_s)) of that depth's streams (computed by hand here)."""
    from depthtools.analysis.lens import _lens_logprobs, _scored_rows
    from depthtools.analysis.sweep import intact_states

    model, toks = tiny(arch, readout="normed_sum").float(), windows()
    result = lens_analysis(model, toks, batch_size=2, chunk_tokens=7)
    assert list(result.depths["depth"]) == list(range(model.n_layer + 1))
    with torch.no_grad():
        own = F.log_softmax(model(toks[:, :-1])[:, 1:].flatten(0, 1), dim=-1)
        states = intact_states(model, toks[:, :-1])
        rows = _scored_rows(model, states, None)
        assert torch.equal(_lens_logprobs(model, rows[-1], model.n_layer, None), own)
        by_hand = model.unembed(sum(model.ln_final(states[1][..., s, :]) for s in range(states[1].shape[-2])))
        assert torch.allclose(_lens_logprobs(model, rows[1], 1, None),
                              F.log_softmax(by_hand[:, 1:].flatten(0, 1), dim=-1), atol=1e-6)
    ce = F.cross_entropy(own, toks[:, 2:].flatten()).item()
    final = result.depths.iloc[-1]
    assert final["ce"] == pytest.approx(ce, rel=1e-6) and final["kl_final_lens"] == 0 and final["top1_agree"] == 1


def test_tuned_lens_refuses_a_normed_sum_head_in_one_line():
    """Its translators act on readout(z_l), which a normed_sum head does not have: one line naming why."""
    from depthtools.errors import DepthToolsError

    model, toks = tiny("hc", n_layer=2, readout="normed_sum").float(), windows()
    for call in (lambda: train_tuned_lens(model, toks, steps=1),
                 lambda: lens_analysis(model, toks, TunedLens(model.n_layer, model.config.d_model))):
        with pytest.raises(DepthToolsError, match=r"tuned lens.*hc with readout='normed_sum'") as err:
            call()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["preln", "hc", "attnres"])
@pytest.mark.parametrize("tuned", [False, True])
def test_chunked_head_lens_equals_the_full_vocabulary_lens(arch, tuned):
    """Issue 45/47: the lens through the vocabulary-chunked head (`headmetrics`, chunks of 64 ids here so
    a tiny vocabulary spans several) gives every per-depth metric of the full [rows, V] log-softmax path
    (float64 models: to 1e-9; the rank and the top-1/top-5 agreement exactly), and the same prediction depths."""
    import depthtools.analysis.headmetrics as hm
    import depthtools.analysis.lens as lens
    from depthtools.analysis.lens import LENS_METRICS

    model, toks = tiny(arch), windows()
    translators = None
    if tuned:
        translators = lens.TunedLens(model.n_layer, model.config.d_model).double()
        with torch.no_grad():
            translators.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    chunk = hm.CHUNK
    hm.CHUNK = 64
    try:
        new = lens.lens_analysis(model, toks, translators, batch_size=2, chunk_tokens=7, chunked_head=True)
    finally:
        hm.CHUNK = chunk
    old = lens.lens_analysis(model, toks, translators, batch_size=2, chunk_tokens=7, chunked_head=False)
    for metric in LENS_METRICS:
        assert (new.depths[metric] - old.depths[metric]).abs().max() < 1e-9, metric
    for metric in ("top1_agree", "top5_overlap", "target_rank"):
        assert new.depths[metric].equals(old.depths[metric]), metric
    assert (new.prediction_depth == old.prediction_depth).all()
