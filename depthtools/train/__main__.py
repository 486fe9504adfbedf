"""`python -m depthtools.train RUN.json`: train one cell described by a JSON file.

RUN.json = {"model": ModelConfig dict, "train": TrainConfig dict, "data_dir": ..., "out_dir": ...,
"force": false}. Used to launch cells as separate processes (and by the kill-and-resume test);
re-running the same command resumes an interrupted run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.train.distributed import env_rank
from depthtools.train.loop import train_cell


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m depthtools.train RUN.json", file=sys.stderr)
        return 2
    try:
        run = json.loads(Path(argv[0]).read_text())
        summary = train_cell(ModelConfig.from_dict(run["model"]), TrainConfig.from_dict(run.get("train", {})),
                             run["data_dir"], run["out_dir"], force=bool(run.get("force", False)))
    except DepthToolsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if env_rank() == 0:  # under torchrun every rank trains; one summary is printed
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
