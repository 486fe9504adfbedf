"""Serial-computation probes (issue 9): generators checked by independent solvers, the training mix
(fraction, recomputation, DDP row slices, trainer config), evaluation of a briefly trained tiny model,
and the `depthtools tasks` CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from depthtools.analysis.tables import load_table
from depthtools.analysis.tasks import COLUMNS, DEPTH_COLUMNS, METRICS, depth_reached, evaluate_grid, task_eval, wide
from depthtools.arch import DepthModel
from depthtools.checkpoint import save
from depthtools.config import ModelConfig, TrainConfig
from depthtools.data import ByteTokenizer
from depthtools.data.tasks import MAX_K, TASKS, TaskMix, TaskMixer, generate
from depthtools.errors import DepthToolsError
from depthtools.train.batches import TrainBatches

from tiny_models import one_thread  # noqa: F401 (autouse fixture)

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_corpus"


# -- independent solvers: parse the text and solve it another way -------------------------------------
def solve_chase(prompt: str) -> tuple[str, int]:
    """Dict walk from the query to a digit; returns (answer, hops)."""
    *pairs, query = prompt.rstrip("?").split(";")
    bindings = dict(p.split("=") for p in pairs)
    assert len(bindings) == len(pairs), "a variable is bound twice"
    value, hops = query, 0
    while not value.isdigit():
        value, hops = bindings[value], hops + 1
    return value, hops


def solve_s5(prompt: str) -> str:
    """Product of permutation matrices: row i of P1 @ P2 @ ... has its 1 at p_k(...p_1(i))."""
    total = np.eye(5, dtype=int)
    for block in prompt.rstrip("=").split("*"):
        assert sorted(block) == list("01234")
        matrix = np.zeros((5, 5), dtype=int)
        matrix[np.arange(5), [int(c) for c in block]] = 1
        total = total @ matrix
    return "".join(str(int(np.argmax(row))) for row in total)


def solve_add(prompt: str) -> tuple[str, int]:
    """Python int addition; longest carry chain from carries c_i = [a mod 10^i + b mod 10^i >= 10^i]."""
    a_text, b_text = prompt.rstrip("=").split("+")
    assert a_text[0] != "0" and b_text[0] != "0" and len(a_text) == len(b_text)
    a, b = int(a_text), int(b_text)
    carries = [(a % 10 ** i + b % 10 ** i) >= 10 ** i for i in range(1, len(a_text) + 1)]
    longest = run = 0
    for carry in carries:
        run = run + 1 if carry else 0
        longest = max(longest, run)
    return str(a + b), longest


def solve_hop(prompt: str) -> tuple[str, int]:
    """Walk the table as a dict {index: digit} from the start, k times; also checks the path revisits nothing."""
    table, query = prompt.rstrip("=").split(";")
    start, hops = query.split("^")
    assert sorted(table) == list("0123456789")  # a permutation
    pointer = dict(enumerate(int(c) for c in table))
    visited = [int(start)]
    for _ in range(int(hops)):
        visited.append(pointer[visited[-1]])
    assert len(set(visited)) == len(visited), ("the path repeats an entry", prompt)
    return str(visited[-1]), int(hops)


def check_sample(task: str, k: int | None, text: str, start: int, end: int) -> None:
    prompt, answer = text[:start], text[start:end]
    assert text[end:] == "\n" and "\0" not in text and text.isascii()
    if task == "chase":
        expected, steps = solve_chase(prompt)
    elif task == "s5":
        expected, steps = solve_s5(prompt), prompt.count("*") + 1
    elif task == "hop":
        expected, steps = solve_hop(prompt)
    else:
        expected, steps = solve_add(prompt)
    assert answer == expected, (task, text)
    assert k is None or steps == k, (task, k, steps, text)


# -- generators ----------------------------------------------------------------------------------
@pytest.mark.parametrize("task", TASKS)
def test_generators_are_deterministic_per_seed(task):
    a, b, c = generate(task, 3, 30, seed=0), generate(task, 3, 30, seed=0), generate(task, 3, 30, seed=1)
    assert a == b and [s.text for s in a] != [s.text for s in c]
    assert len({s.text for s in a}) > 25  # samples differ from one another too
    assert generate(task, 4, 5, seed=0)[0].text != a[0].text  # k is part of the key


@pytest.mark.parametrize("task", TASKS)
def test_every_answer_is_correct_by_an_independent_solver(task):
    tokenizer = ByteTokenizer()
    for k in (k for k in (1, 2, 3, 5, 8, 9, 12) if k <= MAX_K[task]):
        for s in generate(task, k, 40, seed=k):
            check_sample(task, k, s.text, s.answer_start, s.answer_end)
            ids = tokenizer.encode(s.text)
            assert 0 not in ids and ids == s.tokens().tolist()  # byte offsets = text offsets
            assert tokenizer.decode(ids[s.answer_start:s.answer_end]) == s.answer


def test_pointer_chasing_cannot_be_solved_by_position_or_chain_length():
    samples = generate("chase", 3, 200, seed=0)
    answer_slot, digits_in_prompt = set(), []
    for s in samples:
        pairs = s.prompt.rstrip("?").split(";")[:-1]
        value, _ = solve_chase(s.prompt)
        final = [i for i, p in enumerate(pairs) if p[2:] == value and _reaches(pairs, s.prompt[-2], p[0])]
        answer_slot.add(final[0])
        digits = {p[2] for p in pairs if p[2].isdigit()}
        digits_in_prompt.append(len(digits))
        # a decoy chain of the same length ends in another digit
        assert any(p[2].isdigit() and p[2] != value and _depth_to(pairs, p[0]) >= 3 for p in pairs), s.text
    assert len(answer_slot) >= 5  # the answer binding sits anywhere in the list
    assert min(digits_in_prompt) >= 2


def test_hop_needs_every_hop_not_a_shortcut():
    """No fixed table slot and no shorter walk gives t^k(s) away (digit frequencies cannot: t is a permutation)."""
    for k in (1, 3, 6):
        samples = generate("hop", k, 600, seed=k)
        answers = [int(s.answer) for s in samples]
        assert max(np.bincount(answers, minlength=10)) / len(answers) < 0.16  # about uniform over the 10 digits
        for slot in range(10):
            # ~0.19: the slot is on the path (about 1 in 10) or holds the answer's digit by chance (1 in 10)
            assert np.mean([s.prompt[slot] == s.answer for s in samples]) < 0.26, (k, slot)
        for s in samples:
            table, start = s.prompt[:10], int(s.prompt[11])
            walk = [start]
            for _ in range(k - 1):
                walk.append(int(table[walk[-1]]))
            assert str(walk[-1]) != s.answer and str(start) != s.answer  # k-1 hops (or none) never answer it


def _reaches(pairs: list[str], start: str, target: str) -> bool:
    bindings = dict(p.split("=") for p in pairs)
    value = start
    while value in bindings:
        if value == target:
            return True
        value = bindings[value]
    return False


def _depth_to(pairs: list[str], var: str) -> int:
    """Length of the longest chain of bindings that ends at `var`'s binding."""
    parents = {}
    for p in pairs:
        parents.setdefault(p[2], []).append(p[0])
    return 1 + max((_depth_to(pairs, q) for q in parents.get(var, [])), default=0)


def test_bad_task_and_k_are_one_line_errors():
    with pytest.raises(DepthToolsError, match="unknown task 'nope'; valid: chase, s5, add, hop"):
        generate("nope", 1, 1)
    with pytest.raises(DepthToolsError, match="k must be an integer >= 1"):
        generate("s5", 0, 1)
    with pytest.raises(DepthToolsError, match="too large for 'chase'"):
        generate("chase", 26, 1)
    with pytest.raises(DepthToolsError, match="too large for 'hop': at most 9 .a path of k.1 distinct entries"):
        generate("hop", 10, 1)


# -- training mix --------------------------------------------------------------------------------
def test_task_mix_lives_in_train_config_and_round_trips():
    from depthtools.train.loop import run_fingerprint

    mix = {"fraction": 0.05, "tasks": ["chase", "add"], "k_min": 1, "k_max": 6}
    cfg = TrainConfig(tokens=1000, task_mix=mix)
    assert cfg.task_mix == TaskMix(0.05, ("chase", "add"), 1, 6)
    assert TrainConfig.from_json(cfg.to_json()) == cfg and cfg.to_dict()["task_mix"] == mix
    plain = TrainConfig(tokens=1000)
    assert "task_mix" not in plain.to_dict() and TrainConfig.from_dict(plain.to_dict()) == plain
    model_cfg = ModelConfig()
    assert run_fingerprint(model_cfg, cfg, "d") != run_fingerprint(model_cfg, plain, "d")
    for bad, message in [({"fraction": 0}, "fraction must lie in"), ({"fraction": 0.1, "tasks": ["x"]}, "unknown task"),
                         ({"fraction": 0.1, "k_min": 3, "k_max": 2}, "k_max=2 is below"),
                         ({"fraction": 0.1, "ratio": 1}, "unknown task_mix field"),
                         ({"tasks": ["s5"]}, "needs a 'fraction'")]:
        with pytest.raises(DepthToolsError, match=message):
            TrainConfig(task_mix=bad)


def _corpus(n: int = 20_000) -> np.ndarray:
    """Random bytes 128..255: a corpus window can never look like (ASCII) task text."""
    return np.random.default_rng(0).integers(128, 256, size=n).astype(np.uint16)


def test_mix_fraction_matches_config_and_batches_recompute_identically():
    corpus, mix, B, T, steps = _corpus(), TaskMix(0.2, TASKS, 2, 4), 16, 64, 150
    plain = TrainBatches(corpus, B, T, seed=3, device=torch.device("cpu"))
    mixed = TrainBatches(corpus, B, T, seed=3, device=torch.device("cpu"), task_mix=mix)
    task_rows = seen_ks = 0
    ks, tasks = set(), set()
    for step in range(steps):
        (x0, y0), (x1, y1) = plain.batch(step), mixed.batch(step)
        data = torch.cat([x1, y1[:, -1:]], dim=1)
        changed = (torch.cat([x0, y0[:, -1:]], 1) != data).any(1)
        assert torch.equal(changed, (data < 128).all(1))  # a replaced row is all task text
        task_rows += int(changed.sum())
        for row in data[changed]:
            assert row[0] == 0  # starts at a sample boundary
            for piece in bytes(row.tolist()).split(b"\0")[1:]:
                text = piece.decode("ascii")
                if not text.endswith("\n"):
                    continue  # the row's last sample is cut off
                task = "chase" if "?" in text else "add" if "+" in text else "hop" if "^" in text else "s5"
                start, end = text.index("?" if task == "chase" else "=") + 1, len(text) - 1
                check_sample(task, None, text, start, end)
                ks.add(_k_of(task, text[:start]))
                tasks.add(task)
                seen_ks += 1
    n_rows = steps * B
    sigma = math.sqrt(mix.fraction * (1 - mix.fraction) / n_rows)
    assert abs(task_rows / n_rows - mix.fraction) < 4 * sigma, (task_rows / n_rows, sigma)
    assert tasks == set(TASKS) and ks == {2, 3, 4} and seen_ks > 100
    again = TrainBatches(corpus, B, T, seed=3, device=torch.device("cpu"), task_mix=mix)
    for step in (149, 7, 0, 7):  # any order, any instance: the batch of a step never changes
        assert all(torch.equal(a, b) for a, b in zip(again.batch(step), mixed.batch(step)))
    other = TrainBatches(corpus, B, T, seed=4, device=torch.device("cpu"), task_mix=mix)
    assert not torch.equal(other.batch(0)[0], mixed.batch(0)[0])


def _k_of(task: str, prompt: str) -> int:
    if task == "chase":
        return solve_chase(prompt)[1]
    if task == "s5":
        return prompt.count("*") + 1
    if task == "hop":
        return solve_hop(prompt)[1]
    return solve_add(prompt)[1]


def test_mix_rows_follow_global_row_indices_under_data_parallel():
    """Rank r of W holds rows [r·B/W, (r+1)·B/W) of the global batch, task rows included."""
    corpus, mix = _corpus(), TaskMix(0.5)
    whole = TrainBatches(corpus, 8, 32, seed=0, device=torch.device("cpu"), task_mix=mix)
    halves = [TrainBatches(corpus, 8, 32, seed=0, device=torch.device("cpu"), rank=r, world_size=2, task_mix=mix)
              for r in range(2)]
    for step in range(4):
        x = whole.batch(step)[0]
        assert torch.equal(torch.cat([h.batch(step)[0] for h in halves]), x)
    mixer = TaskMixer(mix, seed=0, batch_size=8, seq_len=32)
    assert mixer.task_rows(0).any() and not mixer.task_rows(0).all()
    with pytest.raises(DepthToolsError, match="byte-level dataset"):
        TaskMixer(mix, seed=0, batch_size=8, seq_len=32, tokenizer="bpe4k")


def test_trainer_mixes_tasks_and_records_the_mix(tmp_path):
    from depthtools.data import prepare
    from depthtools.train import train_cell

    data_dir = prepare("text-dir", out_dir=tmp_path / "data", text_dir=FIXTURE, val_fraction=0.3)
    recipe = TrainConfig(tokens=6 * 4 * 32, batch_size=4, seq_len=32, eval_tokens=128, eval_every=0, log_every=3,
                         depth_stats_every=0, checkpoint_every=0, threads=1,
                         task_mix={"fraction": 0.5, "tasks": ["chase"], "k_min": 1, "k_max": 2})
    model_cfg = ModelConfig(d_model=32, n_layer=1, n_heads=2, max_seq_len=32)
    summary = train_cell(model_cfg, recipe, data_dir, tmp_path / "cell")
    assert summary["steps"] == 6 and math.isfinite(summary["val_loss"])
    config = json.loads((tmp_path / "cell" / "config.json").read_text())
    assert config["train"]["task_mix"] == {"fraction": 0.5, "tasks": ["chase"], "k_min": 1, "k_max": 2}
    assert TrainConfig.from_dict(config["train"]) == recipe


# -- evaluation of a briefly trained model -------------------------------------------------------
TRAINED_MIX = TaskMix(1.0, ("chase",), 1, 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A d=64, 2-layer Pre-LN byte model, AdamW on the answers of k=1 pointer-chasing samples (~15 s)."""
    from depthtools.analysis.tasks import _encode

    torch.manual_seed(0)
    model = DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=64, n_layer=2, n_heads=4, max_seq_len=96),
                       seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.0)
    for step in range(250):
        ids, spans = _encode(generate("chase", 1, 32, seed=10_000 + step))  # training seeds != eval seed
        weight = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        for i, (a, b) in enumerate(spans):
            weight[i, a - 1:b] = 1.0  # answer + end marker
        ce = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        loss = (ce * weight.flatten()).sum() / weight.sum()
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 30)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    grid = tmp_path_factory.mktemp("grid")
    extra = {"train": TrainConfig(tokens=1, task_mix=TRAINED_MIX).to_dict(), "tokenizer": {"name": "byte"}}
    save(model, grid / "preln_L2", extra=extra)
    untrained = DepthModel(ModelConfig(arch="preln", d_model=32, n_layer=1, n_heads=2, max_seq_len=96), seed=0)
    save(untrained, grid / "preln_L1", extra={"tokenizer": {"name": "byte"}})
    return model, grid


def test_tiny_model_beats_chance_on_k1_and_reports_every_k(trained):
    model, _ = trained
    n = 200
    df = task_eval(model, tasks="chase", ks="1-3", n=n, seed=0, batch_size=64, train_mix=TRAINED_MIX)
    assert list(df.columns) == list(COLUMNS) and len(df) == 3 * 5
    assert df["in_train_range"].dtype == bool and df["k"].dtype == np.int64
    value = {(k, m): v for k, m, v in zip(df["k"], df["metric"], df["value"])}
    chance = 1 / 10  # ten candidate digits
    assert value[1, "accuracy"] > chance + 3 * math.sqrt(chance * (1 - chance) / n)
    assert value[1, "answer_loss"] < math.log(10)  # better than uniform over the digits
    for k in (1, 2, 3):
        assert 0 <= value[k, "accuracy"] <= 1 and math.isfinite(value[k, "answer_loss"])
        assert 0 <= value[k, "lens_first_depth"] <= model.n_layer
        assert value[k, "lens_first_rel_depth"] == pytest.approx(value[k, "lens_first_depth"] / model.n_layer)
    assert df.groupby("k")["in_train_range"].first().to_dict() == {1: True, 2: False, 3: False}
    table = wide(df)
    assert list(table["k"]) == [1, 2, 3] and set(METRICS) <= set(table.columns)
    accuracy, loss = direct_scores(model, generate("chase", 1, n, seed=0))
    assert value[1, "accuracy"] == pytest.approx(accuracy) and value[1, "answer_loss"] == pytest.approx(loss, rel=1e-5)
    reached = depth_reached(df, threshold=0.05)
    assert list(reached.columns) == list(DEPTH_COLUMNS) and reached["depth_reached"].iloc[0] >= 1
    assert depth_reached(df, threshold=1.0)["depth_reached"].iloc[0] == 0 or value[1, "accuracy"] == 1.0


def direct_scores(model, samples) -> tuple[float, float]:
    """Exact match (answer + "\\n") and answer CE from one plain forward pass per sample."""
    hits, losses = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([[0] + list(s.text.encode())])
            logits = model(ids)[0]
            span = range(s.answer_start + 1, s.answer_end + 2)  # answer + "\\n", shifted by the separator
            hits.append(all(int(logits[p - 1].argmax()) == int(ids[0, p]) for p in span))
            losses += [F.cross_entropy(logits[p - 1], ids[0, p]).item() for p in span[:-1]]
    return float(np.mean(hits)), float(np.mean(losses))


@pytest.mark.parametrize("arch, options", [("hc", {}), ("attnres", {}), ("denseformer", {}), ("moda", {}),
                                           ("hc", {"readout": "normed_sum"}), ("mhc", {"readout": "normed_sum"})])
def test_evaluator_matches_a_plain_forward_pass_on_other_architectures(arch, options):
    """The depth-by-depth pass (final_hidden -> unembed at depth L) is the model's own output, also for
    HC/mHC whose head norms every stream before the sum (readout "normed_sum", issue 44)."""
    from tiny_models import tiny

    model = tiny(arch, n_layer=3, vocab=256, context=64, **options)
    df = task_eval(model, tasks="add", ks=[2], n=6, batch_size=4, train_mix=None)
    value = dict(zip(df["metric"], df["value"]))
    accuracy, loss = direct_scores(model, generate("add", 2, 6, seed=0))
    assert value["accuracy"] == pytest.approx(accuracy) and value["answer_loss"] == pytest.approx(loss, rel=1e-9)
    assert not df["in_train_range"].any()


def test_k_beyond_the_context_is_left_out_with_a_note(trained):
    model, _ = trained
    df = task_eval(model, tasks="s5", ks=[1, 40], n=4)
    assert set(df["k"]) == {1} and "s5 k=40 left out" in df.attrs["notes"][0]


# -- CLI -----------------------------------------------------------------------------------------
def test_cli_sample_shows_samples_with_correct_answers():
    from cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["tasks", "sample", "--task", "s5", "--k", "3", "-n", "5"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("*") >= 10 and "answer" in result.stdout
    result = runner.invoke(app, ["tasks", "sample", "--task", "add", "--k", "4", "-n", "3", "--json"])
    rows = json.loads(result.stdout)
    assert len(rows) == 3
    for r in rows:
        check_sample("add", 4, r["text"], r["answer_start"], r["answer_end"])


def test_cli_eval_ckpt_and_grid_save_tidy_tables(trained, tmp_path):
    from cli.main import app

    _, grid = trained
    runner = CliRunner()
    args = ["tasks", "eval", "--ckpt", str(grid / "preln_L2"), "--tasks", "chase", "--k", "1-3", "-n", "40"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "serial-computation probes" in result.stdout and "depth reached" in result.stdout
    saved = load_table(grid / "preln_L2", "tasks_eval")
    assert list(saved.columns) == list(COLUMNS) and sorted(set(saved["k"])) == [1, 2, 3]
    assert set(saved["metric"]) == {"accuracy", "answer_loss", "lens_first_depth", "lens_first_rel_depth", "n_samples"}
    assert saved[saved["k"] == 1]["in_train_range"].all() and not saved[saved["k"] == 3]["in_train_range"].any()
    result = runner.invoke(app, args + ["--json", "--no-save"])
    out = json.loads(result.stdout)
    pd.testing.assert_frame_equal(pd.DataFrame(out["table"]), saved, check_dtype=False)
    result = runner.invoke(app, ["tasks", "eval", "--grid", str(grid), "--tasks", "chase", "--k", "1,2", "-n", "10",
                                 "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert {r["model"] for r in out["depth_reached"]} == {"preln_L1", "preln_L2"}
    assert load_table(grid, "tasks_depth_reached") is not None
    assert load_table(grid / "preln_L1", "tasks_eval") is not None
    df, reached = evaluate_grid(grid, tasks="chase", ks=[1, 2], n=10, save=False)
    assert len(df) == 2 * 2 * 5 and len(reached) == 2


@pytest.mark.parametrize("args, message", [
    (["sample", "--task", "nope"], "unknown task 'nope'"),
    (["sample", "--task", "s5", "--k", "0"], "k must be an integer >= 1"),
    (["eval", "--ckpt", "x", "--tasks", "chase,nope"], "unknown task 'nope'"),
    (["eval", "--ckpt", "x", "--k", "0-3"], "k must be >= 1"),
    (["eval", "--tasks", "chase"], "exactly one of --ckpt NAME or --grid DIR"),
])
def test_cli_bad_input_is_one_line_and_exit_code_2(args, message):
    from cli.main import app

    result = CliRunner().invoke(app, ["tasks", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""
