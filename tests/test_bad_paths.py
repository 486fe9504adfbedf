"""Output paths that cannot be written, and metadata that cannot be read: one line, exit 2 (issue 22).

Each case runs the real command on real files; the one line on stderr must name the path and the
cause, and nothing is written.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_corpus"
runner = CliRunner()


def refused(args: list, *words: str) -> str:
    """Run the CLI; assert exit 2 with one line on stderr holding every word; return that line."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _train(data_dir, out) -> list:
    return ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--data", data_dir,
            "--out", out, "--tokens", "512", "--batch-size", "8", "--seq-len", "32", "--threads", "1"]


def _tiny_spec(tmp_path: Path, data_dir: Path) -> Path:
    from depthtools.grid import grid_spec, plan_grid, save_grid

    cells = plan_grid(["preln"], budget=30_000, layers=[1], n_heads=2, ffn_multiple=8, tolerance=0.15, max_seq_len=32)
    train = {"tokens": 512, "batch_size": 8, "seq_len": 32, "eval_every": 0, "eval_tokens": 512, "threads": 1}
    return save_grid(grid_spec(cells, name="g", train=train, data={"dir": str(data_dir)}), tmp_path / "g.json")


# (name, build the args from (tmp_path, data_dir, a regular file, a folder), words of the one line)
OUT_PATHS = [
    ("train --out FILE", lambda t, d, f, _: _train(d, f), ["cell folder (--out)", "is an existing file, not a folder"]),
    ("train --out FILE/cell", lambda t, d, f, _: _train(d, f / "cell"), ["cannot be created", "is a file, not a folder"]),
    ("grid plan --out FOLDER", lambda t, d, f, folder: ["grid", "plan", "--preset", "tiny", "--out", folder],
     ["grid spec file (--out)", "is a folder; give a file name"]),
    ("grid plan --out FILE/x.json", lambda t, d, f, _: ["grid", "plan", "--preset", "tiny", "--out", f / "x.json"],
     ["cannot be created", "is a file"]),
    ("data prepare --out FILE", lambda t, d, f, _: ["data", "prepare", "--corpus", "text-dir", "--text-dir", FIXTURE,
                                                    "--out", f], ["data folder (--out)", "is an existing file"]),
    ("data prepare --input --out FILE", lambda t, d, f, _: ["data", "prepare", "--input", FIXTURE, "--out", f],
     ["data folder (--out)", "is an existing file"]),
    ("grid train --root FILE", lambda t, d, f, _: ["grid", "train", _tiny_spec(t, d), "--root", f],
     ["checkpoint root (--root)", "is an existing file"]),
]


@pytest.mark.parametrize("name,build,words", OUT_PATHS, ids=[c[0] for c in OUT_PATHS])
def test_an_output_path_that_is_the_wrong_kind_of_thing_is_one_line(name, build, words, tmp_path, data_dir):
    existing, folder = tmp_path / "notes.txt", tmp_path / "folder.json"
    existing.write_text("keep me")
    folder.mkdir()
    args = build(tmp_path, data_dir, existing, folder)
    line = refused(args, *words)
    assert str(existing) in line or str(folder) in line, line
    assert existing.read_text() == "keep me" and not any(folder.iterdir())
