"""Where compiled code is cached on disk: inductor's FX-graph and AOTAutograd caches (depthtools.arch.compiled)
and, next to them, the built CPU kernels (depthtools.arch.cpu_kernels).

The folder: $DEPTHTOOLS_COMPILE_CACHE, else $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/depthtools/inductor (torch's
own default, /tmp/torchinductor_$USER, is cleared on reboot).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DEPTHTOOLS_COMPILE_CACHE"


def cache_dir() -> Path:
    """Where inductor's on-disk caches live (see the module docstring); sets TORCHINDUCTOR_CACHE_DIR
    for this process if it was not set, so compiled graphs are reused by later runs on this machine."""
    chosen = os.environ.get(CACHE_ENV) or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
        Path.home() / ".cache" / "depthtools" / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
    import torch._inductor.config as inductor_config  # heavy, one path: torch.compile's settings, loaded on first use
    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    return Path(chosen)
