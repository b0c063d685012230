"""Taking locate's own options out of a run's option list (the rest goes to the run)."""

from __future__ import annotations


def take(
    argv: list[str], with_value: tuple[str, ...], flags: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, list[str]]]:
    """``(the rest of argv, {option: [values]})``: the options in ``with_value`` (``--x V`` or
    ``--x=V``) and the ``flags`` (value ``""``) taken out, in order. ``ValueError`` names an
    option given without its value."""
    rest: list[str] = []
    taken: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token.partition("=")
        if name in with_value:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            taken.setdefault(name, []).append(value)
        elif token in flags:
            taken.setdefault(token, []).append("")
        else:
            rest.append(token)
        i += 1
    return rest, taken
