"""The seam between Rust and Python, checked from both sides.

`seam.json` (beside this file) is every entry point src/py/calls.rs declares,
with the JSON schemas of its request (what Rust serializes) and reply (what
Rust deserializes); a Rust unit test (`seam_json_is_current`) fails when it
no longer matches the Rust types. Here every declared entry point is imported
(a renamed or removed function fails), and its Python signature and
`contract.py` TypedDicts are compared with those schemas (a field renamed,
added or dropped on either side fails), recursively through every nested type.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

SEAM = json.loads((Path(__file__).parent / "seam.json").read_text())
Schema = dict[str, Any]


def ids(entry: dict[str, Any]) -> str:
    return f"{entry['module']}.{entry['function']}"


def entry_point(entry: dict[str, Any]) -> Any:
    module = importlib.import_module(f"chunkforge_py.{entry['module']}")
    assert hasattr(module, entry["function"]), (
        f"src/py/calls.rs declares chunkforge_py.{ids(entry)}, which does not exist"
    )
    return getattr(module, entry["function"])


def annotation(f: Any, name: str) -> Any:
    """``f``'s annotation of parameter ``name`` (``return``: its result), evaluated."""
    target = vars(f)["__init__"] if isinstance(f, type) else f
    text = target.__annotations__.get(name, Any)
    if not isinstance(text, str):
        return text
    namespace = {**vars(typing), **vars(sys.modules[target.__module__])}
    return eval(text, namespace)  # noqa: S307  (an annotation of our own code)


# Where Python replies with a name Rust handed it, typed `str` on purpose:
# contract.LayoutKind is a name from the layout table (crates/model/src/layouts.rs),
# which Python reads from the plan it is given, so a new layout needs no Python edit.
ECHOED_NAMES = {"reply.layout", "reply.layouts[].layout"}


class Compare:
    """Walks a Python annotation and a JSON schema side by side; `errors` says
    where they disagree. ``sent``: Rust sends the value (a request), so a
    key Rust may leave out must be NotRequired in Python; otherwise Python
    sends it (a reply), and a key Rust requires must be required in Python."""

    def __init__(self, root: Schema, sent: bool) -> None:
        self.defs: dict[str, Schema] = root.get("$defs", {})
        self.sent = sent
        self.errors: list[str] = []
        self.seen: set[tuple[int, str]] = set()

    def resolve(self, s: Any) -> Any:
        while isinstance(s, dict) and "$ref" in s:
            rest = {k: v for k, v in s.items() if k != "$ref"}
            s = {**self.defs[s["$ref"].rsplit("/", 1)[-1]], **rest}
        return s

    def fail(self, where: str, what: str) -> None:
        self.errors.append(f"{where}: {what}")

    def check(self, py: Any, schema: Any, where: str) -> None:
        s = self.resolve(schema)
        if py is Any or s is True or s == {}:
            return
        origin = typing.get_origin(py)
        if origin in (typing.Union, types.UnionType):
            self.union(typing.get_args(py), s, where)
            return
        if "anyOf" in s or "oneOf" in s:
            branches = [self.resolve(b) for b in s.get("anyOf") or s["oneOf"]]
            if all(isinstance(b, dict) and "const" in b for b in branches):
                # A Rust enum whose variants carry docs: one string each.
                self.check(py, {"type": "string", "enum": [b["const"] for b in branches]}, where)
            else:
                self.union((py,), s, where)
            return
        kinds = s.get("type")
        if isinstance(kinds, list) and len(kinds) > 1 and "null" not in kinds:
            self.union((py,), s, where)
            return
        if isinstance(kinds, list):
            if "null" in kinds and self.sent:
                self.fail(where, f"Rust sends null, Python {py} does not take None")
            rest = [k for k in kinds if k != "null"]
            self.check(py, {**s, "type": rest[0] if len(rest) == 1 else rest}, where)
            return
        if typing.is_typeddict(py):
            self.typeddict(py, s, where)
        elif origin is typing.Literal:
            rust = s.get("enum", [s["const"]] if "const" in s else None)
            python = set(typing.get_args(py))
            if rust is None:
                # A Rust String: Python names the values it knows of.
                self.kind(kinds, "string", str, where)
            # What the sender may send, the receiver must take.
            elif not (set(rust) <= python if self.sent else python <= set(rust)):
                self.fail(where, f"Python {py}, Rust {rust}")
        elif py is type(None) or py is None:
            if kinds != "null":
                self.fail(where, f"Python None, Rust {s}")
        elif py is bool:
            self.kind(kinds, "boolean", py, where)
        elif py is int:
            self.kind(kinds, "integer", py, where)
        elif py is float:
            if kinds not in ("number", "integer"):
                self.fail(where, f"Python float, Rust {kinds}")
        elif py is str:
            self.kind(kinds, "string", py, where)
            if not self.sent and ("enum" in s or "const" in s) and where not in ECHOED_NAMES:
                self.fail(where, f"Python sends any str, Rust takes only {s.get('enum', s.get('const'))}")
        elif origin in (list, tuple) or py in (list, tuple):
            self.sequence(py, s, where)
        elif origin is dict:
            key, value = typing.get_args(py)
            if kinds != "object":
                self.fail(where, f"Python {py}, Rust {s}")
            elif "properties" in s:
                # A map keyed by a Rust enum: an object of its names.
                self.check(key, {"type": "string", "enum": list(s["properties"])}, f"{where} keys")
                for k, v in s["properties"].items():
                    self.check(value, v, f"{where}[{k}]")
            else:
                self.check(value, s.get("additionalProperties", True), f"{where}[*]")
        else:
            self.fail(where, f"Python {py} cannot be compared with Rust {s}")

    def kind(self, kinds: Any, want: str, py: Any, where: str) -> None:
        if kinds != want:
            self.fail(where, f"Python {py.__name__}, Rust {kinds}")

    def union(self, members: tuple[Any, ...], s: Schema, where: str) -> None:
        """What the sender may send (each of its alternatives, null among
        them), the receiver must take (one of its alternatives)."""
        branches = s.get("anyOf") or s.get("oneOf")
        if branches is None:
            kinds = s["type"] if isinstance(s.get("type"), list) else [s.get("type")]
            branches = [{**s, "type": k} for k in kinds]
        py = [m for m in members if m is not type(None)]
        rust = [b for b in branches if self.resolve(b).get("type") != "null"]
        rust_null = len(rust) < len(branches) or "null" in (s.get("type") or [])
        py_null = len(py) < len(members)
        if (rust_null and not py_null) if self.sent else (py_null and not rust_null):
            self.fail(where, f"Python {members} and Rust {branches} disagree on null")
        if len(py) == 1 and len(rust) == 1:
            self.check(py[0], rust[0], where)  # one each: say where they differ
        elif self.sent:
            for b in rust:
                if not any(self.quiet(m, b, where) for m in py):
                    self.fail(where, f"no Python type of {members} takes Rust's {self.resolve(b)}")
        else:
            for m in py:
                if not any(self.quiet(m, b, where) for b in rust):
                    self.fail(where, f"Python's {m} matches no type Rust takes")

    def quiet(self, py: Any, schema: Any, where: str) -> bool:
        before = len(self.errors)
        self.check(py, schema, where)
        ok = len(self.errors) == before
        del self.errors[before:]
        return ok

    def sequence(self, py: Any, s: Schema, where: str) -> None:
        args = typing.get_args(py)
        if s.get("type") != "array":
            self.fail(where, f"Python {py}, Rust {s}")
        elif "prefixItems" in s:
            items = s["prefixItems"]
            if typing.get_origin(py) is not tuple or len(args) != len(items):
                self.fail(where, f"Python {py}, Rust a tuple of {len(items)}")
            else:
                for k, (a, item) in enumerate(zip(args, items, strict=True)):
                    self.check(a, item, f"{where}[{k}]")
        elif args:
            self.check(args[0], s.get("items", True), f"{where}[]")

    def typeddict(self, td: Any, s: Schema, where: str) -> None:
        key = (id(td), json.dumps(s, sort_keys=True))
        if key in self.seen:
            return
        self.seen.add(key)
        props: dict[str, Any] = s.get("properties", {})
        required = set(s.get("required", []))
        hints = typing.get_type_hints(td)
        optional = not_required(td)
        name = f"{where} ({td.__name__})"
        # Every key either side has, the other must know; a key Rust reads
        # with a default Python need not send.
        for k in sorted(set(props) - set(hints)):
            if self.sent or k in required:
                self.fail(name, f"Rust has {k!r}, contract.py does not")
        for k in sorted(set(hints) - set(props)):
            self.fail(name, f"contract.py has {k!r}, Rust does not")
        for k in sorted(set(props) & set(hints)):
            prop = props[k]
            if self.sent and k not in required:
                if k not in optional:
                    self.fail(name, f"Rust may leave out {k!r}: NotRequired in contract.py")
                # Left out when None (skip_serializing_if), never sent as null.
                prop = without_null(self.resolve(prop))
            if not self.sent and k in required and k in optional:
                self.fail(name, f"Rust requires {k!r}: required in contract.py")
            if self.sent and k in required and k in optional:
                # Rust sends every field: Python keeps no default of its own.
                self.fail(name, f"Rust always sends {k!r}: required in contract.py")
            self.check(hints[k], prop, f"{where}.{k}")


def not_required(td: Any) -> set[str]:
    """The NotRequired keys of ``td`` (read from the annotations' text:
    Python 3.11's ``__required_keys__`` misses them under postponed annotations)."""
    out = set()
    for cls in td.__mro__:
        for k, v in cls.__dict__.get("__annotations__", {}).items():
            text = v.__forward_arg__ if isinstance(v, typing.ForwardRef) else str(v)
            if text.startswith(("NotRequired[", "typing.NotRequired[")):
                out.add(k)
    return out


def without_null(s: Any) -> Any:
    if not isinstance(s, dict):
        return s
    kinds = s.get("type")
    if isinstance(kinds, list) and "null" in kinds:
        rest = [k for k in kinds if k != "null"]
        return {**s, "type": rest[0] if len(rest) == 1 else rest}
    for key in ("anyOf", "oneOf"):
        if key in s:
            rest = [b for b in s[key] if b != {"type": "null"}]
            return rest[0] if len(rest) == 1 else {**s, key: rest}
    return s


def compare(py: Any, schema: Schema, sent: bool, where: str) -> list[str]:
    c = Compare(schema, sent)
    c.check(py, schema, where)
    return c.errors


@pytest.mark.parametrize("entry", SEAM, ids=ids)
def test_every_declared_entry_point_exists(entry: dict[str, Any]) -> None:
    assert callable(entry_point(entry))


@pytest.mark.parametrize("entry", SEAM, ids=ids)
def test_contract_agrees_with_the_rust_types(entry: dict[str, Any]) -> None:
    f = entry_point(entry)
    params = inspect.signature(f).parameters
    request, errors = entry["request"], []
    if entry["pass"] == "nothing":
        assert all(p.default is not p.empty for p in params.values()), f"{ids(entry)} takes no request"
    elif entry["pass"] == "dict":
        first = next(iter(params))
        errors += compare(annotation(f, first), request, True, first)
    else:
        props = request.get("properties", {})
        for name in props:
            if name not in params:
                errors.append(f"Rust passes {name}=, {ids(entry)} has no such parameter")
            else:
                errors += compare(annotation(f, name), {**request, **props[name]}, True, name)
        for name, p in params.items():
            if name not in props and name not in entry["objects"] and p.default is p.empty:
                errors.append(f"{ids(entry)} needs {name}=, which Rust does not pass")
    if not isinstance(f, type):
        errors += compare(annotation(f, "return"), entry["reply"], False, "reply")
    assert not errors, f"{ids(entry)} and src/py/calls.rs disagree:\n" + "\n".join(errors)


def test_a_renamed_field_fails() -> None:
    """The comparison itself: a key renamed on either side is found."""
    from chunkforge_py.contract import ComposeJob

    schema = next(e for e in SEAM if e["function"] == "compose_job")["request"]
    assert compare(ComposeJob, schema, True, "job") == []
    renamed = json.loads(json.dumps(schema).replace('"compute_units"', '"compute_unit"'))
    errors = compare(ComposeJob, renamed, True, "job")
    assert any("'compute_unit'" in e for e in errors) and any("'compute_units'" in e for e in errors), errors
