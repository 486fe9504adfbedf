"""Hugging Face Llama interop: import parity with transformers, export round trip, tokenizers,
probes on imported checkpoints, refusals, CLI. Real transformers models, built locally (no hub)."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may download
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.interop import export_hf, from_hf, import_hf

from tiny_models import one_thread, prepare_tiny  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
runner = CliRunner()


# -- builders --------------------------------------------------------------------------------------
def hf_llama(directory: Path, kv_heads: int = 4, tied: bool = False, theta: float = 10000.0, layers: int = 3,
             seed: int = 0) -> LlamaForCausalLM:
    """A random tiny LlamaForCausalLM, every weight moved off its init (norm gains too), saved as safetensors."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, rope_theta=theta,
                      max_position_embeddings=64, tie_word_embeddings=tied, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def perturbed_preln(**overrides) -> DepthModel:
    cfg = ModelConfig(**{**dict(arch="preln", vocab_size=256, d_model=64, n_layer=3, n_heads=4, max_seq_len=64),
                         **overrides})
    model = DepthModel(cfg, seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


@contextmanager
def captured_hf_messages():
    """Everything transformers logs (its load report) and every Python warning, as one list of strings."""
    stream, logger = io.StringIO(), logging.getLogger("transformers")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING)  # another library may have silenced transformers earlier in the session
    messages: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
            messages.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        messages.extend(stream.getvalue().splitlines())


def load_hf(directory: Path):
    with captured_hf_messages() as messages:
        model, info = LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    bad = [m for m in messages if "missing" in m.lower() or "unexpected" in m.lower()]
    return model.eval(), info, bad


def tokens(n=2, t=40, vocab=256, seed=0):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


# -- import: our logits equal transformers' ------------------------------------------------------------
@pytest.mark.parametrize("kv_heads,tied,theta", [(4, False, 10000.0), (2, False, 500000.0), (4, True, 10000.0),
                                                 (1, True, 123456.0)],
                         ids=["mha-untied", "gqa-untied-theta5e5", "mha-tied", "mqa-tied-theta"])
def test_imported_model_matches_transformers_logits(tmp_path, kv_heads, tied, theta):
    hf = hf_llama(tmp_path / "hf", kv_heads=kv_heads, tied=tied, theta=theta)
    ours = from_hf(tmp_path / "hf")
    cfg = ours.config
    assert (cfg.arch, cfg.n_kv_heads, cfg.tie_embeddings, cfg.rope_theta, cfg.norm_eps) == ("preln", kv_heads, tied, theta, 1e-5)
    x = tokens()
    with torch.no_grad():
        theirs, mine = hf(x).logits, ours(x)
    assert mine.dtype == torch.float32 and mine.shape == theirs.shape == (2, 40, 256)
    assert theirs.abs().max() > 0.5  # not a trivially small signal
    assert (mine - theirs).abs().max().item() <= TOL
    if tied:
        assert ours.unembed.weight is ours.tok_embed.weight


def test_long_sequence_gap_is_transformers_float32_rope_and_ours_is_closer_to_exact(tmp_path):
    """The logit gap at long T comes from transformers' float32 RoPE angles alone: with those tables our
    model is bit-identical to theirs, and with our float64 tables it is closer to a float64 run."""
    import copy

    hf = hf_llama(tmp_path / "hf", kv_heads=2, layers=2)
    with torch.no_grad():
        for layer in hf.model.layers:  # sharp attention, as trained models have: RoPE errors show
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    T = 512
    ours = from_hf(tmp_path / "hf", max_seq_len=T)
    hd, theta = ours.config.head_dim, ours.config.rope_theta
    x = tokens(n=1, t=T)
    angles64 = torch.outer(torch.arange(T, dtype=torch.float64),
                           1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles32 = torch.outer(torch.arange(T).float(), 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))
    exact = copy.deepcopy(ours).double()
    exact.rope_cos, exact.rope_sin = angles64.cos(), angles64.sin()
    as_hf = copy.deepcopy(ours)
    as_hf.rope_cos, as_hf.rope_sin = angles32.cos(), angles32.sin()
    with torch.no_grad():
        theirs, mine, reference = hf(x).logits, ours(x), exact(x)
        assert torch.equal(as_hf(x), theirs)
    ours_err, theirs_err = (mine - reference).abs().max().item(), (theirs - reference).abs().max().item()
    assert theirs_err > 2e-5 and ours_err < theirs_err / 2, (ours_err, theirs_err)


def test_rope_pairing_is_hf_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from depthtools.arch.layers import apply_rope, rope_tables

    q, k = torch.randn(2, 7, 3, 16), torch.randn(2, 7, 3, 16)
    cos, sin = rope_tables(16, 7, 10000.0)
    full_cos, full_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # HF: [B,T,hd]
    hq, hk = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), full_cos, full_sin)
    assert torch.allclose(apply_rope(q, cos, sin), hq.transpose(1, 2), atol=1e-6)
    assert torch.allclose(apply_rope(k, cos, sin), hk.transpose(1, 2), atol=1e-6)


# -- Mistral's sliding window: what transformers does, or a refusal ------------------------------------------
def hf_mistral(directory: Path, config_edits: dict, drop: tuple[str, ...] = ()) -> Path:
    """A random tiny MistralForCausalLM saved as safetensors, its config.json then edited as a user's would be."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                        sliding_window=None)
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    config = {k: v for k, v in {**config, **config_edits}.items() if k not in drop}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def mistral_logits(directory: Path, x: torch.Tensor):
    from transformers import MistralForCausalLM

    model = MistralForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model.config.sliding_window, model(x).logits


def test_mistral_window_is_applied_as_transformers_does(tmp_path):
    x = tokens(t=40)
    # a window with use_sliding_window false: transformers' Mistral never reads the flag, the window applies
    windowed = hf_mistral(tmp_path / "w16", {"sliding_window": 16, "use_sliding_window": False})
    window, theirs = mistral_logits(windowed, x)
    assert window == 16
    ours = from_hf(windowed)  # context 64 > window 16: a banded causal mask, exact
    assert ours.config.options["sliding_window"] == 16
    with torch.no_grad():
        assert (ours(x) - theirs).abs().max().item() <= TOL
    # the same weights with full attention ("sliding_window": null) differ beyond the window
    full = hf_mistral(tmp_path / "full", {"sliding_window": None, "use_sliding_window": False})
    window, theirs_full = mistral_logits(full, x)
    assert window is None and "sliding_window" not in from_hf(full).config.options
    with torch.no_grad():
        assert (from_hf(full)(x) - theirs_full).abs().max().item() <= TOL
    assert (theirs[:, :16] - theirs_full[:, :16]).abs().max().item() <= 1e-5
    assert (theirs[:, 16:] - theirs_full[:, 16:]).abs().max().item() > 1e-2  # the window matters


def test_mistral_without_a_window_key_gets_transformers_default(tmp_path):
    from depthtools.interop.llama import MISTRAL_DEFAULT_SLIDING_WINDOW

    absent = hf_mistral(tmp_path / "absent", {}, drop=("sliding_window",))
    assert "sliding_window" not in json.loads((absent / "config.json").read_text())
    x = tokens(t=64)
    window, theirs = mistral_logits(absent, x)
    assert window == MISTRAL_DEFAULT_SLIDING_WINDOW == 4096  # transformers' own default, not ours
    with torch.no_grad():
        assert (from_hf(absent)(x) - theirs).abs().max().item() <= TOL
    assert from_hf(absent, max_seq_len=4097).config.options["sliding_window"] == 4096


def test_llama_ignores_sliding_window_keys_as_transformers_does(tmp_path):
    hf_llama(tmp_path / "hf", layers=2)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "sliding_window": 8, "use_sliding_window": True}))
    theirs, _, _ = load_hf(tmp_path / "hf")
    x = tokens()
    with torch.no_grad():
        assert (from_hf(tmp_path / "hf")(x) - theirs(x).logits).abs().max().item() <= TOL


# -- export: round trip through transformers -----------------------------------------------------------
@pytest.fixture(scope="module")
def trained_ckpt(data_dir, tmp_path_factory) -> Path:
    """A trained tiny preln cell (GQA, untied), byte tokenizer recorded in its config.json."""
    from depthtools.train import train_cell

    out = tmp_path_factory.mktemp("ckpt") / "preln_L2"
    recipe = TrainConfig(tokens=6 * 8 * 32, batch_size=8, seq_len=32, lr=1e-2, eval_tokens=256, log_every=10,
                         eval_every=0, depth_stats_every=0, checkpoint_every=0, threads=1)
    cfg = ModelConfig(arch="preln", vocab_size=256, d_model=64, n_layer=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    train_cell(cfg, recipe, data_dir, out)
    return out


@pytest.fixture(scope="module")
def exported(trained_ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    summary = export_hf(trained_ckpt, out)
    assert summary["tokenizer"]["kind"] == "byte" and summary["notes"] == []
    return out


def _assert_round_trip(ckpt_dir: Path, out: Path, tmp_path: Path):
    ours = ck.load(ckpt_dir)
    hf, info, bad = load_hf(out)
    assert bad == [] and not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    x = tokens(vocab=ours.config.vocab_size)
    with torch.no_grad():
        diff = (hf(x).logits - ours(x)).abs().max().item()
    assert diff <= TOL
    back = ck.load(import_hf(out, out=tmp_path / "back")["checkpoint"])
    assert back.config == ours.config
    mine, theirs = ck.model_state(ours), ck.model_state(back)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in mine)


def test_trained_checkpoint_round_trips_through_transformers(trained_ckpt, exported, tmp_path):
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {p.name for p in exported.iterdir()}
    _assert_round_trip(trained_ckpt, exported, tmp_path)
    # the re-imported checkpoint carries the exported tokenizer, and exports it again unchanged
    back = tmp_path / "back"
    assert ck.read_config(back)["tokenizer"]["format"] == "huggingface" and (back / "tokenizer.json").is_file()
    again = export_hf(back, tmp_path / "again")
    assert again["tokenizer"]["kind"] == "huggingface" and again["tokenizer"]["special_ids"]["eos_token_id"] == 0
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (exported / "tokenizer.json").read_bytes()
    assert AutoTokenizer.from_pretrained(tmp_path / "again")("héllo").input_ids == list("héllo".encode())
    with pytest.raises(DepthToolsError, match="would replace the checkpoint"):
        export_hf(back, back, force=True)
    # the capture above does see a load report: a copy with a dropped and an extra weight is flagged
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.extra.weight"] = weights.pop("model.norm.weight").clone()
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    _, info, bad = load_hf(broken)
    assert info["missing_keys"] and bad and any("missing" in m.lower() for m in bad)


def test_tied_random_checkpoint_round_trips(tmp_path):
    model = perturbed_preln(tie_embeddings=True, n_kv_heads=1, rope_theta=2.5e5, norm_eps=1e-6)
    ck.save(model, tmp_path / "preln_tied")
    summary = export_hf(tmp_path / "preln_tied", tmp_path / "hf")
    assert summary["tokenizer"]["kind"] == "byte" and "no tokenizer recorded" in summary["notes"][0]
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] is True and hf_config["num_key_value_heads"] == 1
    _assert_round_trip(tmp_path / "preln_tied", tmp_path / "hf", tmp_path)


def test_exported_byte_tokenizer_round_trips_text_and_drives_generate(exported, trained_ckpt):
    for text in ("héllo", "plain ascii, 日本語 and 🙂", "Ā is U+0100", "sep\x00inside", "<|endoftext|>"):
        ids = list(text.encode("utf-8"))
        fast = PreTrainedTokenizerFast(tokenizer_file=str(exported / "tokenizer.json"), split_special_tokens=True)
        assert fast(text).input_ids == ids and fast.decode(ids) == text
    tok = AutoTokenizer.from_pretrained(exported)
    assert tok("héllo").input_ids == list("héllo".encode()) and tok.decode(tok("héllo").input_ids) == "héllo"
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0
    assert tok.decode([104, 0, 105], skip_special_tokens=True) == "hi"
    hf = LlamaForCausalLM.from_pretrained(exported).eval()
    prompt = tok("To be, or not", return_tensors="pt")
    out = hf.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > prompt.input_ids.shape[1] and torch.equal(out[0, :13], prompt.input_ids[0])
    ours = ck.load(trained_ckpt)
    with torch.no_grad():
        assert int(ours(prompt.input_ids)[0, -1].argmax()) == int(out[0, 13])  # same greedy next token
    assert isinstance(tok.decode(out[0], skip_special_tokens=True), str)


def test_bpe_tokenizer_is_carried_and_fingerprint_checked(tmp_path):
    from depthtools.data import load_tokenizer, read_meta

    data = prepare_tiny(tmp_path / "data", tokenizer="bpe4k")
    meta, bpe = read_meta(data), load_tokenizer(data)
    model = perturbed_preln(vocab_size=bpe.vocab_size, n_layer=1)
    extra = {"tokenizer": meta["tokenizer"], "data": {"path": str(data)}}
    ck.save(model, tmp_path / "preln_bpe", extra=extra)
    summary = export_hf(tmp_path / "preln_bpe", tmp_path / "hf")
    assert summary["tokenizer"]["kind"] == "bpe"
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Shall I compare thee to a summer's day? <|endoftext|> héllo"
    assert tok(text).input_ids == bpe.encode(text) and tok.decode(bpe.encode(text)) == bpe.decode(bpe.encode(text))
    assert tok.eos_token_id == bpe.sep_id == json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]
    ck.save(model, tmp_path / "preln_bad", extra={**extra, "tokenizer": {**meta["tokenizer"], "fingerprint": "0" * 64}})
    with pytest.raises(DepthToolsError, match="not the tokenizer this checkpoint was trained with"):
        export_hf(tmp_path / "preln_bad", tmp_path / "hf2")


def _user_tokenizer(folder: Path, texts: list[str], specials: list[str], bos_template: str | None = None) -> Path:
    """A user's own byte-level BPE tokenizer.json (trained here, no download): `specials` take ids 0.. in order;
    bos_template adds a Llama-style post-processor that prepends that token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos_template} $A", special_tokens=[
            (bos_template, specials.index(bos_template))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


USER_TEXTS = [f"doc {i}: the depth of a model is the number of blocks {i * 7} and its width"
              + ("; a literal </s> <s> <|endoftext|> in Grüße 東京" if i % 3 == 0 else "") for i in range(120)]


@pytest.mark.parametrize("specials,bos_template,sep,sep_id", [
    (["<unk>", "<s>", "</s>"], "<s>", "</s>", 2),  # Llama-2 style: separator </s> = 2, a post-processor adding <s>
    (["<|endoftext|>", "<|padding|>"], None, "<|endoftext|>", 0),  # GPT-NeoX/OLMo style: <|endoftext|> = 0
])
def test_user_tokenizer_export_uses_the_separator_the_data_used(tmp_path, specials, bos_template, sep, sep_id):
    """Data prepared with the user's tokenizer.json, a trained cell, export: AutoTokenizer gives depthtools' ids
    and its bos/eos/pad are the document separator of the training data (before: a Llama-style file exported
    with no bos/eos at all, a prepended <s> and literal "</s>" in text encoded as the special token)."""
    import numpy as np

    from depthtools.data import load_split, load_tokenizer, prepare_inputs, read_meta
    from depthtools.train import train_cell

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in USER_TEXTS))
    file = _user_tokenizer(tmp_path / "tok", USER_TEXTS, specials, bos_template)
    data = prepare_inputs([str(tmp_path / "in.jsonl")], out_dir=tmp_path / "data", tokenizer=str(file), val_fraction=0.1)
    meta, ours = read_meta(data), load_tokenizer(data)
    assert meta["tokenizer"]["sep_id"] == ours.sep_id == sep_id and int(np.asarray(load_split(data, "train"))[0]) == sep_id
    cfg = ModelConfig(arch="preln", vocab_size=meta["tokenizer"]["vocab_size"], d_model=32, n_layer=2, n_heads=2,
                      max_seq_len=32)
    recipe = TrainConfig(tokens=2 * 4 * 32, batch_size=4, seq_len=32, eval_tokens=128, eval_every=0, log_every=1,
                         depth_stats_every=0, checkpoint_every=0, threads=1)
    train_cell(cfg, recipe, data, tmp_path / "cell")
    summary = export_hf(tmp_path / "cell", tmp_path / "hf")
    assert summary["tokenizer"]["kind"] == "bpe"
    assert summary["tokenizer"]["special_ids"] == {k: sep_id for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert bool(bos_template) == any("post-processor" in n for n in summary["notes"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in [USER_TEXTS[3], "a literal </s> and <s> and <|endoftext|>", "héllo 🌍\n\nnew line", ""]:
        assert tok(text).input_ids == ours.encode(text), text
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == sep_id and tok.eos_token == sep
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert hf_config["eos_token_id"] == hf_config["bos_token_id"] == generation["eos_token_id"] == sep_id
    again = export_hf(tmp_path / "cell", tmp_path / "hf2", tokenizer=data)  # the data folder named explicitly
    assert again["tokenizer"]["special_ids"] == summary["tokenizer"]["special_ids"]


def test_export_refuses_a_separator_it_cannot_vouch_for_and_prepare_refuses_an_ordinary_one(tmp_path):
    from depthtools.data import BPETokenizer, prepare_inputs

    file = _user_tokenizer(tmp_path / "tok", USER_TEXTS, ["<unk>", "<s>", "</s>"])
    bpe = BPETokenizer.from_file(file, sep_token="</s>")
    model = perturbed_preln(vocab_size=bpe.vocab_size, n_layer=1)
    record = {"name": "tok-320", "vocab_size": bpe.vocab_size, "sep_id": 2, "sep_token": "</s>",
              "fingerprint": bpe.fingerprint(), "file": "tokenizer.json"}
    plain = file.read_bytes()
    ordinary = bpe._tok.token_to_id("Ġthe")
    for name, change, message in [
        ("nosep", {"sep_id": None}, "has no document separator id"),
        ("wrongname", {"sep_id": 1}, "id 1 is '<s>', but the data's separator was '</s>'"),
        ("ordinary", {"sep_id": ordinary, "sep_token": None}, r"'Ġthe' \(id \d+\) is an ordinary token"),
        ("beyond", {"sep_id": 10_000, "sep_token": None}, "has no token with id 10000"),
    ]:
        ck.save(model, tmp_path / name, extra={"tokenizer": {**record, **change}})
        (tmp_path / name / "tokenizer.json").write_bytes(plain)
        with pytest.raises(DepthToolsError, match=message):
            export_hf(tmp_path / name, tmp_path / f"out_{name}")
        assert not (tmp_path / f"out_{name}").exists()
    # a tokenizer without any special token: data preparation refuses, with and without --sep-token
    bare = _user_tokenizer(tmp_path / "bare", USER_TEXTS, [])
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": USER_TEXTS[0]}) + "\n")
    with pytest.raises(DepthToolsError, match="defines none of"):
        prepare_inputs([str(tmp_path / "in.jsonl")], out_dir=tmp_path / "data", tokenizer=str(bare))
    with pytest.raises(DepthToolsError, match="'Ġthe' .* is an ordinary token of the vocabulary"):
        prepare_inputs([str(tmp_path / "in.jsonl")], out_dir=tmp_path / "data", tokenizer=str(bare), sep_token="Ġthe")


# -- every probe runs on an imported checkpoint --------------------------------------------------------
def _finite(df):
    values = df["value"].astype(float)
    return len(values) > 0 and all(math.isfinite(v) for v in values)


def test_every_probe_runs_on_an_imported_checkpoint(tmp_path, monkeypatch):
    from depthtools.analysis.ablate import ablate
    from depthtools.analysis.lens import lens_analysis
    from depthtools.analysis.suite import run_causal, run_contrib, run_routing, run_similarity

    hf_llama(tmp_path / "hf", kv_heads=2, layers=3)
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    summary = import_hf(tmp_path / "hf", name="llama_L3")
    assert Path(summary["checkpoint"]) == tmp_path / "ckpts" / "llama_L3"
    model = ck.load("llama_L3")
    L, windows = model.n_layer, tokens(n=4, t=17, seed=3)

    lens = lens_analysis(model, windows, batch_size=2)
    assert list(lens.depths["depth"]) == list(range(L + 1))
    assert all(math.isfinite(v) for v in lens.depths.select_dtypes("number").to_numpy().ravel())
    assert math.isfinite(float(lens.summary["ce_final"].iloc[0]))
    assert lens.prediction_depth.shape == lens.token_loss.shape == (4 * 15,)  # position 0 unscored
    skip = ablate(model, windows, mode="skip", batch_size=2)
    swap = ablate(model, windows, mode="swap", batch_size=2)
    assert sorted(set(skip["layer"])) == list(range(L)) and list(swap["layer"]) == list(range(L - 1))
    for df in (skip, swap):
        assert df[["ce", "delta_ce", "kl_intact_ablated", "top1_agree"]].map(math.isfinite).all().all()
    causal = run_causal(model, windows, batch_size=2)
    C = causal[causal["metric"] == "causal_score"]
    assert len(C) == L * (L - 1) // 2 and _finite(C)
    similarity = run_similarity(model, windows, batch_size=2)
    contrib = run_contrib(model, windows, batch_size=2, probes=1)
    assert _finite(similarity) and _finite(contrib)
    assert len(similarity[similarity["metric"] == "angular_distance"]) >= L * (L + 1) // 2
    assert set(contrib[contrib["metric"] == "relative_contribution"]["layer"]) == set(range(L))
    routing = run_routing(model, windows)
    assert len(routing) == 0 and "no native depth routing" in " ".join(routing.attrs.get("notes", []))

    info = runner.invoke(app, ["info", "--ckpt", "llama_L3", "--json"])
    assert info.exit_code == 0, info.output
    shown = json.loads(info.stdout)
    assert shown["arch"] == "preln" and shown["params"]["total"] == model.param_counts()["total"]
    assert (tmp_path / "ckpts" / "llama_L3" / "generation_config.json").is_file()


# -- refusals --------------------------------------------------------------------------------------------
BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
            intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("change,field", [  # (biases, other activations, head_dim, windows, gpt2: test_families.py)
    ({"hidden_act": "gelu_fast"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "ntk", "factor": 4.0, "original_max_position_embeddings": 32}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "rope_parameters.low_freq_factor"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
    ({"head_dim": -2}, "head_dim"),
    ({"model_type": "falcon"}, "model_type"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, change, field):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **change}))
    with pytest.raises(DepthToolsError, match=field) as err:
        from_hf(tmp_path)
    assert len(str(err.value).splitlines()) == 1


def test_pickled_or_mismatched_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(DepthToolsError, match="safetensors only"):
        from_hf(tmp_path)
    hf_llama(tmp_path / "hf", layers=2)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(DepthToolsError, match="missing"):
        from_hf(tmp_path / "hf")


def test_export_refuses_architectures_without_a_transformers_equivalent(tmp_path):
    ck.save(perturbed_preln(arch="lns"), tmp_path / "lns_L3")
    with pytest.raises(DepthToolsError, match="'lns'.*no transformers equivalent"):
        export_hf(tmp_path / "lns_L3", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["export-hf", "--ckpt", str(tmp_path / "lns_L3"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "no transformers equivalent" in result.output


# -- CLI ------------------------------------------------------------------------------------------------
def test_cli_import_and_export(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    bad = runner.invoke(app, ["import-hf", str(tmp_path / "nowhere"), "--name", "x"])
    assert bad.exit_code == 2 and "not a directory" in bad.output
    (tmp_path / "empty").mkdir()
    empty = runner.invoke(app, ["import-hf", str(tmp_path / "empty"), "--name", "x"])
    assert empty.exit_code == 2 and "no config.json" in empty.output

    hf_llama(tmp_path / "hf", kv_heads=2, tied=True, layers=2)
    done = runner.invoke(app, ["import-hf", str(tmp_path / "hf"), "--name", "tiny_L2", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["model"]["n_kv_heads"] == 2
    again = runner.invoke(app, ["import-hf", str(tmp_path / "hf"), "--name", "tiny_L2"])
    assert again.exit_code == 2 and "--force" in again.output

    out = runner.invoke(app, ["export-hf", "--ckpt", "tiny_L2", str(tmp_path / "exported"), "--tokenizer", "byte"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    busy = runner.invoke(app, ["export-hf", "--ckpt", "tiny_L2", str(tmp_path / "exported")])
    assert busy.exit_code == 2 and "not empty" in busy.output
    for command in ("import-hf", "export-hf"):
        helped = runner.invoke(app, [command, "--help"])
        assert helped.exit_code == 0 and "Example" in helped.stdout
