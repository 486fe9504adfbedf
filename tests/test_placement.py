"""Blocks over several devices (issue 45 item 3): the split by bytes against a brute force, the device checks, and the
move-at-block-boundary path run on CPU (a devices list of "cpu" entries) with results equal to one device."""

import itertools

import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel, Plan
from depthtools.arch.moda import MoDAState
from depthtools.arch.stream import EMBED, HEAD, attach, check_devices, move, split_by_bytes
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

from tiny_models import one_thread, perturb, tiny, windows  # noqa: F401  (autouse: one intra-op thread)


def brute_force(sizes: list[int], n: int) -> int:
    """The smallest possible largest-device load over every contiguous split into n non-empty ranges."""
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), n - 1):
        bounds = (0, *cuts, len(sizes))
        load = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = load if best is None else min(best, load)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_split_is_contiguous_balanced_and_optimal(seed):
    gen = torch.Generator().manual_seed(seed)
    count = int(torch.randint(2, 10, (1,), generator=gen))
    sizes = [int(s) for s in torch.randint(0, 100, (count,), generator=gen)]
    for n in range(1, count + 1):
        where = split_by_bytes(sizes, n)
        assert where[0] == 0 and where[-1] == n - 1 and sorted(where) == where  # contiguous, first/last devices
        assert set(where) == set(range(n))  # every device holds a unit
        load = max(sum(s for s, d in zip(sizes, where) if d == k) for k in range(n))
        assert load == brute_force(sizes, n)


def test_split_of_equal_blocks_and_refusals():
    assert split_by_bytes([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert split_by_bytes([50, 10, 10, 10, 10, 50], 2) == [0, 0, 0, 1, 1, 1]  # embedding and head weigh in
    with pytest.raises(DepthToolsError, match="3 units over 4 devices"):
        split_by_bytes([1, 2, 3], 4)


def test_device_checks_are_one_line():
    assert check_devices("cpu", None) == ["cpu"] and check_devices("cuda", 2, available=4) == ["cuda:0", "cuda:1"]
    for args, match in [(("cpu", 2), "needs --device cuda"), (("cuda", 2, 0), "none is available"),
                        (("cuda", 3, 2), "more CUDA devices than the 2 visible"), (("cuda", 0, 2), ">= 1")]:
        with pytest.raises(DepthToolsError, match=match) as info:
            check_devices(*args)
        assert "\n" not in str(info.value)


def test_cli_devices_refused_without_cuda(tmp_path):
    runner = CliRunner()
    for args, match in [(["--device", "cuda", "--devices", "2"], "cuda"), (["--devices", "2"], "--device cuda"),
                        (["--devices", "two"], "whole number")]:
        result = runner.invoke(app, ["lens", "--ckpt", str(tmp_path / "none"), *args])
        assert result.exit_code == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and match in result.stderr, result.stderr


def test_move_reaches_every_tensor_of_a_state():
    meta = torch.device("meta")
    moved = move({"a": torch.ones(2), "b": [torch.ones(1), (torch.zeros(3), 5)]}, meta)
    assert moved["a"].is_meta and moved["b"][0].is_meta and moved["b"][1][0].is_meta and moved["b"][1][1] == 5
    state = move(MoDAState(torch.ones(2, 3), torch.ones(1), None, (True,)), meta)
    assert isinstance(state, MoDAState) and state.h.is_meta and state.keys.is_meta and state.values is None
    assert state.valid == (True,)


@pytest.mark.parametrize("arch", ["preln", "hc", "moda"])
def test_blocks_over_three_cpu_devices_match_one_device(arch):
    model, toks = tiny(arch).float(), windows()
    with torch.no_grad():
        want = [model.run(toks, plan=plan) for plan in (None, Plan.skipping(1), Plan.swapping(0, 3, 4))]
    steps = []
    streamer = attach(model, None, ["cpu", "cpu", "cpu"])
    real_step = streamer.model.scheme.step

    def recording(position, running, state, home, rope):
        steps.append((position, streamer.where[running.index]))
        return real_step(position, running, state, home, rope)

    streamer.model.scheme.step = recording
    with torch.no_grad():
        got = [model.run(toks, plan=plan) for plan in (None, Plan.skipping(1), Plan.swapping(0, 3, 4))]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert streamer.where[EMBED] == 0 and streamer.where[HEAD] == 2
    assert [d for _, d in steps[:4]] == [streamer.where[i] for i in range(4)] and len(set(streamer.where.values())) == 3


def test_several_devices_refused_for_model_level_parameters():
    model = tiny("attnres").float()
    with pytest.raises(DepthToolsError, match="outside its blocks"):
        attach(model, None, ["cpu", "meta"])


def test_load_places_blocks(tmp_path):
    cfg = ModelConfig(arch="preln", vocab_size=64, d_model=32, n_layer=4, n_heads=4, max_seq_len=16)
    directory = ck.save(perturb(DepthModel(cfg, seed=0)), tmp_path / "c")
    with pytest.raises(DepthToolsError, match="needs --device cuda"):
        ck.load(directory, devices=2)
    toks = windows(vocab=64)
    with torch.no_grad():
        assert torch.equal(ck.load(directory, stream=True, budget=0).run(toks), ck.load(directory).run(toks))
