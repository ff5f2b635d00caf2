"""A config error in words: what pydantic found wrong with one value, as a user reads it."""

from __future__ import annotations

from pydantic import ValidationError


def describe(err: dict) -> str:
    """One of pydantic's ``ValidationError.errors()`` in words, without its location: "must be >= 1, got 0",
    "expected an integer, got 'lots'", "unknown key", or a validator's own message."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        return "unknown key"
    for key, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx and kind.startswith(("greater", "less")):
            return f"must be {op} {ctx[key]}, got {value!r}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {value!r}"
    if kind == "finite_number":
        return f"must be a finite number, got {value!r}"
    names = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
             "list": "a list", "tuple": "a list", "model": "a table", "dict": "a table"}
    for prefix, name in names.items():
        if kind.startswith(prefix + "_") and kind != "int_from_float":
            return f"expected {name}, got {value!r}"
    if kind == "int_from_float":
        return f"expected an integer, got {value!r}"
    msg = err["msg"]
    return msg.removeprefix("Value error, ")


def in_one_line(exc: ValidationError, sections: dict | None = None) -> str:
    """A config's validation error as one line: ``optim.lr: must be > 0, got -1`` (and how many more).
    ``sections``: the whole config's ``model_fields`` (a section's own check names its field first)."""
    errors = exc.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"] if p != "__root__")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    described = describe(first)
    # A section's own check names its field first ("lr: ..."): make that "optim.lr: ...".
    field_name, sep, rest = described.partition(": ")
    section = (sections or {}).get(loc)
    if sep and section is not None and field_name in section.annotation.model_fields:
        loc, described = f"{loc}.{field_name}", rest
    return f"{loc or 'config'}: {described}{more}"
