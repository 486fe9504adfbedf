"""Reading a sharded split back: one memmap per shard, joined into one 1-D array of tokens.

Kept apart from `shards` (which writes datasets) so that `prepare.load_split` reads either layout
without importing the writer, and the writer can use `prepare`'s folder rules: no import circle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from depthtools.errors import DepthToolsError


class ShardedTokens:
    """The shards of one split as one read-only 1-D array: len, int / slice / integer-array indexing.

    Windows that cross a shard boundary read from both shards, so the split behaves exactly as the
    concatenation of its shards (what `batch_offsets` indexes into).
    """

    def __init__(self, maps: list[np.ndarray]):
        self.maps = maps
        self.dtype = maps[0].dtype
        self.bounds = np.cumsum([0] + [len(m) for m in maps]).astype(np.int64)
        self.shape = (int(self.bounds[-1]),)
        self.ndim = 1

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(key)
            s = int(np.searchsorted(self.bounds, i, side="right") - 1)
            return self.maps[s][i - self.bounds[s]]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            return self._range(start, stop)
        index = np.asarray(key)
        if index.dtype == bool:
            return np.asarray(self)[index]
        flat = index.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + len(self), flat)
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} tokens")
        shard = np.searchsorted(self.bounds, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for s in np.unique(shard):
            mask = shard == s
            out[mask] = self.maps[s][flat[mask] - self.bounds[s]]
        return out.reshape(index.shape)

    def _range(self, start: int, stop: int) -> np.ndarray:
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first = int(np.searchsorted(self.bounds, start, side="right") - 1)
        pieces = []
        s = first
        while s < len(self.maps) and self.bounds[s] < stop:
            lo, hi = max(start, self.bounds[s]) - self.bounds[s], min(stop, self.bounds[s + 1]) - self.bounds[s]
            pieces.append(self.maps[s][lo:hi])
            s += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None):
        data = np.concatenate(self.maps) if self.maps else np.zeros(0, dtype=self.dtype)
        return data if dtype is None else data.astype(dtype)

    def __iter__(self):
        for m in self.maps:
            yield from m

    def __eq__(self, other):
        return np.asarray(self) == other

    def max(self):
        return max(m.max() for m in self.maps if len(m))

    def min(self):
        return min(m.min() for m in self.maps if len(m))


def load_sharded(data_dir: Path, info: dict, dtype: str):
    """One split of a sharded dataset: a memmap for one shard, a ShardedTokens over several."""
    dt = np.dtype(dtype)
    maps = []
    for shard in info["shards"]:
        path = data_dir / shard["file"]
        size = path.stat().st_size if path.is_file() else -1
        if size != dt.itemsize * shard["tokens"]:
            raise DepthToolsError(f"{path}: {size} bytes, meta.json says {shard['tokens']} {dt.name} tokens; prepare it again")
        if shard["tokens"]:
            maps.append(np.memmap(path, dtype=dt, mode="r"))
    if not maps:
        return np.zeros(0, dtype=dt)
    return maps[0] if len(maps) == 1 else ShardedTokens(maps)
