"""The DCP reader (depthtools.interop.dcp) against torch.distributed.checkpoint's own load, and on hostile input.

Reference: torch's `dcp.load` into whole tensors (it reshards on load), plus the tensors the writer sharded
(tests/dcp_writer.py's `full_model`). Checkpoints: one process, and 2 and 4 CPU gloo ranks with row- and
column-sharded DTensors (uneven sizes, so the chunks differ) and an optimizer section beside the model.
Hostile input: a `.metadata` pickle whose payload would create a file (the same payload is first shown to
create its file under plain `pickle`), truncated and missing `.distcp` files, chunks that disagree with the
metadata. Each is one CheckpointError line.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from depthtools.errors import CheckpointError
from depthtools.interop.dcp import read_metadata, read_model_tensors

from dcp_writer import full_model

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_ranks(out: Path, ranks: int) -> Path:
    """tests/dcp_writer.py under torchrun with `ranks` CPU processes (gloo)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(ROOT / "tests" / "dcp_writer.py"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def save_single(out: Path, state: dict) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(out))
    return out


def torch_load(directory: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch's own DCP load of the model entries, into whole tensors: the independent reference."""
    state = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(directory))
    return state["model"]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("dcp")
    return {n: save_ranks(root / f"ranks{n}", n) for n in (2, 4)}


def _single_state() -> dict:
    return {"model": full_model(), "optim": {"step": 7, "state": {"m": torch.ones(3)}}, "extra": "not a tensor"}


def test_single_process_equals_torch_load(tmp_path):
    out = save_single(tmp_path / "one", _single_state())
    ours = read_model_tensors(out)
    reference = torch_load(out, full_model())
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_over_ranks_equals_torch_load(sharded, ranks):
    directory = sharded[ranks]
    meta = read_metadata(directory)
    chunks = {len(e.chunks) for n, e in meta.state_dict_metadata.items() if n == "model.embeddings.weight"}
    assert chunks == {ranks}  # really sharded: one chunk per rank
    assert len(list(directory.glob("*.distcp"))) == ranks
    ours = read_model_tensors(directory)
    reference = torch_load(directory, full_model())
    for name, tensor in full_model().items():
        assert torch.equal(ours[name], reference[name]) and torch.equal(ours[name], tensor), name
    assert not any(name.startswith("optim") for name in ours)


def test_optimizer_and_bytes_entries_are_never_read(tmp_path):
    """The optimizer's and the pickled entries' bytes are garbage here: reading the model must not touch them."""
    out = save_single(tmp_path / "one", _single_state())
    assert set(read_model_tensors(out, prefix="optim.")) == {"state.m"}  # tensors only: "step" is a bytes entry
    meta = read_metadata(out)
    model_ranges = {(i.relative_path, i.offset, i.length) for k, i in meta.storage_data.items() if k.fqn.startswith("model.")}
    blob = bytearray((out / "__0_0.distcp").read_bytes())
    for key, info in meta.storage_data.items():
        if not key.fqn.startswith("model."):
            assert (info.relative_path, info.offset, info.length) not in model_ranges
            blob[info.offset:info.offset + info.length] = b"\x80" * info.length
    (out / "__0_0.distcp").write_bytes(bytes(blob))
    assert all(torch.equal(a, full_model()[k]) for k, a in read_model_tensors(out).items())


class _Payload:
    """Unpickling this runs exec(): it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _hostile_metadata(directory: Path, marker: Path, nested: bool) -> bytes:
    """The folder's real metadata with the payload at the top, or hidden in planner_data."""
    meta = pickle.loads((directory / ".metadata").read_bytes())  # our own test file: trusted
    if nested:
        meta.planner_data = {"model.embeddings.weight": _Payload(marker)}
        return pickle.dumps(meta)
    return pickle.dumps(_Payload(marker))


@pytest.mark.parametrize("nested", [False, True])
def test_metadata_pickle_that_would_run_code_is_refused(tmp_path, nested):
    out = save_single(tmp_path / "one", _single_state())
    live = _hostile_metadata(out, tmp_path / "proof", nested)
    pickle.loads(live)  # the payload is live: plain pickle runs it
    assert (tmp_path / "proof").exists()
    marker = tmp_path / "pwned"
    (out / ".metadata").write_bytes(_hostile_metadata(out, marker, nested))
    with pytest.raises(CheckpointError) as err:
        read_model_tensors(out)
    assert "builtins.exec" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_chunk_archive_that_would_run_code_is_refused(tmp_path):
    """A tensor chunk is a torch.save archive with a pickle inside: its payload must not run either."""
    out = save_single(tmp_path / "one", {"model": {"w": torch.ones(4)}})
    info = next(iter(read_metadata(out).storage_data.values()))
    marker = tmp_path / "pwned"
    import io
    import zipfile

    blob = (out / "__0_0.distcp").read_bytes()
    src = zipfile.ZipFile(io.BytesIO(blob[info.offset:info.offset + info.length]))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as dst:
        for member in src.namelist():
            data = pickle.dumps(_Payload(marker)) if member.endswith("data.pkl") else src.read(member)
            dst.writestr(member, data)
    (out / "__0_0.distcp").write_bytes(buffer.getvalue())
    meta = pickle.loads((out / ".metadata").read_bytes())
    for value in meta.storage_data.values():
        value.offset, value.length = 0, len(buffer.getvalue())
    (out / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="builtins.exec"):
        read_model_tensors(out)
    assert not marker.exists()


def test_truncated_distcp_is_refused(sharded, tmp_path):
    directory = shutil.copytree(sharded[2], tmp_path / "cut")
    shard = directory / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is truncated: entry '.*' needs bytes") as err:
        read_model_tensors(directory)
    assert "\n" not in str(err.value)


def test_missing_rank_file_is_refused(sharded, tmp_path):
    directory = shutil.copytree(sharded[4], tmp_path / "lost")
    (directory / "__3_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__3_0\.distcp is missing: entry '.*' is stored in it"):
        read_model_tensors(directory)


def test_missing_metadata_is_an_incomplete_save(sharded, tmp_path):
    directory = shutil.copytree(sharded[2], tmp_path / "killed")
    (directory / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        read_model_tensors(directory)


def _rewrite(directory: Path, edit) -> None:
    meta = pickle.loads((directory / ".metadata").read_bytes())  # our own test file: trusted
    edit(meta)
    (directory / ".metadata").write_bytes(pickle.dumps(meta))


def _rekey(meta, name: str, old: tuple, new: tuple) -> None:
    """Move the storage record of chunk `old` of `name` to offset `new` (the metadata indexes chunks by offset)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    key = next(k for k in meta.storage_data if k.fqn == name and tuple(k.offset) == old)
    meta.storage_data[MetadataIndex(name, new, key.index)] = meta.storage_data.pop(key)


def test_chunk_shape_or_dtype_disagreeing_with_metadata_is_refused(sharded, tmp_path):
    directory = shutil.copytree(sharded[2], tmp_path / "shape")
    name = "model.embeddings.weight"

    def reshape(meta):  # [7, 6] as [14, 3]: the same elements, in chunks of [8, 3] and [6, 3]
        entry = meta.state_dict_metadata[name]
        entry.size = torch.Size([14, 3])
        entry.chunks[0].sizes, entry.chunks[1].sizes = torch.Size([8, 3]), torch.Size([6, 3])
        entry.chunks[1].offsets = torch.Size([8, 0])
        _rekey(meta, name, (4, 0), (8, 0))

    _rewrite(directory, reshape)
    with pytest.raises(CheckpointError, match=r"'model\.embeddings\.weight' chunk \[0, 0\] holds \[4, 6\] "
                                              r"torch\.float32, the metadata says \[8, 3\] torch\.float32"):
        read_model_tensors(directory)
    directory = shutil.copytree(sharded[2], tmp_path / "dtype")
    _rewrite(directory, lambda meta: setattr(meta.state_dict_metadata[name].properties, "dtype", torch.bfloat16))
    with pytest.raises(CheckpointError, match=r"holds \[4, 6\] torch\.float32, the metadata says \[4, 6\] torch\.bfloat16"):
        read_model_tensors(directory)


def test_chunks_that_do_not_tile_their_tensor_are_refused(sharded, tmp_path):
    directory = shutil.copytree(sharded[2], tmp_path / "gap")

    def grow_tensor(meta):
        meta.state_dict_metadata["model.embeddings.weight"].size = torch.Size([8, 6])

    _rewrite(directory, grow_tensor)
    with pytest.raises(CheckpointError, match=r"chunks of 'model\.embeddings\.weight' hold 42 element\(s\), its size "
                                              r"\[8, 6\] has 48"):
        read_model_tensors(directory)

    def overlap(meta):  # the second chunk (rows 4..6) moved up one row: row 3 twice, row 6 never
        meta.state_dict_metadata["model.embeddings.weight"].size = torch.Size([7, 6])
        meta.state_dict_metadata["model.embeddings.weight"].chunks[1].offsets = torch.Size([3, 0])
        _rekey(meta, "model.embeddings.weight", (4, 0), (3, 0))

    _rewrite(directory, overlap)
    with pytest.raises(CheckpointError, match=r"leave 6 element\(s\) unset and cover 6 more than once"):
        read_model_tensors(directory)


def test_a_huge_size_claim_is_refused_before_allocating(sharded, tmp_path):
    directory = shutil.copytree(sharded[2], tmp_path / "huge")

    def claim(meta):  # 10^12 rows: 24 TB if it were allocated
        entry = meta.state_dict_metadata["model.embeddings.weight"]
        entry.size = torch.Size([10**12, 6])
        entry.chunks[0].sizes = torch.Size([10**12 - 3, 6])

    _rewrite(directory, claim)
    with pytest.raises(CheckpointError, match=r"needs 23999999999928 bytes, its stored range has \d+"):
        read_model_tensors(directory)


def test_a_compressed_archive_member_is_refused(tmp_path):
    """torch.save stores its members uncompressed; a deflated one could inflate far beyond the file."""
    import io
    import zipfile

    out = save_single(tmp_path / "one", {"model": {"w": torch.ones(4)}})
    info = next(iter(read_metadata(out).storage_data.values()))
    blob = (out / "__0_0.distcp").read_bytes()
    src = zipfile.ZipFile(io.BytesIO(blob[info.offset:info.offset + info.length]))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for member in src.namelist():
            dst.writestr(member, src.read(member))
    (out / "__0_0.distcp").write_bytes(buffer.getvalue())
    meta = pickle.loads((out / ".metadata").read_bytes())  # our own test file: trusted
    for value in meta.storage_data.values():
        value.offset, value.length = 0, len(buffer.getvalue())
    (out / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="has compressed members"):
        read_model_tensors(out)


def test_no_model_entries_names_what_is_there(tmp_path):
    out = save_single(tmp_path / "one", {"weights": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointError, match="no tensors under 'model.' .*weights"):
        read_model_tensors(out)


def test_olmo_core_writer_equals_the_module_state(tmp_path):
    """OLMo-core's own save (its storage writer pickles its own _StorageInfo class) reads back exactly."""
    checkpoint = pytest.importorskip("olmo_core.distributed.checkpoint")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint.save_model_and_optim_state(tmp_path / "model_and_optim", model, optim)
    ours = read_model_tensors(tmp_path / "model_and_optim")
    assert sorted(ours) == sorted(model.state_dict())
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("edit, needle", [
    (lambda m: setattr(m.state_dict_metadata["model.w"].chunks[0], "offsets", ("a",)), "malformed size/chunk records"),
    (lambda m: setattr(m.state_dict_metadata["model.w"], "size", [3]), "malformed size/chunk records"),
    (lambda m: m.state_dict_metadata.update({"model.x": 5}), "'model.x' is not a tensor or bytes record"),
    (lambda m: setattr(m, "storage_data", None), "no storage_data table"),
    (lambda m: [setattr(i, "relative_path", "../../etc/passwd") for i in m.storage_data.values()], "points outside"),
])
def test_malformed_metadata_records_are_refused(tmp_path, edit, needle):
    """Records of the allowed classes holding the wrong things: one line, never a traceback or a read elsewhere."""
    out = save_single(tmp_path / "one", {"model": {"w": torch.ones(3)}})
    _rewrite(out, edit)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        read_model_tensors(out)
