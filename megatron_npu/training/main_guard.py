"""Whether ranks started from a fork server can import the caller's main module safely.

A process started by multiprocessing's ``forkserver`` (or ``spawn``) method imports the parent's
main module again (as ``__mp_main__``) before it runs its target. A call that starts ranks from
the main module's top level, outside ``if __name__ == "__main__":``, therefore runs again in
every rank, and multiprocessing stops each of them with its own traceback on the terminal
("An attempt has been made to start a new process before the current process has finished its
bootstrapping phase"), while the caller sees only that the ranks exited. :func:`check` finds
that case before any rank starts, so the caller gets one named error instead.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


class UnguardedMainError(RuntimeError):
    """The main module starts ranks from its top level, outside its ``__main__`` guard."""


def _compares_name_to_main(test: ast.expr, op: type[ast.cmpop]) -> bool:
    """``__name__ <op> "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], op):
        return False
    sides = (test.left, test.comparators[0])
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    constants = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and constants == ["__main__"]


def _span(body: list[ast.stmt]) -> range:
    return range(body[0].lineno, (body[-1].end_lineno or 0) + 1)


def _guarded_lines(source: str) -> list[range]:
    """The line ranges that run only in the main module as ``__main__``: the body of every
    ``if __name__ == "__main__":`` (alone or in an ``and``), the ``else`` of every
    ``if __name__ != "__main__":``."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.If):
            continue
        tests = node.test.values if isinstance(node.test, ast.BoolOp) else [node.test]
        conjunction = not isinstance(node.test, ast.BoolOp) or isinstance(node.test.op, ast.And)
        if conjunction and any(_compares_name_to_main(t, ast.Eq) for t in tests):
            spans.append(_span(node.body))
        elif _compares_name_to_main(node.test, ast.NotEq) and node.orelse:
            spans.append(_span(node.orelse))
    return spans


def unguarded_call() -> tuple[str, int] | None:
    """``(file, line)`` of the main module's top-level statement that is running now, when that
    statement lies outside every ``__main__`` guard of the file (a rank importing the file would
    run it again); None when the main module has finished importing, has no source file
    (``python -c``, an interactive session), or the statement is guarded. A file that cannot be
    read or parsed gives None: only a certain case is refused."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            break
        frame = frame.f_back
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        spans = _guarded_lines(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    if any(line in span for span in spans):
        return None
    return str(path), line


def check() -> None:
    """Raise :class:`UnguardedMainError` when ranks started now would re-run this call
    (:func:`unguarded_call`)."""
    where = unguarded_call()
    if where is not None:
        path, line = where
        raise UnguardedMainError(
            f"the ranks start from a fork server and each first imports the main module {path}, "
            f'whose line {line} runs this call outside `if __name__ == "__main__":`, so every '
            "rank would run it again: put the call under that guard (Python's rule for "
            "multiprocessing's fork-server and spawn start methods)"
        )
