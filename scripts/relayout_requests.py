"""Prefix reuse of stored real requests as they were sent and as this checkout lays them out, offline (issue 29).

The hand-served endpoint stores every request it got (`<folder>/claimed/*.json`: the request body and its arrival
id). This script reads them in arrival order through one `PrefixIndex` (as `stats.json` measures, one server),
once as sent and once re-laid out the way this checkout builds them: the checker with the environment's whole
source (or the called tools' sources) before the clock, the tester with the state as first set up and the changes
since and short slot lines, the scenario task and gold writers with one shared start, the check writer's methods in
the class's order, the user simulator's rules first. The environments' code is read from the runs' stores.

    python -m scripts.relayout_requests /work/teach9 "/work/wt-teacher*/runs/*/code.parquet"
    python -m scripts.relayout_requests /work/teach10 "/work/wt-teacher*/runs/*/code.parquet" --whole --split-batches

`--whole`: the checker shows the whole source (the run's `evaluate.calls` was at least twice its tools);
`--split-batches`: measure the requests of one call and of five calls apart (teacher-10 ran both at once).
`--source-first`: only the tester and checker requests laid out as main at c6df74f (teacher-12e, -13), the
checkers re-laid out with the test state shown once (the changes since rebuilt from the earlier batches).
Only tester and checker requests are kept with `--split-batches`. Tokens are characters / 4. The text surgery
follows the layouts of main at cc34cf4; requests laid out otherwise are measured as sent.
"""

import argparse
import ast
import glob
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import pandas as pd

from builder.envs.schema import inspect_source
from builder.envs.snapshots import diff_states
from builder.llm import ChatRequest
from builder.llm.prefix import PrefixIndex, prompt_text
from builder.prompts import prompt
from builder.stages.evaluate.agents import STATE_PART, VERDICTS_PART, evaluate_system
from builder.stages.evaluate.facts import _called_source, changes_text
from builder.stages.scenarios.writers import writer_system
from builder.views.code import environment_source, method_source
from scripts.prefix_reuse import request_kind

BY_CLASS: dict = {}
BY_NAME: dict = {}
SOURCE = re.compile(r"Method source of `\w+`:( as for an earlier call of this batch\.|\n```python\n.*?\n```)\n\n", re.S)


def env_of(rec):
    return type(
        "E",
        (),
        dict(class_name=rec["class_name"], domain=rec["domain"], description=rec["description"], code=rec["code"]),
    )


def checker(msgs, whole):
    user = msgs[1]["content"]
    if "Its source (the module docstring" in user:
        return checker_state_once(msgs)
    name = re.match(r"Environment `(\w+)`", user).group(1)
    if name not in BY_CLASS:
        print("no code for", name, file=sys.stderr)
        return msgs
    env = env_of(BY_CLASS[name])
    rest = user.split("\n\nNow: ", 1)[1]
    called = list(dict.fromkeys(re.findall(r"Method source of `(\w+)`", rest)))
    rest = SOURCE.sub("", rest)
    head = environment_source(env) if whole else _called_source(env, called)
    return [
        {"role": "system", "content": evaluate_system()},
        {"role": "user", "content": f"{head}\n\n{VERDICTS_PART}\n\nNow: {rest}"},
    ]


FIRSTS = {}
STATES = {}  # (class name, clock) -> the text of a test state as first set up, from its tester requests
SINCE = defaultdict(dict)  # (class name, clock) -> path -> the change the checker's earlier batches showed last
CALL_STATES = re.compile(
    r"State before \(attributes the method uses\):\n.*?\n\nArguments(.*?)\n\nState after:\n.*?\n\nChanges", re.S
)


def checker_state_once(msgs):
    """A source-first checker request (main at c6df74f) as the state-once layout builds it: the state as first
    set up after the clock, the changes the earlier batches on that state showed (latest per path) and each call
    without its states before and after. The changes since are rebuilt from the checker's own earlier requests."""
    user = msgs[1]["content"]
    name = re.match(r"Environment `(\w+)`", user).group(1)
    head, rest = user.split("\n\nNow: ", 1)
    now, rest = rest.split("\n\n", 1)
    key = (name, now)
    calls = rest.split("\n\n## Call ")[1:]
    changed = changes_text(list(SINCE[key].values()), 12_000)
    shown = (
        f"State as first set up (JSON):\n{STATES.get(key, '')}\n\nChanged since by the calls on this state "
        f"(path: value before call 1):\n{changed or '- nothing yet'}"
    )
    for call in calls:
        found = re.search(r"\n\nChanges: (\[.*\])(?:\nNote|$)", call, re.S)
        for change in json.loads(found.group(1)) if found else []:
            SINCE[key][change["path"]] = change
    bodies = [CALL_STATES.sub(lambda m: "Arguments" + m.group(1).replace("\n\n", "\n") + "\nChanges", c) for c in calls]
    sentence = (
        f"{len(calls)} call(s) ran in this order, call 1 on the state above, each later one on the state the one "
        f"before it left. Give one verdict per call, with its number."
    )
    user = f"{head}\n\n{VERDICTS_PART}\n\nNow: {now}\n\n{shown}\n\n{sentence}\n\n## Call " + "\n\n## Call ".join(bodies)
    return [{"role": "system", "content": evaluate_system()}, {"role": "user", "content": user}]


def state_writer(msgs, whole):
    """A test-state request as this checkout lays it out: the checker's start (both parts' instructions and the
    environment's whole source), then the part and the shape example (when `whole`)."""
    user = msgs[1]["content"]
    name = re.match(r"Environment `(\w+)`", user).group(1)
    if not whole or name not in BY_CLASS or STATE_PART in user:
        return msgs
    tail = user[user.index("The state its constructor builds") :]
    head = environment_source(env_of(BY_CLASS[name]))
    return [
        {"role": "system", "content": evaluate_system()},
        {"role": "user", "content": f"{head}\n\n{STATE_PART}\n\n{tail}"},
    ]


def tester(msgs, run):
    user = msgs[1]["content"]
    if "State as first set up (JSON):" in user:  # laid out as this checkout does: keep its state for the checker
        name = re.match(r"Environment `(\w+)`", user).group(1)
        now = re.search(r"\nNow: (.*?)\n\n", user).group(1)
        STATES[(name, now)] = re.search(r"State as first set up \(JSON\):\n(.*?)\n\nChanged since", user, re.S).group(1)
        return msgs
    m = re.search(r"Current state \(JSON\):\n(.*?)\n\nRecent calls", user, re.S)
    text = m.group(1)
    key = (run, re.search(r"Test state (\d+)", user).group(1))
    try:
        current = json.loads(text.split("\n")[0])
    except ValueError:
        current = None
    first_text, first = FIRSTS.setdefault(key, (text, current))
    shown = f"Current state (JSON):\n{text}"
    if current is not None and first is not None:
        changed = changes_text(diff_states(first, current), 3000)
        if len(changed) <= len(text):
            shown = (
                f"State as first set up (JSON):\n{first_text}\n\nChanged since by the calls on this state "
                f"(path: value now):\n{changed or '- nothing yet'}"
            )
    user = user[: m.start()] + shown + user[m.end() - len("\n\nRecent calls") :]
    user = re.sub(r"^(\d+\. `\w+` with a (?:POSITIVE|NEGATIVE) case):.*$", r"\1", user, flags=re.M)
    user = re.sub(
        r"(Calls \d+ to \d+ of \d+ on this state); the current state above includes.*?left:\n",
        r"\1, to run in this order:\n",
        user,
        flags=re.S,
    )
    return [{"role": "system", "content": prompt("evaluate_tester")}, {"role": "user", "content": user}]


def writer(msgs, part):
    user = msgs[1]["content"]
    i = user.index("## Current state\n")
    ends = [
        k
        for k in (
            user.find("\n\n## The kind of task", i),
            user.find("\n\n## Task\n", i),
            user.find("\n\n## A previous task", i),
        )
        if k >= 0
    ]
    j = min(ends or [len(user)])
    user = user[:j] + f"\n\n## Write\nThe part `{part}`." + user[j:]
    return [{"role": "system", "content": writer_system()}, {"role": "user", "content": user}]


def check_order(msgs):
    user = msgs[1]["content"]
    rec = BY_NAME[re.match(r"# Environment (\w+)", user).group(1)]
    order = {t: i for i, t in enumerate(inspect_source(rec["code"]).tool_names)}
    m = re.search(r"## Methods the solution calls that change the state\n```python\n(.*?)\n```", user, re.S)
    if not m:
        return msgs
    names = [n for n in re.findall(r"^def (\w+)\(", m.group(1), re.M) if n in order]
    block = "\n\n".join(method_source(rec["code"], n) for n in sorted(names, key=order.get))
    return [msgs[0], {"role": "user", "content": user[: m.start(1)] + block + user[m.end(1) :]}]


def user_sim(msgs):
    system = msgs[0]["content"]
    i, j = system.index("\n\nWho you are:"), system.index("\n\nRules:\n")
    return [{"role": "system", "content": system[:i] + system[j:] + system[i:j]}] + list(msgs[1:])


def schema(r):
    return (r.get("response_format") or {}).get("json_schema", {}).get("name", "")


def relaid(r, kind, whole, run):
    msgs, n = r["messages"], schema(r)
    if n == "CheckerVerdicts":
        return checker(msgs, whole)
    if n == "TesterCalls":
        return tester(msgs, run)
    if n == "TestState":
        return state_writer(msgs, whole)
    if n == "GoldSolution":
        return writer(msgs, "solution")
    if n.endswith("Draft") and "You write a task" in msgs[0]["content"]:
        return writer(msgs, "task")
    if n == "CheckCodes":
        return check_order(msgs)
    if kind == "user_sim":
        return user_sim(msgs)
    return msgs


def load(folder):
    rows = []
    for p in Path(folder, "claimed").glob("*.json"):
        d = json.load(open(p))
        r = d["request"]
        rows.append((int(d["id"]), ast.literal_eval(r) if isinstance(r, str) else r))
    return [r for _, r in sorted(rows, key=lambda row: row[0])]


def measure(requests, whole, run, layout):
    index, sums = PrefixIndex(), defaultdict(lambda: [0, 0, 0])
    for r in requests:
        req = ChatRequest(
            messages=tuple(r["messages"]), tools=tuple(r.get("tools") or ()), response_format=r.get("response_format")
        )
        kind = request_kind(req)
        if layout:
            req = ChatRequest(
                messages=tuple(relaid(r, kind, whole, run)), tools=req.tools, response_format=req.response_format
            )
        reused, chars = index.observe(prompt_text(req))
        for k in (kind, "overall"):
            s = sums[k]
            s[0] += 1
            s[1] += chars
            s[2] += reused
    return sums


def show(before, after):
    """Per request kind: requests, then prompt tokens, prefix reuse and tokens not a prefix, as sent -> re-laid."""

    def figures(n, chars, reused):
        return f"{chars // 4:>9}{reused / chars:>6.2f}{(chars - reused) // 4:>8}"

    print(f"{'request kind':<22}{'n':>4}{'tokens':>9}{'reuse':>6}{'fresh':>8}  ->{'tokens':>9}{'reuse':>6}{'fresh':>8}")
    for kind in sorted(before, key=lambda kind: kind == "overall"):
        print(f"{kind:<22}{before[kind][0]:>4}{figures(*before[kind])}  ->{figures(*after[kind])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="the hand-served endpoint's folder (holding claimed/)")
    parser.add_argument("code", help="glob of the runs' code.parquet files (the environments' source)")
    parser.add_argument("--whole", action="store_true")
    parser.add_argument("--split-batches", action="store_true")
    parser.add_argument("--source-first", action="store_true")
    options = parser.parse_args()
    for path in glob.glob(options.code):
        for _, rec in pd.read_parquet(path).iterrows():
            BY_CLASS[rec["class_name"]], BY_NAME[rec["name"]] = rec, rec
    requests = load(options.folder)
    if options.source_first:  # only the evaluate runs laid out as main at c6df74f, re-laid as this checkout does
        requests = [r for r in requests if "Its source (the module docstring" in r["messages"][-1]["content"]
                    or "State as first set up (JSON):" in r["messages"][-1]["content"]
                    or schema(r) == "TestState" and "Focus: " in r["messages"][-1]["content"]]  # fmt: skip
    if not options.split_batches:
        show(measure(requests, options.whole, "x", False), measure(requests, options.whole, "x", True))
        return

    def calls(r):
        u = r["messages"][-1]["content"]
        return (
            u.count("## Call ") if schema(r) == "CheckerVerdicts" else len(re.findall(r"^\d+\. `\w+` with a", u, re.M))
        )

    requests = [r for r in requests if schema(r) in ("CheckerVerdicts", "TesterCalls")]
    for k in sorted({calls(r) for r in requests}):
        sub = [r for r in requests if calls(r) == k]
        print(f"{k} call(s) a request")
        show(measure(sub, options.whole, k, False), measure(sub, options.whole, k, True))


if __name__ == "__main__":
    sys.exit(main())
