"""Synthetic serial-computation probes: byte-level task samples with a difficulty knob k and exact answers.

Four tasks, each needing k serial steps (docs/design.md: does extra depth become extra computation?):

    chase   k-hop pointer chasing / variable binding (k=2):  "S=Z;h=0;Z=3;V=Z;L=q;q=8;L?8"
            the query's chain has k bindings; a second chain of the same length ends in another digit,
            and extra bindings point into the chains or at digits, all in shuffled order, so neither position nor chain
            length gives the answer away (answer: one digit, chance 1/10).
    s5      composition of k permutations of 0..4 (the S5 word problem, k=2):  "30142*02431=30214"
            each block is one-line notation, p(i) = block[i]; the answer is the one-line notation of
            i -> p_k(...p_2(p_1(i))) (5 digits, chance 1/120).
    add     n-digit addition whose longest carry chain has exactly k positions (k=3):  "803412+176595=980007"
            (a chain is a maximal run of digit positions, from the least significant, that carry out);
            the sum is written most significant digit first, so its first digit needs the whole chain.
    hop     k-hop pointer chasing through a table (k=2):  "3947102658;4^2=9"  (t(4) = 1, t(1) = 9)
            the first ten digits are a permutation t of 0..9 (t[i] = the i-th digit), then the start s and
            k; the answer is t^k(s), t applied k times. The path s, t(s), ..., t^k(s) visits k+1 distinct
            entries (so k <= 9 and no cycle shortens it); the rest of t is random, and every digit appears
            once, so neither a table slot nor a digit's frequency gives the answer (answer: one digit).
            Unlike chase, each lookup is by position, not by name, which is what a model at the demo's
            scale learns (benchmarks/RESULTS.md, "Pointer chasing that is learned").

Every sample is ASCII text ``prompt + answer + "\\n"``: byte offsets equal character offsets, the text
encodes with `ByteTokenizer` and never contains NUL (id 0, the document separator). `answer_start` and
`answer_end` mark the answer span; the "\\n" after it is the end marker.

Randomness: each sample (evaluation) or each training row (mixing) draws from its own generator seeded by
a hash of integer keys, using only `random.random()` — the one stream Python promises to keep stable — so
a sample is a pure function of its keys: reproducible across processes, resumes and Python versions.

Training mix (`TaskMix`, the `TrainConfig.task_mix` field): in every training batch, each row is replaced
with probability `fraction` by a row of packed task samples ``0 s1 0 s2 0 ...`` (a row of seq_len+1
tokens, so the expected share of task tokens is also `fraction`). Which rows, and their content, depend
only on (seed, step, global row index): the same for every cell of a grid, and bit-identical on resume.

Task training (issue 17): `fraction=1` trains on the task stream alone; `answer_only=True` puts the loss
of task rows on their answer tokens and end markers only (text rows keep every target), so the gradient
is spent on the computation rather than on predicting random bindings; `curriculum` (a `Curriculum`)
starts every task at k_min and raises its level by one whenever the model answers `threshold` of
`n` held-out samples at that level, up to k_max; rows draw k uniformly from k_min..level, so solved
levels keep being rehearsed. The levels are part of the train state, so a resumed run draws the same rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from depthtools.errors import DepthToolsError

TASKS = ("chase", "s5", "add", "hop")
MIX_TASKS = ("chase", "s5", "add")  # TaskMix's default tasks (kept from before hop, so configs keep their meaning)
TASK_HELP = {
    "chase": "k-hop pointer chasing with a decoy chain and distractor bindings (answer: 1 digit)",
    "s5": "compose k permutations of 0..4, left to right (answer: 5-digit one-line notation)",
    "add": "n-digit addition whose longest carry chain has exactly k positions (answer: the sum)",
    "hop": "follow a 10-entry table t from s k times: t^k(s) (answer: 1 digit)",
}
CHASE_NAMES = string.ascii_lowercase + string.ascii_uppercase
CHASE_EXTRA = 2  # distractor bindings besides the decoy chain
HOP_TABLE = 10  # entries of hop's table: the digits 0..9 are both its indices and its values
MAX_K = {"chase": (len(CHASE_NAMES) - CHASE_EXTRA) // 2, "s5": 10_000, "add": 10_000, "hop": HOP_TABLE - 1}
END = "\n"

# first key of every generator stream, so evaluation samples, mix rows and the row mask never share one
_EVAL_STREAM, _ROW_STREAM, _MASK_STREAM = 0x5EED_0001, 0x5EED_0002, 0x5EED_0003


# -- randomness ----------------------------------------------------------------------------------
class Draw:
    """A random stream keyed by integers, built only on `random.random()` (stable across Python versions)."""

    def __init__(self, *keys: int):
        digest = hashlib.blake2b(",".join(str(int(k)) for k in keys).encode(), digest_size=16).digest()
        self._random = random.Random(int.from_bytes(digest, "little")).random

    def uniform(self) -> float:
        return self._random()

    def below(self, n: int) -> int:
        """An integer in 0..n-1."""
        return min(int(self._random() * n), n - 1)

    def between(self, lo: int, hi: int) -> int:
        """An integer in lo..hi (inclusive)."""
        return lo + self.below(hi - lo + 1)

    def pick(self, items: Sequence):
        return items[self.below(len(items))]

    def shuffle(self, items: list) -> list:
        """Fisher-Yates in place; returns the list."""
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]
        return items

    def sample(self, items: Sequence, m: int) -> list:
        """m distinct items in random order (a partial Fisher-Yates shuffle)."""
        pool = list(items)
        for i in range(m):
            j = i + self.below(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:m]


# -- samples -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSample:
    """One task instance: `text` = prompt + answer + "\\n"; the answer is text[answer_start:answer_end]."""

    task: str
    k: int
    text: str
    answer_start: int
    answer_end: int

    @property
    def prompt(self) -> str:
        return self.text[:self.answer_start]

    @property
    def answer(self) -> str:
        return self.text[self.answer_start:self.answer_end]

    def tokens(self) -> np.ndarray:
        """Byte-level token ids (ByteTokenizer) as uint16; offsets in tokens equal offsets in text."""
        return np.frombuffer(self.text.encode("ascii"), dtype=np.uint8).astype(np.uint16)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "prompt": self.prompt, "answer": self.answer}


def _chase(k: int, draw: Draw) -> tuple[str, str]:
    names = draw.sample(CHASE_NAMES, 2 * k + CHASE_EXTRA)
    chain, decoy, extra = names[:k], names[k:2 * k], names[2 * k:]
    value = draw.below(10)
    decoy_value = (value + 1 + draw.below(9)) % 10  # a different digit
    bindings = []
    for variables, end in ((chain, value), (decoy, decoy_value)):
        bindings += [(variables[i], variables[i + 1]) for i in range(k - 1)] + [(variables[-1], str(end))]
    targets = chain + decoy + list(string.digits)
    bindings += [(name, draw.pick(targets)) for name in extra]  # nothing points at an extra: chains stay intact
    draw.shuffle(bindings)
    return ";".join(f"{lhs}={rhs}" for lhs, rhs in bindings) + f";{chain[0]}?", str(value)


def _s5(k: int, draw: Draw) -> tuple[str, str]:
    perms = [draw.shuffle(list(range(5))) for _ in range(k)]
    image = list(range(5))  # image[i] = p_j(...p_1(i)) after j steps
    for p in perms:
        image = [p[x] for x in image]
    return "*".join("".join(map(str, p)) for p in perms) + "=", "".join(map(str, image))


# digit pairs (a, b) for each role of a position in the addition generator; top: the leading digits (no 0)
_SUMS = {"generate": range(10, 19), "propagate": (9,), "stop": range(0, 9), "free": range(19)}
_PAIRS = {(role, top): [(a, s - a) for s in sums for a in range(10) if 0 <= s - a <= 9 and (not top or (a and s - a))]
          for role, sums in _SUMS.items() for top in (False, True)}


def longest_carry_chain(a: int, b: int) -> int:
    """Length of the longest run of consecutive digit positions that carry out when adding a + b."""
    best = run = carry = 0
    while a or b or carry:
        carry = int(a % 10 + b % 10 + carry >= 10)
        run = run + 1 if carry else 0
        best = max(best, run)
        a, b = a // 10, b // 10
    return best


def _add(k: int, draw: Draw) -> tuple[str, str]:
    n = k + draw.between(1, 3)  # digits per operand
    start = draw.between(0, n - k)  # the chain covers digit positions start..start+k-1 (0 = units)
    for attempt in range(100):
        digits = []
        for i in range(n):
            if i == start:
                role = "generate"  # a carry starts here
            elif start < i < start + k:
                role = "propagate"  # digit sum 9: passes it on
            elif i == start + k or i == start - 1:
                role = "stop"  # sum <= 8: neither extends the chain's end nor feeds into its start
            else:
                role = "free" if attempt < 99 else "stop"  # the last attempt cannot fail
            digits.append(draw.pick(_PAIRS[role, i == n - 1]))
        a = int("".join(str(d[0]) for d in reversed(digits)))
        b = int("".join(str(d[1]) for d in reversed(digits)))
        if longest_carry_chain(a, b) == k:  # a random stretch elsewhere may form a longer chain: redraw
            return f"{a}+{b}=", str(a + b)
    raise AssertionError("unreachable: the last attempt has no free positions")


def _hop(k: int, draw: Draw) -> tuple[str, str]:
    path = draw.sample(range(HOP_TABLE), k + 1)  # s = path[0] -> path[1] -> ... -> path[k], all distinct
    table = [0] * HOP_TABLE
    for here, there in zip(path, path[1:]):
        table[here] = there
    # the rest is a random bijection from the entries not yet set to the values not yet used
    sources = [i for i in range(HOP_TABLE) if i not in path[:-1]]
    values = draw.shuffle([v for v in range(HOP_TABLE) if v not in path[1:]])
    for here, there in zip(sources, values):
        table[here] = there
    return "".join(map(str, table)) + f";{path[0]}^{k}=", str(path[k])


GENERATORS: dict[str, Callable[[int, Draw], tuple[str, str]]] = {"chase": _chase, "s5": _s5, "add": _add, "hop": _hop}


def check_task(task: str) -> str:
    if task not in GENERATORS:
        raise DepthToolsError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    return task


def check_k(task: str, k: int) -> int:
    check_task(task)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise DepthToolsError(f"k must be an integer >= 1 (the number of serial steps), got {k!r}")
    if k > MAX_K[task]:
        why = (f"{len(CHASE_NAMES)} variable names, {CHASE_EXTRA} kept for distractors" if task == "chase" else
               f"a path of k+1 distinct entries in a {HOP_TABLE}-entry table")
        raise DepthToolsError(f"k={k} is too large for {task!r}: at most {MAX_K[task]} ({why})")
    return int(k)


def make_sample(task: str, k: int, draw: Draw) -> TaskSample:
    """One sample of `task` with difficulty `k`, drawn from `draw`."""
    prompt, answer = GENERATORS[check_task(task)](check_k(task, k), draw)
    return TaskSample(task, int(k), prompt + answer + END, len(prompt), len(prompt) + len(answer))


def generate(task: str, k: int, n: int, seed: int = 0) -> list[TaskSample]:
    """`n` samples of `task` at difficulty `k`; sample i depends only on (seed, task, k, i)."""
    check_k(task, k)
    if n < 1:
        raise DepthToolsError(f"n must be >= 1 samples, got {n}")
    code = TASKS.index(task)
    return [make_sample(task, k, Draw(_EVAL_STREAM, seed, code, k, i)) for i in range(n)]


def parse_k(spec: str | int | Iterable[int]) -> list[int]:
    """k values from "3", "1-8", "1,2,4" (or an int / iterable); sorted, unique, each >= 1."""
    if isinstance(spec, (int, np.integer)):
        values = [int(spec)]
    elif isinstance(spec, str):
        values = []
        for part in (p.strip() for p in spec.split(",")):
            match = re.fullmatch(r"(-?\d+)(?:\s*-\s*(-?\d+))?", part)
            if match is None:
                raise DepthToolsError(f"cannot read k {spec!r}; use a number, a range like 1-8, or a list like 1,2,4")
            lo, hi = int(match[1]), int(match[2] if match[2] is not None else match[1])
            if hi < lo:
                raise DepthToolsError(f"k range {part!r} runs backwards; write it low-high, e.g. {hi}-{lo}")
            values += list(range(lo, hi + 1))
    else:
        values = [int(v) for v in spec]
    if not values:
        raise DepthToolsError(f"k {spec!r} names no value; use a number, a range like 1-8, or a list like 1,2,4")
    bad = [v for v in values if v < 1]
    if bad:
        raise DepthToolsError(f"k must be >= 1 (the number of serial steps), got {bad[0]}")
    return sorted(set(values))


def parse_tasks(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """Task names from "chase,s5" (or an iterable; None = all), validated, in TASKS order."""
    names = TASKS if spec is None else [t.strip() for t in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [t for t in names if t]
    if not names:
        raise DepthToolsError(f"no task named; valid: {', '.join(TASKS)}")
    for t in names:
        check_task(t)
    return tuple(t for t in TASKS if t in names)


# -- training mix --------------------------------------------------------------------------------
def max_sample_tokens(task: str, k: int) -> int:
    """Upper bound on the tokens of one training sample (separator + prompt + answer + end marker).

    chase: 2k+2 bindings of 4 bytes ("a=b;"), the query "a?" and a 1-digit answer; s5: k blocks of 6
    bytes ("01234*", the last one "="), a 5-digit answer; add: two operands of at most k+3 digits, "+",
    "=" and a sum of at most k+4 digits; hop: the table, ";", s, "^", k, "=" and a 1-digit answer.
    """
    check_k(task, k)
    body = {"chase": 4 * (2 * k + CHASE_EXTRA) + 2 + 1, "s5": 6 * k + 5, "add": 2 * (k + 3) + 2 + (k + 4),
            "hop": HOP_TABLE + 3 + len(str(k)) + 1 + 1}[task]
    return 1 + body + len(END)


@dataclass(frozen=True)
class Curriculum:
    """Curriculum over k: every `every` steps each task's level rises by one (up to k_max) when the model
    answers at least `threshold` of `n` held-out samples at its current level exactly.

    JSON form (inside task_mix): {"threshold": 0.9, "every": 50, "n": 64}. The held-out samples come from
    their own stream (seed `CURRICULUM_SEED` + the run's seed), never the training rows or the evaluation
    samples of `depthtools tasks eval` (seed 0, 1, ...).
    """

    threshold: float = 0.9
    every: int = 50
    n: int = 64

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1:
            raise DepthToolsError(f"task_mix.curriculum.threshold must lie in (0, 1] (accuracy), got {t!r}")
        object.__setattr__(self, "threshold", float(t))
        for name in ("every", "n"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DepthToolsError(f"task_mix.curriculum.{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_value(cls, value: "Curriculum | dict[str, Any] | bool") -> "Curriculum":
        if isinstance(value, cls):
            return value
        if value is True:
            return cls()
        if not isinstance(value, dict):
            raise DepthToolsError("task_mix.curriculum must be a dict like {'threshold': 0.9, 'every': 50, 'n': 64} "
                                  f"or true, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise DepthToolsError(f"unknown task_mix.curriculum field(s) {unknown}; valid: {sorted(known)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "every": self.every, "n": self.n}

    def held_out(self, task: str, k: int, seed: int) -> list[TaskSample]:
        """The fixed samples that decide whether `task` advances past level `k` in a run with `seed`."""
        return generate(task, k, self.n, seed=CURRICULUM_SEED + int(seed))

    def advance(self, levels: dict[str, int], accuracy: dict[str, float], k_max: int) -> dict[str, int]:
        """The next levels: +1 for each task whose accuracy at its level reached the threshold (capped)."""
        return {t: min(k_max, k + 1) if accuracy.get(t, 0.0) >= self.threshold else k for t, k in levels.items()}


CURRICULUM_SEED = 1_000_003  # held-out curriculum samples: generate(..., seed=CURRICULUM_SEED + run seed)


@dataclass(frozen=True)
class TaskMix:
    """Task sequences mixed into training: `fraction` of the rows (= of the tokens), k uniform in k_min..k_max.

    JSON form (the `task_mix` field of TrainConfig / a grid spec's "train" section):
        {"fraction": 0.05, "tasks": ["chase", "s5", "add"], "k_min": 1, "k_max": 4}
    """

    fraction: float
    tasks: tuple[str, ...] = MIX_TASKS
    k_min: int = 1
    k_max: int = 4
    answer_only: bool = False  # loss of task rows on answer + end marker only
    curriculum: "Curriculum | None" = None  # levels rise from k_min as the model solves them

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks) if not isinstance(self.tasks, str) else (self.tasks,))
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise DepthToolsError(f"task_mix.fraction must lie in (0, 1] (share of training rows), got {fraction!r}")
        object.__setattr__(self, "fraction", float(self.fraction))
        if not self.tasks:
            raise DepthToolsError(f"task_mix.tasks must name at least one task; valid: {', '.join(TASKS)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise DepthToolsError(f"task_mix.tasks repeats a task: {list(self.tasks)}")
        for t in self.tasks:
            check_task(t)
        for name in ("k_min", "k_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DepthToolsError(f"task_mix.{name} must be an integer >= 1, got {value!r}")
        if self.k_max < self.k_min:
            raise DepthToolsError(f"task_mix.k_max={self.k_max} is below k_min={self.k_min}")
        for t in self.tasks:
            check_k(t, self.k_max)
        if not isinstance(self.answer_only, bool):
            raise DepthToolsError(f"task_mix.answer_only must be true or false, got {self.answer_only!r}")
        if self.curriculum is not None:
            object.__setattr__(self, "curriculum", Curriculum.from_value(self.curriculum))

    @classmethod
    def from_value(cls, value: "TaskMix | dict[str, Any]") -> "TaskMix":
        """A TaskMix from itself or its JSON dict (unknown keys are an error naming the valid ones)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise DepthToolsError(f"task_mix must be a dict like {{'fraction': 0.05}}, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise DepthToolsError(f"unknown task_mix field(s) {unknown}; valid: {sorted(known)}")
        if "fraction" not in value:
            raise DepthToolsError("task_mix needs a 'fraction' (share of training rows, e.g. 0.05)")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        """JSON form; the issue-17 fields appear only when set, so older configs keep their run fingerprint."""
        out = {"fraction": self.fraction, "tasks": list(self.tasks), "k_min": self.k_min, "k_max": self.k_max}
        if self.answer_only:
            out["answer_only"] = True
        if self.curriculum is not None:
            out["curriculum"] = self.curriculum.to_dict()
        return out

    def start_levels(self) -> dict[str, int]:
        """The k level each task starts at: k_min under a curriculum, else k_max (the whole range)."""
        return {t: self.k_min if self.curriculum is not None else self.k_max for t in self.tasks}

    def longest_row_sample(self) -> int:
        """Tokens of the longest possible sample (separator included) at k_max, over the mix's tasks."""
        return max(max_sample_tokens(t, self.k_max) for t in self.tasks)

    def covers(self, task: str, k: int) -> bool:
        """Whether (task, k) is inside the training distribution."""
        return task in self.tasks and self.k_min <= k <= self.k_max


def task_row(mix: TaskMix, seed: int, step: int, row: int, length: int,
             levels: dict[str, int] | None = None) -> np.ndarray:
    """Row `row` of step `step` as task text: ``0 s1 0 s2 0 ...`` cut to `length` tokens (int64)."""
    return task_row_and_answers(mix, seed, step, row, length, levels)[0]


def task_row_and_answers(mix: TaskMix, seed: int, step: int, row: int, length: int,
                         levels: dict[str, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, is_answer): the row as in `task_row`, and a bool mask marking each answer token and end marker.

    Each sample draws its task uniformly from mix.tasks and k uniformly from k_min..levels[task]
    (levels None: k_max, the whole range).
    """
    draw = Draw(_ROW_STREAM, seed, step, row)
    out = np.empty(length, dtype=np.int64)
    answer = np.zeros(length, dtype=bool)
    filled = 0
    while filled < length:
        task = draw.pick(mix.tasks)
        top = mix.k_max if levels is None else levels[task]
        prompt, solution = GENERATORS[task](draw.between(mix.k_min, top), draw)
        piece = b"\0" + (prompt + solution + END).encode("ascii")
        take = min(len(piece), length - filled)
        out[filled:filled + take] = np.frombuffer(piece[:take], dtype=np.uint8)
        first = filled + 1 + len(prompt)  # answer bytes, then the end marker
        answer[first:min(first + len(solution) + len(END), length)] = True
        filled += take
    return out, answer


class TaskMixer:
    """Replaces a `fraction` of each training batch's rows by task rows, as a pure function of (seed, step, row)
    and the curriculum `levels` (a dict task -> k level; the trainer keeps it in the train state).

    `batch_size` is the global batch (rows are numbered 0..batch_size-1 across all ranks); a rank that holds
    only some rows passes their global indices to `apply`.
    """

    def __init__(self, mix: TaskMix | dict[str, Any], seed: int, batch_size: int, seq_len: int,
                 tokenizer: str = "byte"):
        if tokenizer != "byte":
            raise DepthToolsError(f"task_mix needs a byte-level dataset (tokenizer 'byte'), but this data uses "
                                  f"{tokenizer!r}; prepare the corpus with --tokenizer byte or drop task_mix")
        self.mix, self.seed, self.batch_size, self.seq_len = TaskMix.from_value(mix), int(seed), batch_size, seq_len
        longest = self.mix.longest_row_sample()
        if self.mix.answer_only and longest > seq_len + 1:
            raise DepthToolsError(
                f"task_mix: a k_max={self.mix.k_max} sample can need {longest} tokens, more than a training row "
                f"(seq_len+1 = {seq_len + 1}); with answer_only its answer could be cut off: lower k_max or raise seq_len")
        self.levels = self.mix.start_levels()

    def set_levels(self, levels: dict[str, Any] | None) -> None:
        """Restore curriculum levels (from a train state); None keeps the start levels."""
        if levels is None:
            return
        if not isinstance(levels, dict) or set(levels) != set(self.mix.tasks):
            raise DepthToolsError(f"train state task levels {levels!r} do not match the task mix {list(self.mix.tasks)}")
        for task, k in levels.items():
            if isinstance(k, bool) or not isinstance(k, int) or not self.mix.k_min <= k <= self.mix.k_max:
                raise DepthToolsError(f"train state task level {task}={k!r} lies outside "
                                      f"k_min..k_max = {self.mix.k_min}..{self.mix.k_max}")
        self.levels = {t: int(levels[t]) for t in self.mix.tasks}

    def task_rows(self, step: int) -> np.ndarray:
        """[batch_size] bool: which global rows of `step` are task rows."""
        draw = Draw(_MASK_STREAM, self.seed, step)
        return np.array([draw.uniform() < self.mix.fraction for _ in range(self.batch_size)], dtype=bool)

    def apply(self, data, step: int, rows: Sequence[int] | None = None):
        """Windows [n, seq_len+1] (tensor or array) with their task rows replaced (in place); returns data."""
        return self.apply_with_answers(data, step, rows)[0]

    def apply_with_answers(self, data, step: int, rows: Sequence[int] | None = None):
        """(data, is_answer): as `apply`, plus a bool array [n, seq_len+1] that is True on every token of a
        text row and on the answer tokens and end markers of a task row (what answer-only training scores)."""
        rows = range(len(data)) if rows is None else rows
        mask = self.task_rows(step)
        scored = np.ones(tuple(data.shape), dtype=bool)
        for i, row in enumerate(rows):
            if mask[row]:
                values, answers = task_row_and_answers(self.mix, self.seed, step, int(row), data.shape[1], self.levels)
                data[i] = values if isinstance(data, np.ndarray) else _as_tensor(values, data)
                scored[i] = answers
        return data, scored


def _as_tensor(values: np.ndarray, like):
    import torch  # lazy: keeps depthtools.data torch-free

    return torch.from_numpy(values).to(dtype=like.dtype)


__all__ = [
    "TASKS", "MIX_TASKS", "TASK_HELP", "MAX_K", "HOP_TABLE", "END", "CURRICULUM_SEED", "Curriculum", "Draw",
    "TaskSample", "TaskMix", "TaskMixer", "check_k", "check_task", "generate", "longest_carry_chain", "make_sample", "max_sample_tokens",
    "parse_k", "parse_tasks", "task_row", "task_row_and_answers",
]
