"""Token lengths of the `sft` rows as a trainer tokenizes them, for the card's figures and its `max_length`.

Each row is rendered by the packaged ChatML+tools template with its `tools` and tokenized by the embedded
SmolLM2-135M-Instruct tokenizer, exactly as TRL's SFTTrainer does with that template (`apply_chat_template`,
`tokenize=True`). Other tokenizers give other counts; the card says which one counted. Without the embedded
model (it ships with the `cpu` extra) there are no figures, and the card says so.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import polars as pl

from builder.llm.errors import ServerError
from builder.llm.weights import chatml_tools_template, ensure_embedded_model

logger = logging.getLogger(__name__)

TOKENIZER_NAME = "SmolLM2-135M-Instruct"
LENGTH_STEP = 256  # the suggested max_length is the longest row rounded up to this


@dataclass(frozen=True)
class TokenStats:
    """Token counts of the `sft` rows under one tokenizer and template."""

    tokenizer: str
    lengths: tuple[int, ...]

    @property
    def max_length(self) -> int:
        """The `SFTConfig.max_length` that cuts no row: the longest, rounded up to a multiple of 256."""
        return max(LENGTH_STEP, math.ceil(max(self.lengths, default=0) / LENGTH_STEP) * LENGTH_STEP)

    def quantile(self, share: float) -> int:
        """The nearest-rank quantile (0.5: the median)."""
        ordered = sorted(self.lengths)
        return ordered[max(0, math.ceil(share * len(ordered)) - 1)] if ordered else 0


def load_tokenizer() -> Any | None:
    """The embedded tokenizer with the packaged template, or None (logged) when it cannot be had here."""
    try:
        from transformers import PreTrainedTokenizerFast  # what AutoTokenizer gives for it, at a third of the import

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(ensure_embedded_model()))
    except (ImportError, OSError, ServerError) as error:
        logger.warning("no token figures for the card: the embedded tokenizer is not available (%s)", error)
        return None
    tokenizer.chat_template = chatml_tools_template().read_text(encoding="utf-8")
    return tokenizer


def sft_token_stats(sft: pl.DataFrame, tokenizer: Any | None = None) -> TokenStats | None:
    """The token length of every `sft` row (None without a tokenizer); `tokenizer` defaults to the embedded one."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    if tokenizer is None:
        return None
    lengths = tuple(
        row_length(tokenizer, row["messages"], row["tools"]) for row in sft.select("messages", "tools").to_dicts()
    )
    return TokenStats(tokenizer=TOKENIZER_NAME, lengths=lengths)


def row_length(tokenizer: Any, messages: list[dict[str, Any]], tools: str | list | None) -> int:
    """Tokens of one conversation with its tools, rendered by the tokenizer's chat template."""
    schemas = json.loads(tools) if isinstance(tools, str) else tools
    encoded = tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=True, return_dict=True)
    return len(encoded["input_ids"])
