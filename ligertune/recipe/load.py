"""Reading a recipe file: YAML with duplicate keys refused, `--set KEY=VALUE` overrides, paths
resolved next to the recipe, and the resolved recipe dumped back to YAML.

A key given twice in one mapping is a problem (YAML would keep the second silently), and a problem at
a key written by `--set KEY=VALUE` is reported as that override's.

Paths in a recipe (`model.name_or_path`, `model.tokenizer`, a `model.chat_template` file,
`objective.teacher`, `data.path`, `data.sources[].path`, `data.eval_path`) are looked up next to the
recipe file first, so a recipe and its data travel together; a path that is not there is kept as written (a hub id, or a path relative to the current
directory) unless its first folder is there. `output.dir` is relative to the current directory.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
from pathlib import Path
from typing import Any

import yaml

from ligertune import hub
from ligertune.errors import RecipeError, first_line
from ligertune.recipe.convert import describe_value, recipe_from_dict
from ligertune.recipe.schema import Recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override, validate and resolve a recipe file; raise `RecipeError` listing every problem.

    Each problem names where it is to be fixed: the recipe file (`recipe.yaml: optim.lr: ...`) or
    the override that wrote its key (`--set optim.lr=-1: must be > 0, got -1.0`).
    """
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(["recipe file not found"], source) from None
    except IsADirectoryError:
        raise RecipeError(["cannot read recipe: it is a directory"], source) from None
    except OSError as err:
        raise RecipeError([f"cannot read recipe: {err.strerror or err}"], source) from None
    except UnicodeDecodeError as err:
        raise RecipeError([f"cannot read recipe: not valid UTF-8 (byte {err.start})"], source) from None
    raw, problems = parse_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError([f"the recipe must be a mapping of sections, got {describe_value(raw)}"], source)
    raw = apply_overrides(raw, overrides)
    try:
        recipe = recipe_from_dict(raw)
    except RecipeError as err:
        problems = problems + err.problems
    else:
        if not problems:
            return resolve_paths(recipe, path.parent)
    raise RecipeError(_attribute(problems, source, overrides))


def _attribute(problems: list[str], source: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Prefix each `key.path: message` problem with the override that wrote its key (the last one
    that did), else with the recipe file."""
    written = [(item, item.partition("=")[0].strip()) for item in overrides]
    lines = []
    for problem in problems:
        key, _, message = problem.partition(": ")
        for item, wrote in reversed(written):
            if key == wrote:
                lines.append(f"--set {_shorten(item)}: {message}")
                break
            if key.startswith((f"{wrote}.", f"{wrote}[")):
                lines.append(f"--set {_shorten(item)}: {problem}")
                break
        else:
            lines.append(f"{source}: {problem}")
    return lines


def parse_yaml(text: str, source: str, *, lines: bool = True) -> tuple[Any, list[str]]:
    """The YAML document in `text`, and its duplicate keys as problems (`optim: duplicate key, ...`).

    PyYAML keeps the last of two equal keys of a mapping: a second `optim:` section would silently
    replace the first, so every duplicate, at any depth, is reported with both line numbers (`lines`;
    without them for one-line texts). A syntax error raises `RecipeError` with its line and column.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        problems = _duplicate_keys(node, lines=lines)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RecipeError([f"YAML syntax error at {where}{err.problem or err.context}"], source) from None
    except yaml.YAMLError as err:
        raise RecipeError([f"YAML error: {first_line(err)}"], source) from None
    except RecursionError:
        raise RecipeError(["YAML error: nested too deeply"], source) from None
    except ValueError as err:  # a constructor's own check: Python reads no integer of over 4300 digits
        reason = "an integer too long to read" if "digits" in str(err) else first_line(err)
        raise RecipeError([f"YAML error: {reason}"], source) from None
    finally:
        loader.dispose()
    return data, problems


def _duplicate_keys(root: yaml.Node | None, *, lines: bool) -> list[str]:
    """`path: duplicate key (lines a and b)` for every key given twice in one mapping, in the order
    of the text, and `path: ...` for an alias to a node that contains it (a recursive structure)."""
    found: list[tuple[int, str]] = []
    stack: list[tuple[yaml.Node, str, frozenset[int]]] = [(root, "", frozenset())] if root is not None else []
    done: set[int] = set()
    while stack:
        node, path, ancestors = stack.pop()
        if id(node) in ancestors:
            found.append((node.start_mark.line, f"{path}: an alias refers to a node that contains it "
                                                 "(a recursive structure)"))
            continue
        if id(node) in done:  # an alias to a node already checked
            continue
        done.add(id(node))
        inside = ancestors | {id(node)}
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], yaml.Node] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                child = f"{path}.{key_node.value}" if path else key_node.value
                first = seen.setdefault((key_node.tag, key_node.value), key_node)
                if first is not key_node:
                    a, b = first.start_mark, key_node.start_mark
                    where = ("" if not lines else f" (lines {a.line + 1} and {b.line + 1})" if a.line != b.line
                             else f" (line {a.line + 1}, columns {a.column + 1} and {b.column + 1})")
                    found.append((key_node.start_mark.line, f"{child}: duplicate key{where}; "
                                  "the second would silently replace the first"))
                stack.append((value_node, child, inside))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                stack.append((item, f"{path}[{i}]", inside))
    return [problem for _, problem in sorted(found, key=lambda f: f[0])]


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Apply `a.b.c=value` overrides (the value parsed as YAML) to a copy of the raw mapping.

    A key missing or null on the way is created as a mapping (`--set lora.r=8` with no `lora`
    section); a key on the way that holds something else is an error, as is a malformed override.
    """
    raw = copy.deepcopy(raw)
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        shown = _shorten(item)
        if not sep or not all(parts):
            problems.append(f"--set {shown}: expected KEY=VALUE with a dotted KEY, e.g. optim.lr=1e-4")
            continue
        try:
            value, duplicates = parse_yaml(text, f"--set {shown}", lines=False) if text.strip() else (None, [])
        except RecipeError:
            value, duplicates = text, []  # not YAML: the text itself (the schema says if a string fits)
        problems.extend(f"--set {shown}: {key}{'' if p.startswith('[') else '.'}{p}" for p in duplicates)
        node = raw
        for depth, part in enumerate(parts[:-1], 1):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                problems.append(f"--set {shown}: `{'.'.join(parts[:depth])}` holds {describe_value(child)}, "
                                "not a mapping of keys")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise RecipeError(problems)
    return raw


def _shorten(text: str, width: int = 80) -> str:
    return text if len(text) <= width else f"{text[: width - 3]}..."



def resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    """Point relative paths at the recipe's folder when they are found there (`hub.found_in`): a file
    or folder of that name, files that a pattern matches, or the folder that the path starts with
    (`data/missing.jsonl` next to a folder `data`: the path is meant there, and a missing file is
    reported there rather than looked up on the hub)."""

    def local(p: str | None) -> str | None:
        if p is None:
            return None
        expanded = Path(p).expanduser()
        if expanded.is_absolute():
            return str(expanded)
        return str(base / expanded) if hub.found_in(base, expanded) or glob.glob(str(base / expanded)) else p

    template = recipe.model.chat_template  # a name, Jinja text, or a file
    if template is not None and template.endswith(".jinja"):
        template = local(template)
    model = dataclasses.replace(recipe.model, name_or_path=local(recipe.model.name_or_path),
                                tokenizer=local(recipe.model.tokenizer), chat_template=template)
    sources = [dataclasses.replace(s, path=local(s.path)) for s in recipe.data.sources]
    data = dataclasses.replace(recipe.data, path=local(recipe.data.path), sources=sources,
                               eval_path=local(recipe.data.eval_path))
    objective = dataclasses.replace(recipe.objective, teacher=local(recipe.objective.teacher))
    return dataclasses.replace(recipe, model=model, data=data, objective=objective)


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what a run writes next to its outputs)."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)

