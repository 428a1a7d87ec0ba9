"""`ast.parse` behind one lock: the only way builder parses Python, because it parses from several threads at once.

CPython before 3.11.8 and 3.12.2 kept the AST constructor's recursion counter in interpreter-wide state; when a
garbage collection during `ast.parse` ran Python code (a finalizer) and let another thread parse meanwhile, one
of them failed with `SystemError: AST constructor recursion depth mismatch` (CPython gh-106905). The pipeline
parses generated code on the event loop and in sandbox threads (sessions, gates, scenario checks) concurrently,
so on those versions a scenario slot or an evaluation could fail at random. Parses are small; the lock costs
nothing measurable on fixed versions either. Reentrant, in case a finalizer run by that collection parses too.
"""

from __future__ import annotations

import ast
import symtable
import threading
from typing import Literal, overload

_LOCK = threading.RLock()


@overload
def parse(source: str, mode: Literal["exec"] = "exec") -> ast.Module: ...
@overload
def parse(source: str, mode: Literal["eval"]) -> ast.Expression: ...
def parse(source: str, mode: Literal["exec", "eval"] = "exec") -> ast.Module | ast.Expression:
    """`ast.parse(source, mode=mode)`, one thread at a time. Raises what `ast.parse` raises."""
    with _LOCK:
        return ast.parse(source, mode=mode)


def symbols(source: str) -> symtable.SymbolTable:
    """`symtable.symtable(source)` (the compiler's scopes, nothing run), under the same lock as `parse`: it
    parses too. Raises SyntaxError (or ValueError for a null byte) like `parse`."""
    with _LOCK:
        return symtable.symtable(source, "<source>", "exec")
