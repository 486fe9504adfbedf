"""Does a planned model fit its data? The vocabulary check and the token-budget (epochs) check.

Both run at plan time (`grid plan --data`, a preset whose data is known), before a grid trains any
cell (`grid train`, every launcher) and when a cell starts training, with the numbers in the message.

Vocabulary: a model must have at least the tokenizer's ids and may pad its embedding up to the next
multiple of VOCAB_PAD (as GPT-NeoX/OLMo pad 50,277 or 50,280 ids to 50,304); anything else is a model
planned for another tokenizer (DepthBench's 50,280 on an 8k BPE, or 50,280 on bytes), refused.

Epochs: a cell's token budget over the train split's tokens. Above TrainConfig.max_epochs it is
refused; with max_epochs unset, above one epoch it is a warning (repeating a small corpus is how the
CPU presets run; a recipe that claims a paper's setting sets max_epochs=1).
"""

from __future__ import annotations

import logging
from typing import Any

from depthtools.errors import DepthToolsError

VOCAB_PAD = 128
NOMINAL_VOCAB = {"byte": 256, "bpe4k": 4096, "bpe8k": 8192}
logger = logging.getLogger(__name__)


def padded(vocab: int) -> int:
    return -(-vocab // VOCAB_PAD) * VOCAB_PAD


def vocab_problem(model_vocab: int, tokenizer: dict[str, Any], where: str) -> str | None:
    """Why a model with `model_vocab` cannot be trained on data with this tokenizer record, or None."""
    vocab, name = int(tokenizer["vocab_size"]), tokenizer.get("name", "?")
    if vocab <= model_vocab <= padded(vocab):
        return None
    allowed = f"{vocab:,}" if padded(vocab) == vocab else f"{vocab:,}..{padded(vocab):,} (padded to a multiple of {VOCAB_PAD})"
    return (f"model vocab_size={model_vocab:,} does not match the {name} tokenizer of {where} ({vocab:,} tokens): "
            f"vocab_size must be {allowed}; plan the grid with --vocab-size {vocab} (or `grid plan --data DIR`, "
            "which takes the vocabulary from the prepared data), or prepare the data with the tokenizer the model "
            "was planned for (`data prepare --tokenizer PATH/tokenizer.json`)")


def check_vocab(model_vocab: int, tokenizer: dict[str, Any], where: str, cell: str | None = None) -> None:
    problem = vocab_problem(model_vocab, tokenizer, where)
    if problem:
        raise DepthToolsError(f"{cell}: {problem}" if cell else problem)


def epochs_problem(budget_tokens: int, train_tokens: int, max_epochs: float | None, where: str,
                   cell: str | None = None, how: str | None = None) -> tuple[str, str] | None:
    """("error"|"warning", message) when a budget of `budget_tokens` repeats the train split too often, else None."""
    limit = 1.0 if max_epochs is None else float(max_epochs)
    if train_tokens <= 0:
        return ("error", f"{where} has no train tokens")
    epochs = budget_tokens / train_tokens
    if epochs <= limit:
        return None
    need = budget_tokens / limit
    head = f"{cell}: " if cell else ""
    text = (f"{head}token budget {budget_tokens:,} is {epochs:,.1f} epochs of the {train_tokens:,} train tokens in "
            f"{where}")
    if max_epochs is None:
        return ("warning", f"{text} (the corpus repeats; set max_epochs to refuse, or prepare more data)")
    fix = how or ("prepare more text with `depthtools data prepare --input ...` (docs/data.md)")
    return ("error", f"{text}, more than this recipe's max_epochs={limit:g}: it needs at least {need:,.0f} train "
                     f"tokens; {fix}, or raise max_epochs")


def text_tokens_read(train_cfg, params_total: int) -> int:
    """Corpus tokens a run reads: its steps x batch x seq_len, less the rows a task mix replaces
    (a task-only run, fraction 1, reads none)."""
    tokens = train_cfg.total_steps(params_total) * train_cfg.batch_size * train_cfg.seq_len
    mix = getattr(train_cfg, "task_mix", None)
    return round(tokens * (1.0 - (mix.fraction if mix is not None else 0.0)))


def check_epochs(budget_tokens: int, train_tokens: int, max_epochs: float | None, where: str,
                 cell: str | None = None, how: str | None = None, warn: bool = True) -> str | None:
    """Raise on an over-budget cell; log (when `warn`) and return the warning for one above 1 epoch with no
    limit set."""
    found = epochs_problem(budget_tokens, train_tokens, max_epochs, where, cell, how)
    if found is None:
        return None
    level, message = found
    if level == "error":
        raise DepthToolsError(message)
    if warn:
        logger.warning("%s", message)
    return message


def check_grid(cells, train_cfg_for, meta: dict[str, Any], where: str, how: str | None = None) -> list[str]:
    """Vocabulary and epoch checks of every cell of a grid against a prepared dataset's meta, before
    any cell trains: raises on the first refused cell, logs one line for the cells above one epoch
    (max_epochs unset) and returns those warnings."""
    warnings = []
    for cell in cells:
        check_vocab(cell.model_config().vocab_size, meta["tokenizer"], where, cell.name)
        cfg = train_cfg_for(cell)
        budget = text_tokens_read(cfg, cell.params_total)
        found = epochs_problem(budget, int(meta["splits"]["train"]["tokens"]), cfg.max_epochs, where, cell.name, how)
        if found and found[0] == "error":
            raise DepthToolsError(found[1])
        if found:
            warnings.append(found[1])
    if warnings:
        more = f" (and {len(warnings) - 1} more cell(s))" if len(warnings) > 1 else ""
        logger.warning("%s%s", warnings[0], more)
    return warnings
