"""Reading environments written elsewhere: EnvScaler's released rows, and Python modules of API classes.

Nothing here runs the code it reads: a source is parsed into `SourceEnv`s (the module text, what the source says
about it, its scenarios) and every judgement is left to the sandbox stages. A source's `revision` pins the bytes
read: `sha256:` of the files, or the Hub dataset's commit.

EnvScaler (docs/import.md): a JSON list (or the repo's dict keyed by `env_id`, or JSON Lines) of
environment rows `env_id`, `env_class_name`, `env_class_code`, `environment_introduction`, `constraints_rules`,
...; scenario rows `env_id`, `task_id`, `init_config` (a JSON string), `task`, `checklist_with_func`
[{check_item, check_func}]. An `env_id` ending in `_rl` or `_sft` gives the split (`rl`, `train`). A location
that is a folder or a Hub dataset id (`owner/name`, optionally `@revision`) is read with `datasets`.

Classes: each module (or each `*.py` under a folder) is one environment, its class the last top-level class with
public methods (helper classes come first in BFCL's modules); `NAME.state.json` beside `NAME.py`, when present,
is its default state (attribute -> value, set after the constructor). What a module imports from a sibling module
(BFCL's `long_context` constants) is inlined into its code (`siblings`), so each environment stays one module.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from builder.errors import OperatorError
from builder.pyast import parse
from builder.records import Origin
from builder.stages.imports.siblings import inline_siblings

STATE_SUFFIX = ".state.json"  # `api.state.json` is the default state of `api.py`
SPLIT_SUFFIXES = {"_rl": "rl", "_sft": "train"}


class SourceError(OperatorError):
    """A source cannot be read at all (missing file, not JSON, no rows); bad single rows are `Skipped` instead."""


@dataclass(frozen=True)
class SourceScenario:
    ref: str  # the scenario's id in the source (EnvScaler's task_id)
    initial_state: dict[str, Any]
    task: str
    checklist: tuple[str, ...]
    check_functions: tuple[str, ...]  # EnvScaler `def check_func(final_state)` sources, one per checklist item


@dataclass(frozen=True)
class SourceEnv:
    ref: str  # the environment's id in the source: EnvScaler's env_id, or `path/to/module.py`
    name: str
    class_name: str  # what the source says the class is ('' when it does not say)
    description: str
    domain: str
    code: str
    split: Literal["train", "rl"] | None = None
    default_state: dict[str, Any] | None = None
    scenarios: tuple[SourceScenario, ...] = ()


@dataclass(frozen=True)
class Skipped:
    """A row or file that could not be read into an environment or scenario, and why (stable `reason`)."""

    ref: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Source:
    kind: Literal["envscaler", "classes"]
    location: str
    revision: str
    envs: tuple[SourceEnv, ...]
    skipped: tuple[Skipped, ...] = field(default=())

    def origin(self, ref: str, split: Literal["train", "rl"] | None = None) -> Origin:
        return Origin(source=self.kind, location=self.location, revision=self.revision, ref=ref, split=split)

    def env(self, ref: str) -> SourceEnv | None:
        return next((env for env in self.envs if env.ref == ref), None)


# ------------------------------------------------------------------------------------------------ EnvScaler


def read_envscaler(env_location: str, scenario_locations: Sequence[str] = ()) -> Source:
    """The environments of an EnvScaler release with their scenarios; raises SourceError if a location is unreadable."""
    env_rows, revision = _rows(env_location)
    scenario_rows: list[dict[str, Any]] = []
    revisions = [revision]
    for location in scenario_locations:
        rows, scenario_revision = _rows(location)
        scenario_rows += rows
        revisions.append(scenario_revision)
    skipped: list[Skipped] = []
    by_env: dict[str, list[SourceScenario]] = {}
    for index, row in enumerate(scenario_rows):
        made = _envscaler_scenario(row, index)
        if isinstance(made, Skipped):
            skipped.append(made)
        else:
            by_env.setdefault(str(row["env_id"]), []).append(made)
    envs: list[SourceEnv] = []
    for index, row in enumerate(env_rows):
        made = _envscaler_env(row, index, tuple(by_env.pop(str(row.get("env_id")), ())))
        (skipped if isinstance(made, Skipped) else envs).append(made)  # type: ignore[arg-type]
    for env_id, orphans in sorted(by_env.items()):
        skipped += [Skipped(s.ref, "env_missing", f"no environment {env_id!r} in {env_location}") for s in orphans]
    # One revision for the whole import: the environment file's alone when no scenario file was given.
    joined = revisions[0] if len(revisions) == 1 else "sha256:" + _sha256("\n".join(revisions).encode())
    return Source("envscaler", env_location, joined, tuple(envs), tuple(skipped))


def _envscaler_env(row: dict[str, Any], index: int, scenarios: tuple[SourceScenario, ...]) -> SourceEnv | Skipped:
    env_id = row.get("env_id")
    code = row.get("env_class_code")
    if not isinstance(env_id, str) or not env_id or not isinstance(code, str):
        return Skipped(str(env_id or f"row {index}"), "bad_row", "an environment row needs env_id and env_class_code")
    class_name = str(row.get("env_class_name") or "")
    rules = [str(rule) for rule in row.get("constraints_rules") or () if str(rule).strip()]
    about = str(row.get("environment_introduction") or row.get("environment_summary") or "").strip()
    if rules:  # EnvScaler shows the agent its introduction followed by the bulleted rules
        about = about + "\n\nRules:\n" + "\n".join(f"- {rule}" for rule in rules)
    split = next((s for suffix, s in SPLIT_SUFFIXES.items() if env_id.endswith(suffix)), None)
    name = _snake(class_name) if class_name else _snake(env_id)
    return SourceEnv(env_id, name, class_name, about or name, "envscaler", code, split, None, scenarios)  # type: ignore[arg-type]


def _envscaler_scenario(row: dict[str, Any], index: int) -> SourceScenario | Skipped:
    ref = str(row.get("task_id") or f"scenario row {index}")
    if not isinstance(row.get("env_id"), str) or not isinstance(row.get("task"), str):
        return Skipped(ref, "bad_row", "a scenario row needs env_id and task")
    config = row.get("init_config") or "{}"
    try:
        state = json.loads(config) if isinstance(config, str) else config
    except json.JSONDecodeError as error:
        return Skipped(ref, "bad_row", f"init_config is not JSON: {error}")
    if not isinstance(state, dict):
        return Skipped(ref, "bad_row", "init_config is not a JSON object")
    items = row.get("checklist_with_func") or []
    if isinstance(items, str):  # some copies keep it as JSON text, like init_config
        try:
            items = json.loads(items)
        except json.JSONDecodeError:
            return Skipped(ref, "bad_row", "checklist_with_func is not JSON")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        return Skipped(ref, "bad_row", "checklist_with_func is not a list of {check_item, check_func}")
    checklist = tuple(str(item.get("check_item", "")) for item in items)
    functions = tuple(str(item.get("check_func", "")) for item in items)
    return SourceScenario(ref, state, row["task"], checklist, functions)


# ---------------------------------------------------------------------------------------------------- classes


def read_classes(paths: Sequence[str]) -> Source:
    """One environment per module found under `paths`; raises SourceError if a path does not exist or has none."""
    files: list[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            files += sorted(p for p in given.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)
        elif given.is_file():
            files.append(given)
        else:
            raise SourceError(f"{given} does not exist")
    if not files:
        raise SourceError(f"no Python modules under {', '.join(paths)}")
    envs: list[SourceEnv] = []
    skipped: list[Skipped] = []
    read: list[Path] = []
    for path in files:
        made, siblings = _class_env(path)
        (skipped if isinstance(made, Skipped) else envs).append(made)  # type: ignore[arg-type]
        read += [path] + ([path.with_suffix(STATE_SUFFIX)] if path.with_suffix(STATE_SUFFIX).exists() else [])
        read += [sibling for sibling in siblings if sibling not in read]
    digest = hashlib.sha256()
    for path in read:
        digest.update(f"{path}\0".encode() + path.read_bytes() + b"\0")
    location = paths[0] if len(paths) == 1 else ", ".join(paths)
    return Source("classes", location, f"sha256:{digest.hexdigest()}", tuple(envs), tuple(skipped))


def _class_env(path: Path) -> tuple[SourceEnv | Skipped, tuple[Path, ...]]:
    """The environment of one module (its sibling imports inlined) and the sibling files that were read."""
    code, siblings = inline_siblings(path.read_text(encoding="utf-8", errors="replace"), path)
    class_name, description = _class_of(code)
    state_path = path.with_suffix(STATE_SUFFIX)
    state = None
    if state_path.exists():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            return Skipped(str(path), "bad_state_file", f"{state_path.name} is not JSON: {error}"), siblings
        if not isinstance(state, dict):
            return Skipped(str(path), "bad_state_file", f"{state_path.name} is not a JSON object"), siblings
    name = _snake(class_name or path.stem)
    return SourceEnv(str(path), name, class_name, description or name, path.stem, code, None, state), siblings


def _class_of(code: str) -> tuple[str, str]:
    """(class name, its docstring's first paragraph) of the environment class, ('', '') if the module does not
    parse: the sandbox stages then report why."""
    try:
        tree = parse(code)
    except SyntaxError:
        return "", ""
    classes = [
        node for node in tree.body
        if isinstance(node, ast.ClassDef)
        and any(isinstance(n, ast.FunctionDef) and not n.name.startswith("_") for n in node.body)
    ]  # fmt: skip
    if not classes:
        return "", ""
    doc = ast.get_docstring(classes[-1]) or ast.get_docstring(tree) or ""
    return classes[-1].name, " ".join(doc.split("\n\n")[0].split())


# ----------------------------------------------------------------------------------------------------- rows


def _rows(location: str) -> tuple[list[dict[str, Any]], str]:
    """The rows of a JSON / JSON Lines file, or of a `datasets` dataset (a folder or a Hub id), and the revision."""
    path = Path(location)
    if path.is_file():
        data = path.read_bytes()
        return _json_rows(data, location), f"sha256:{_sha256(data)}"
    if path.exists() or re.fullmatch(r"[\w.-]+/[\w.-]+(@[\w./-]+)?", location):
        return _dataset_rows(location)
    raise SourceError(f"{location} is neither a file, a folder nor a Hugging Face dataset id")


def _json_rows(data: bytes, location: str) -> list[dict[str, Any]]:
    text = data.decode("utf-8", errors="replace")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        try:
            value = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise SourceError(f"{location} is neither JSON nor JSON Lines: {error}") from None
    if isinstance(value, dict):  # the EnvScaler repo's own files: a dict keyed by env_id
        value = [{"env_id": key, **row} if isinstance(row, dict) else row for key, row in value.items()]
    if not isinstance(value, list) or not value:
        raise SourceError(f"{location} holds no rows")
    return [row for row in value if isinstance(row, dict)]


def _dataset_rows(location: str) -> tuple[list[dict[str, Any]], str]:
    """Every split of a `datasets` dataset (rows in split order) and its revision: the folder's file bytes, or the
    Hub commit `datasets` resolved."""
    import datasets  # heavy; only this path needs it

    name, _, pinned = location.partition("@")
    try:
        loaded = datasets.load_dataset(name, revision=pinned or None)
    except Exception as error:  # noqa: BLE001 - datasets raises many types for a missing or malformed dataset
        raise SourceError(f"{location} could not be read with datasets: {type(error).__name__}: {error}") from None
    rows = [dict(row) for split in loaded for row in loaded[split]]
    if not rows:
        raise SourceError(f"{location} holds no rows")
    folder = Path(name)
    if folder.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.parts):
            digest.update(f"{file.relative_to(folder)}\0".encode() + file.read_bytes() + b"\0")
        return rows, f"sha256:{digest.hexdigest()}"
    return rows, pinned or _hub_commit(name)


def _hub_commit(name: str) -> str:
    try:
        from huggingface_hub import HfApi

        return str(HfApi().dataset_info(name).sha)
    except Exception:  # noqa: BLE001 - offline, or a Hub without the endpoint: the import still names the id
        return "unknown"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _snake(name: str) -> str:
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return re.sub(r"[^0-9a-zA-Z]+", "_", words).strip("_").lower() or "environment"
