"""How much of a prompt repeats a prefix an earlier request of the run already sent: what vLLM's automatic
prefix caching can reuse instead of computing again (it keeps the KV cache of whole blocks of a prompt's start).

The prompt is read as text (tool schemas, then each message in order, as a chat template lays them out) in blocks
of BLOCK_CHARS characters; each block is keyed by a hash of everything up to its end, so a block counts as
reused only when the whole text before it was sent before, as with vLLM's block hashes. The figure is in
characters, a stand-in for tokens: the share is what matters (`stats.json`: `prefix_reuse` per stage).
"""

from __future__ import annotations

import hashlib
import json

from builder.llm.base import ChatRequest

BLOCK_CHARS = 64  # about vLLM's 16-token block
# Blocks remembered at most (~400 MB: ~100 B a block, its int and set slot); past it new prefixes are measured but
# not kept.
MAX_BLOCKS = 4_000_000


class PrefixIndex:
    """The prefixes the requests of one client have sent, by block."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def observe(self, text: str) -> tuple[int, int]:
        """(characters at the start of `text` that an earlier text already sent, in whole blocks; len(text)), and
        remember the prefixes of `text`."""
        chain, reused, hit = hashlib.blake2b(digest_size=8), 0, True
        for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
            chain.update(text[start : start + BLOCK_CHARS].encode("utf-8", "replace"))
            key = int.from_bytes(chain.digest(), "big")
            if hit and key in self._seen:
                reused += BLOCK_CHARS
                continue
            hit = False
            if len(self._seen) < MAX_BLOCKS:
                self._seen.add(key)
        return reused, len(text)


def prompt_text(request: ChatRequest) -> str:
    """The request's prompt as the text a chat template would start from: the tools, then the messages."""
    parts = [json.dumps(list(request.tools), ensure_ascii=False, sort_keys=True)] if request.tools else []
    for message in request.messages:
        calls = [call.model_dump() for call in message.tool_calls or ()]
        parts.append(f"<{message.role}>{message.content or ''}{json.dumps(calls) if calls else ''}")
    return "\n".join(parts)
