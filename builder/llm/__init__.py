"""The model layer: one async chat interface, its OpenAI-compatible backend, the managed vLLM server, the
response cache, usage accounting and a scripted model for tests. See docs/llm.md."""

from builder.llm.accounting import estimate_gpu_hours
from builder.llm.base import CallRecord, ChatModel, ChatRequest, Reply, StageModel, TokenUsage
from builder.llm.cache import ResponseCache
from builder.llm.client import LLMClient, tally
from builder.llm.connect import open_llm
from builder.llm.errors import (
    LLMError,
    LLMRequestError,
    PromptTooLongError,
    ServerError,
    ServerUnreachable,
    StructuredOutputError,
    TransientLLMError,
)
from builder.llm.openai_backend import OpenAIChatModel
from builder.llm.parsing import (
    ParsedToolCall,
    check_tool_call,
    check_tool_calls,
    function_tool,
    split_reasoning,
)
from builder.llm.scripted import ScriptedModel, text_reply, tool_reply
from builder.llm.server import VLLMServer

__all__ = [
    "CallRecord",
    "ChatModel",
    "ChatRequest",
    "LLMClient",
    "tally",
    "LLMError",
    "LLMRequestError",
    "OpenAIChatModel",
    "ParsedToolCall",
    "PromptTooLongError",
    "Reply",
    "ResponseCache",
    "ScriptedModel",
    "ServerError",
    "ServerUnreachable",
    "StageModel",
    "StructuredOutputError",
    "TokenUsage",
    "TransientLLMError",
    "VLLMServer",
    "check_tool_call",
    "check_tool_calls",
    "estimate_gpu_hours",
    "function_tool",
    "open_llm",
    "split_reasoning",
    "text_reply",
    "tool_reply",
]
