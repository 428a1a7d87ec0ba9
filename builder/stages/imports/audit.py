"""The audit of an import run: what a user needs to know before training on someone else's data.

Built from the run folder's tables alone (the `import`, `evaluate` and `scenarios` tables and their
rejections), so it is the same after a resume and can be rebuilt at any time: environments that do not load,
tools that crash on valid input, check functions that raise or pass on the initial state, scenarios whose checks
cannot fail, and the lint problems the import contract only reports. Stored as `audit.json` in the run folder.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from builder.envs.lint import lint
from builder.records import Environment, Rejection, Scenario
from builder.run.folder import INPUT_ID, RunFolder
from builder.sandbox.allowed import ALLOWED_MODULES
from builder.stages.imports import IMPORT_STAGE, VERIFY_STAGE, VET_STAGE, rejection_facts
from builder.stages.imports.siblings import inlined_imports
from builder.stats import load_stats
from builder.tables import from_frame

AUDIT_FILE = "audit.json"
LISTED = 50  # entries kept per list; the counts are always complete
CRASH_CODES = frozenset({"tool_raised", "tool_crashed", "tool_timeout", "result_not_json", "signature_mismatch"})
LOAD_CODES = frozenset({"load_failed", "state_not_json", "syntax", "no_env_class"})
# How a refused import shows in a load error: a module the zygote never imported (`No module named 'x'`), or a
# package whose files the locked-down worker may not open (`PermissionError: ... site-packages/x/__init__.py`).
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
_UNREADABLE_PACKAGE = re.compile(r"PermissionError: .*?/(?:site|dist)-packages/(\w+)")


def build_audit(run_dir: Path) -> dict[str, Any]:
    folder = RunFolder(run_dir)
    imported = _kept(folder, IMPORT_STAGE, Environment)
    refs = {env.id: env.provenance.origin.ref for env in imported if env.provenance.origin is not None}
    origin = next((env.provenance.origin for env in imported if env.provenance.origin is not None), None)
    accepted = _kept(folder, VET_STAGE, Environment)
    env_rejected = _rejected(folder, VET_STAGE)
    not_loading, crashing = [], []
    for rejection in env_rejected:
        for problem in _list(rejection_facts(rejection)):
            entry = {"env": refs.get(rejection.subject_id, rejection.subject_id), "message": problem.get("message")}
            if problem.get("code") in LOAD_CODES:
                not_loading.append(entry | _load_fix(str(problem.get("message") or "")))
            elif problem.get("code") in CRASH_CODES:
                crashing.append({**entry, "tool": problem.get("tool"), "code": problem.get("code")})
    kept = [s for s in _kept(folder, VERIFY_STAGE, Scenario) if s.provenance.origin is not None]
    scenario_rejected = [r for r in _rejected(folder, VERIFY_STAGE) if "/" in r.subject_id]
    raising, on_initial, constant = [], [], []
    for ref, facts in [(s.provenance.origin.ref, _facts(s)) for s in kept] + [
        (r.subject_id.split("/", 1)[1], rejection_facts(r)) for r in scenario_rejected
    ]:
        raising += [
            {"scenario": ref, "check": int(i), "error": e} for i, e in (facts.get("check_errors") or {}).items()
        ]
        on_initial += [{"scenario": ref, "check": i} for i, ok in enumerate(facts.get("checks_on_initial") or ()) if ok]
        constant += [{"scenario": ref, "check": i} for i in facts.get("constant_checks") or ()]
    cannot_fail = [r.subject_id.split("/", 1)[1] for r in scenario_rejected if r.reason == "already_solved"]
    lint_counts = Counter(problem.code for env in imported for problem in lint(env.code))
    inlined = [
        {"env": refs.get(env.id, env.id), "module": found.module, "names": list(found.names)}
        for env in imported
        for found in inlined_imports(env.code)
    ]
    evaluate_stats = load_stats(folder.stats_path).get(VET_STAGE)
    omitted = evaluate_stats.report.to_json().get("private_state_omitted", {}) if evaluate_stats else {}
    return {
        "source": origin.model_dump(exclude={"ref", "split"}) if origin is not None else None,
        "environments": {
            "read": len(imported) + len(_rejected(folder, IMPORT_STAGE)),
            "unreadable": _reasons(_rejected(folder, IMPORT_STAGE)),
            "accepted": len(accepted),
            "rejected": _reasons(env_rejected),
        },
        "not_loading": _listed(not_loading),
        "crashing_tools": _listed(crashing),
        "scenarios": {
            "kept": len(kept),
            "unverified_solvability": sum(s.verification.unverified_solvability for s in kept),
            "rejected": _reasons(scenario_rejected),
        },
        "raising_checks": _listed(raising),
        "checks_passing_on_initial": _listed(on_initial),
        "checks_that_cannot_fail": _listed(constant),
        "scenarios_whose_checks_cannot_fail": _listed([{"scenario": ref} for ref in cannot_fail]),
        "lint_problems": dict(sorted(lint_counts.items())),
        "inlined_sibling_imports": _listed(inlined),
        "private_state_omitted": _listed([{"env": ref, "attributes": names} for ref, names in sorted(omitted.items())]),
    }


def write_audit(run_dir: Path) -> dict[str, Any]:
    """Build the audit and store it as `audit.json` in the run folder (atomically)."""
    audit = build_audit(run_dir)
    path = Path(run_dir) / AUDIT_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(audit, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return audit


def render_audit(audit: dict[str, Any]) -> str:
    """The audit as the few lines `import` prints."""
    envs, scen = audit["environments"], audit["scenarios"]
    lines = [
        f"environments: {envs['read']} read, {envs['accepted']} accepted, rejected {_counts(envs['rejected'])}, "
        f"unreadable {_counts(envs['unreadable'])}",
        f"  not loading: {audit['not_loading']['count']}   tools crashing on valid input: "
        f"{audit['crashing_tools']['count']}",
        f"scenarios: {scen['kept']} kept ({scen['unverified_solvability']} without a gold: solvability unverified), "
        f"rejected {_counts(scen['rejected'])}",
        f"  checks raising on the initial state: {audit['raising_checks']['count']}   passing on it: "
        f"{audit['checks_passing_on_initial']['count']}   that cannot fail: "
        f"{audit['checks_that_cannot_fail']['count']}",
        "  scenarios whose checks cannot fail (already solved): "
        f"{audit['scenarios_whose_checks_cannot_fail']['count']}",
        f"lint (information only under the import contract): {_counts(audit['lint_problems'])}",
        f"  sibling imports inlined: {audit['inlined_sibling_imports']['count']}   private attributes left out of "
        f"the state (not JSON): {audit['private_state_omitted']['count']}",
    ]
    for entry in audit["not_loading"]["items"][:5]:
        lines.append(f"  not loading: {entry['env']}: {entry.get('fix') or entry['message']}")
    for entry in audit["crashing_tools"]["items"][:5]:
        lines.append(f"  crash: {entry['env']}.{entry['tool']}: {entry['message']}")
    return "\n".join(lines)


def _load_fix(message: str) -> dict[str, str]:
    """What to do about a load error caused by an import the sandbox refuses ({} for any other error)."""
    found = _MISSING_MODULE.search(message) or _UNREADABLE_PACKAGE.search(message)
    if found is None:
        return {}
    module = found[1]
    kind = "a standard-library module the sandbox refuses" if found.re is _MISSING_MODULE else "a third-party package"
    return {
        "refused_module": module,
        "fix": f"it imports {module!r}, {kind}: the sandbox provides only the {len(ALLOWED_MODULES)} pure "
        f"standard-library modules of builder/sandbox/allowed.py; remove the import of {module!r} or rewrite what "
        "uses it with those",
    }


def _kept(folder: RunFolder, stage: str, record_type: type) -> list:
    return folder.read(stage, record_type) if folder.table(stage).exists() else []


def _rejected(folder: RunFolder, stage: str) -> list[Rejection]:
    frame = folder.frame(stage, Rejection, rejected=True)
    return from_frame(Rejection, frame.drop(INPUT_ID)) if frame.height else []


def _facts(scenario: Scenario) -> dict[str, Any]:
    verification = scenario.verification
    return {
        "checks_on_initial": verification.checks_on_initial,
        "check_errors": verification.check_errors,
        "constant_checks": verification.vacuous_checks,
    }


def _list(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _reasons(rejections: list[Rejection]) -> dict[str, int]:
    return dict(sorted(Counter(rejection.reason for rejection in rejections).items()))


def _listed(items: list[Any]) -> dict[str, Any]:
    return {"count": len(items), "items": items[:LISTED]}


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "none"
