"""The bundled recipes (`ligertune recipes ls | show | cp`) and the recipe reference printed from the
schema (docs/recipe.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from ligertune.errors import UserError
from ligertune.recipe.schema import Recipe

# --------------------------------------------------------------------------------------------------
# Bundled recipes


def bundled_recipes_dir() -> Path:
    """The `recipes/` folder of a source checkout, else its installed copy `ligertune/bundled_recipes/`."""
    package = Path(__file__).resolve().parent.parent
    checkout = package.parent / "recipes"
    return checkout if checkout.is_dir() else package / "bundled_recipes"


def bundled_recipes() -> dict[str, Path]:
    """Every bundled recipe by name (its path under recipes/ without `.yaml`), sorted."""
    root = bundled_recipes_dir()
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in sorted(root.rglob("*.yaml"))}


def bundled_recipe(name: str) -> Path:
    """The bundled recipe `name` (`.yaml` optional); an unknown name is a `UserError` with a "did you mean"."""
    recipes = bundled_recipes()
    if name.endswith(".yaml"):
        name = name[: -len(".yaml")]
    if name in recipes:
        return recipes[name]
    close = difflib.get_close_matches(name, list(recipes), n=1, cutoff=0.5)
    hint = f"; did you mean `{close[0]}`?" if close else f"; bundled: {', '.join(recipes)}"
    raise UserError(f"no bundled recipe named {name!r}{hint}")


def recipe_description(path: Path) -> str:
    """The recipe's `description`, else its first comment line."""
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        raw = None
    if isinstance(raw, dict) and isinstance(raw.get("description"), str):
        return raw["description"].strip()
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def bundled_recipe_writing(folder: Path) -> Path | None:
    """The bundled recipe whose `output.dir` is `folder` (both relative to the current directory, as
    a recipe's `output.dir` is), or None: which recipe to train to make a model that another bundled
    recipe starts from (`quickstart-dpo` starts from `runs/quickstart/final`)."""
    target = folder.expanduser().absolute()
    for path in bundled_recipes().values():
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        output = raw.get("output") if isinstance(raw, dict) else None
        written = output.get("dir") if isinstance(output, dict) else None
        if isinstance(written, str) and Path(written).expanduser().absolute() == target:
            return path
    return None


# --------------------------------------------------------------------------------------------------
# The reference


def field_docs(cls: type = Recipe, prefix: str = "") -> typing.Iterator[tuple[str, str, Any, str]]:
    """(key path, type, default, doc) for every field, sections first-to-last (for the docs)."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        section = tp if dataclasses.is_dataclass(tp) else next(
            (a for a in get_args(tp) if dataclasses.is_dataclass(a)), None)
        if section is not None and get_origin(tp) is not list:
            yield key, "section", None, f.metadata.get("doc", "")
            yield from field_docs(section, key + ".")
        else:
            default = f.default
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            yield key, type_label(tp), default, f.metadata.get("doc", "")
            item = get_args(tp)[0] if get_origin(tp) is list else None
            if dataclasses.is_dataclass(item):
                yield from field_docs(item, key + "[].")


def type_label(tp: Any) -> str:
    """A type hint as a reader of the docs would write it: `int or null`, `one of: a, b`."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of: " + ", ".join(map(str, get_args(tp)))
    if origin in (Union, types.UnionType):
        return " or ".join(type_label(a) for a in get_args(tp))
    if origin is list:
        return f"list of {type_label(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", dict: "mapping"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def reference_markdown() -> str:
    """docs/recipe.md: every key with its type, default and documentation (kept in sync by a test)."""
    lines = [
        "# Recipe reference",
        "",
        "Generated from `ligertune/recipe/schema.py` by `python -m ligertune.recipe > docs/recipe.md`.",
        "Override any key from the command line: `ligertune train RECIPE --set optim.lr=1e-4`",
        "(the value is parsed as YAML).",
        "",
        "Every number must be finite (no `.nan` or `.inf`) and every integer fit in 64 bits; a key",
        "given twice in one mapping is an error (YAML would silently keep the second).",
    ]
    for key, tp, default, doc in field_docs():
        if tp == "section":
            lines += ["", f"## `{key}`", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
            continue
        shown = "required" if default is dataclasses.MISSING else json_default(default)
        lines.append(f"| `{key}` | {tp} | {shown} | {doc} |")
    return "\n".join(lines) + "\n"


def json_default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if value != [] else "`[]`"
