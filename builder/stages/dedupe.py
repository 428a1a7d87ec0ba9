"""dedupe: drop topics that repeat another one, then cap topics per domain and in total.

Exact repeats (same name) and near-duplicates (cosine similarity of name + description embeddings at or above
`mine.dedup_threshold`) are merged into the best-scoring topic, which keeps the example requests of both. Then
`mine.max_per_domain` and `mine.max_topics` keep the best-scoring topics, so one domain cannot dominate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from builder.embeddings import embed
from builder.records import Record, Topic
from builder.run.stage import StageContext


def _score(topic: Topic) -> tuple[float, float, str]:
    return (-(topic.modelability + topic.usefulness), -topic.modelability, topic.id)


async def dedupe(topics: Sequence[Topic], ctx: StageContext) -> list[Record]:
    """Kept topics (best first) and rejections: duplicate, near_duplicate, domain_cap, max_topics."""
    mine = ctx.config.mine
    ranked = sorted(topics, key=_score)
    vectors = embed([f"{t.name.replace('_', ' ')}: {t.description}" for t in ranked], mine.embedding_model)
    kept: list[int] = []
    merged: dict[int, list[str]] = {}
    results: list[Record] = []
    for index, topic in enumerate(ranked):
        twin = next((k for k in kept if ranked[k].name == topic.name), None)
        reason = "duplicate"
        if twin is None and kept:
            similarities = vectors[kept] @ vectors[index]
            best = int(similarities.argmax())
            if similarities[best] >= mine.dedup_threshold:
                twin, reason = kept[best], "near_duplicate"
        if twin is not None:
            merged[twin].extend(topic.example_requests)
            detail = f"{topic.name} repeats {ranked[twin].name} ({ranked[twin].id})"
            if reason == "near_duplicate":
                detail += f", similarity {float(vectors[twin] @ vectors[index]):.3f}"
            results.append(ctx.reject(topic, reason, detail))
            continue
        kept.append(index)
        merged[index] = list(topic.example_requests)
    per_domain: Counter[str] = Counter()
    accepted = 0
    for index in kept:
        topic = ranked[index]
        if mine.max_per_domain is not None and per_domain[topic.domain] >= mine.max_per_domain:
            results.append(ctx.reject(topic, "domain_cap", f"{topic.domain} already has {mine.max_per_domain}"))
            continue
        if accepted >= mine.max_topics:
            results.append(ctx.reject(topic, "max_topics", f"mine.max_topics = {mine.max_topics} reached"))
            continue
        per_domain[topic.domain] += 1
        accepted += 1
        examples = tuple(dict.fromkeys(merged[index]))
        results.append(
            topic.model_copy(update={"example_requests": examples}) if examples != topic.example_requests else topic
        )
    return results
