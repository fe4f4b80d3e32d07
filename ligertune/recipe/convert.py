"""Plain data (parsed YAML) -> the typed `Recipe`, collecting every problem with its key path.

Each value is checked against its field's type hint (converting where YAML is loose: an int where a
float is wanted, `1e-4` read as a string); an unknown key gets a "did you mean"; then every section's
`check()` runs on the sections whose fields all converted. Numbers must be finite and integers fit in
64 bits, whatever the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ligertune.errors import RecipeError
from ligertune.recipe.schema import INT_MAX, INT_MIN, Recipe


def recipe_from_dict(raw: dict, source: str | None = None) -> Recipe:
    """Build a `Recipe` from plain data, collecting every problem with its key path."""
    problems: list[str] = []
    recipe = _build(Recipe, raw, "", problems)
    if recipe is not None:
        # Value checks run on every section whose fields all converted (the others hold None).
        broken = {p.split(":", 1)[0] for p in problems}
        problems.extend(_check_all(recipe, "", broken))
    if problems:
        raise RecipeError(problems, source)
    return recipe


def _check_all(obj: Any, prefix: str, broken: set[str]) -> list[str]:
    """Run every section's `check()` and prefix its keys; skip sections with a key in `broken`."""
    problems = []
    if dataclasses.is_dataclass(obj):
        if hasattr(obj, "check") and not any(k == prefix or k.startswith(f"{prefix}.") or not prefix
                                              for k in broken):
            for key, message in obj.check():
                path = ".".join(p for p in (prefix, key) if p)
                problems.append(f"{path}: {message}" if path else message)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            child = f"{prefix}.{f.name}" if prefix else f.name
            if isinstance(value, list):
                for i, item in enumerate(value):
                    problems.extend(_check_all(item, f"{child}[{i}]", broken))
            else:
                problems.extend(_check_all(value, child, broken))
    return problems


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(raw, dict):
        problems.append(f"{path or 'recipe'}: expected a mapping, got {describe_value(raw)}")
        return None
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else f"; known keys: {', '.join(names)}"
            problems.append(f"{key_path}: unknown key{hint}")
            continue
        kwargs[key] = _convert(hints[key], value, key_path, problems)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in raw:
            problems.append(f"{path}.{f.name}: required" if path else f"{f.name}: required")
    try:
        return cls(**kwargs)
    except TypeError:
        return None


def _convert(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Check `value` against the type hint `tp`, converting where YAML is loose (int -> float)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            problems.append(f"{path}: must not be null")
            return None
        non_null = [o for o in options if o is not type(None)]
        if len(non_null) == 1:
            return _convert(non_null[0], value, path, problems)
        for option in non_null:
            trial: list[str] = []
            result = _convert(option, value, path, trial)
            if not trial:
                return result
        names = " or ".join(_type_name(o) for o in non_null)
        problems.append(f"{path}: expected {names}, got {describe_value(value)}")
        return None
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        problems.append(f"{path}: must be one of {', '.join(map(str, choices))}, got {value!r}{hint}")
        return None
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list, got {describe_value(value)}")
            return None
        return [_convert(item_tp, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT_MIN <= value <= INT_MAX:
                problems.append(f"{path}: out of range: an integer must fit in 64 bits "
                                f"(-2^63 to 2^63-1), got {describe_value(value)}")
                return None
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = _to_float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                problems.append(f"{path}: must be a finite number, got {describe_value(value)}")
                return None
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    elif tp is Any:
        return value
    problems.append(f"{path}: expected {_type_name(tp)}, got {describe_value(value)}")
    return None


def _type_name(tp: Any) -> str:
    if tp is dict:
        return "a mapping"
    if get_origin(tp) is list:
        return "a list"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _to_float(value: int | float) -> float:
    """`float(value)`, infinite where an integer is too large for a float (instead of raising)."""
    try:
        return float(value)
    except OverflowError:
        return math.copysign(math.inf, value)


def describe_value(value: Any, width: int = 60) -> str:
    """A value as a problem message shows it: `null`, `true`, `a list`, or its repr, shortened."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    if isinstance(value, (dict, list)):
        return {dict: "a mapping", list: "a list"}[type(value)]
    if isinstance(value, int) and value.bit_length() > 200:  # repr is slow, or refused, past 4300 digits
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."

