"""What every file format shares: reading with one named error, writing atomically as strict
JSON, and the JSON Schema generated from the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, WithJsonSchema, model_serializer
from typing_extensions import Self

from megatron_npu.files import write_private

#: A figure written as it came: an integer stays an integer, so a file read and written again is
#: the same text.
Number = Annotated[int | float, WithJsonSchema({"type": "number"})]


class FormatError(ValueError):
    """A file that does not fit its format; the message names the file and the field."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
        self.message = message


class FieldError(ValueError):
    """Raised by a validator that checks several fields together: ``field`` (dotted, relative to
    the object validated) is the one to name, so the error points at it rather than at the
    object."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the document"


def describe(exc: ValidationError) -> str:
    """The first problem pydantic found, as ``field: what is wrong`` (with how many more)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    error = first.get("ctx", {}).get("error")
    if first["type"] == "value_error" and isinstance(error, ValueError):
        # a validator's own message, as written (without pydantic's "Value error, ")
        message = str(error)
        if isinstance(error, FieldError):
            loc += tuple(error.field.split("."))
    else:
        message = first["msg"].lower()
    text = f"{_where(loc)}: {message}"
    if first["type"] != "missing" and not isinstance(error, FieldError) and "input" in first:
        shown = repr(first["input"])
        text += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more)"
    return text


class Part(BaseModel):
    """An object inside a document. Unknown keys are kept (``extra="allow"``): a newer writer
    may add fields, and a file read and written again loses nothing. Fields named in
    :attr:`omit_when_none` are left out of the file when they are None (keys that only some
    writers have)."""

    # ser_json_inf_nan="constants": a non-finite float stays a float in model_dump(mode="json")
    # (pydantic would make one in an Any field null), so Document.non_finite decides
    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")

    omit_when_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for name in self.omit_when_none:
            if out.get(name, 0) is None:
                del out[name]
        return out


class Document(Part):
    """A JSON file format. Subclasses set :attr:`schema_name` (the schema file's stem) and, for a
    document that carries its version, check it with a field validator."""

    schema_name: ClassVar[str] = ""
    #: Whether :meth:`write` sorts the keys of every object.
    sort_keys: ClassVar[bool] = False
    #: Whether :meth:`write` writes NaN/inf as ``null`` (strict JSON) -- the default -- or as the
    #: strings ``"NaN"``/``"Infinity"``/``"-Infinity"`` (``"strings"``).
    non_finite: ClassVar[str] = "null"
    #: The indent :meth:`to_json` writes with (a large file may choose 1).
    indent: ClassVar[int] = 2

    @classmethod
    def parse(cls, data: Any, source: str = "<data>") -> Self:
        """Validate already-decoded JSON; :class:`FormatError` names ``source`` and the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise FormatError(source, describe(exc)) from None

    @classmethod
    def read(cls, path: str | Path) -> Self:
        """Read and validate ``path``; :class:`FormatError` names the file and what is wrong
        (unreadable, not JSON -- with the line --, or the field that does not fit)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise FormatError(str(path), f"cannot be read ({exc})") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise FormatError(str(path), f"is not JSON ({exc})") from None
        return cls.parse(data, str(path))

    def to_data(self) -> dict[str, Any]:
        """The document as the decoded JSON of its file: the keys it was given, non-finite
        numbers as :attr:`non_finite` says."""
        _mark_changed(self)
        return _non_finite(self.model_dump(mode="json", exclude_unset=True), self.non_finite)

    def to_json(self) -> str:
        """The document as strict JSON text (indented by :attr:`indent`, trailing newline)."""
        text = json.dumps(
            self.to_data(), indent=self.indent, sort_keys=self.sort_keys, allow_nan=False
        )
        return text + "\n"

    def write(self, path: str | Path) -> Path:
        """Write atomically, mode 0640 (:func:`megatron_npu.files.write_private`)."""
        return write_private(path, self.to_json())

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The format's JSON Schema (draft 2020-12), as ``docs/schemas/`` holds it."""
        schema = cls.model_json_schema()
        if cls.non_finite == "strings":
            schema = _numbers_or_strings(schema)
        return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


_STRINGS = {float("inf"): "Infinity", float("-inf"): "-Infinity"}


_NON_FINITE = {"enum": ["NaN", "Infinity", "-Infinity"]}


def _numbers_or_strings(node: Any) -> Any:
    """The schema with each number also allowed as ``"NaN"``/``"Infinity"``/``"-Infinity"``,
    as a document with ``non_finite = "strings"`` writes them."""
    if isinstance(node, list):
        return [_numbers_or_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "number":
        rest = {k: v for k, v in node.items() if k != "type"}
        return {"anyOf": [{"type": "number"}, _NON_FINITE], **rest}
    out = {k: _numbers_or_strings(v) for k, v in node.items()}
    if isinstance(out.get("anyOf"), list):  # number | null: one flat list of choices
        flat = []
        for choice in out["anyOf"]:
            nested = choice.get("anyOf") if set(choice) == {"anyOf"} else None
            flat += nested if nested and _NON_FINITE in nested else [choice]
        out["anyOf"] = flat
    return out


def _non_finite(value: Any, how: str) -> Any:
    if isinstance(value, dict):
        return {k: _non_finite(v, how) for k, v in value.items()}
    if isinstance(value, list):
        return [_non_finite(v, how) for v in value]
    if isinstance(value, float) and (value != value or value in _STRINGS):
        if how == "null":
            return None
        return "NaN" if value != value else _STRINGS[value]
    return value


def _mark_changed(model: BaseModel) -> None:
    """Count a field as given when its value is no longer its default -- a default list appended
    to, a default part filled in -- so that writing (which leaves out what was never given, to
    write back a file as it was read) does not drop it."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if name not in model.model_fields_set:
            if value != field.get_default(call_default_factory=True):
                model.model_fields_set.add(name)
        for part in _parts_in(value):
            _mark_changed(part)


def _parts_in(value: Any) -> list[BaseModel]:
    if isinstance(value, BaseModel):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, BaseModel)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, BaseModel)]
    return []
