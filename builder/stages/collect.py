"""collect: read seed tasks from the configured source and drop what no environment can come from.

The cheap filters run here, before any model call: empty rows, non-English text, requests about media (images,
audio, video), requests too short or too long to describe a task, and repeats. Each drop is a rejection with a
stable reason code and the request text, so the stats say what was dropped and why.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from builder.records import Record, SeedTask
from builder.run.stage import StageContext
from builder.seeds import read_seeds

# Whole words only: EnvScaler's substring match also dropped "clipboard" and "soundproof".
MEDIA_WORDS = re.compile(
    r"\b(images?|photos?|photographs?|pictures?|videos?|audio|sounds?|speech|clips?|draw|drawing|painting|"
    r"sketch|selfie|voice ?notes?|recordings?)\b",
    re.IGNORECASE,
)


# Function words nearly every English request of six words or more contains; a cheap language check that
# needs no model (the LLM judge after it catches what slips through).
ENGLISH_WORDS = frozenset(
    "a an the to for of and or in on at by from with my me i you your our we is are be it this that if "
    "all any please can could would what which when where how not no next last before after under over".split()
)


def _looks_english(request: str) -> bool:
    letters = [ch for ch in request if ch.isalpha()]
    if letters and sum(ch.isascii() for ch in letters) / len(letters) < 0.9:
        return False
    words = re.findall(r"[a-z']+", request.casefold())
    return len(words) < 6 or any(word in ENGLISH_WORDS for word in words)


def cheap_filter_reason(request: str, *, min_words: int, max_words: int) -> str | None:
    """The reason code a request is dropped for without asking a model, or None to keep it."""
    if not _looks_english(request):
        return "language"
    if MEDIA_WORDS.search(request):
        return "media"
    words = len(request.split())
    if words < min_words:
        return "too_short"
    if words > max_words:
        return "too_long"
    return None


def _normalised(request: str) -> str:
    return " ".join(request.casefold().split()).rstrip(".!? ")


async def collect(_: Sequence[Record], ctx: StageContext) -> list[Record]:
    """Seed tasks from `mine.seeds`, with rejections for empty, foreign, media, bad-length and repeated ones."""
    mine = ctx.config.mine
    results: list[Record] = []
    seen: dict[str, str] = {}
    rows = read_seeds(mine.seeds, fmt=mine.seed_format, request_field=mine.request_field, split=mine.seeds_split)
    kept = 0
    for row in rows:
        if mine.max_seeds is not None and kept >= mine.max_seeds:
            break  # counted after the filters: a source full of repeats (API-Bank) still yields max_seeds tasks
        request = " ".join((row.request or "").split())
        seed = SeedTask(
            provenance=ctx.provenance(), source=mine.seeds, source_ref=row.ref, request=request, domain=row.domain
        )
        reason = (
            "empty" if not request else cheap_filter_reason(request, min_words=mine.min_words, max_words=mine.max_words)
        )
        if reason is None and _normalised(request) in seen:
            reason = "duplicate"
        if reason is not None:
            detail = f"row {row.ref}: {request[:300]}"
            if reason == "duplicate":
                detail += f" (repeats row {seen[_normalised(request)]})"
            results.append(ctx.reject(f"{seed.id}@{row.ref}", reason, detail))
            continue
        seen[_normalised(request)] = row.ref
        results.append(seed)
        kept += 1
    return results
