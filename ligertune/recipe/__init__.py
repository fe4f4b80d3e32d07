"""The recipe: a typed, validated schema loaded from YAML, with `key=value` overrides.

- `schema`: the sections and fields a recipe may have, with their docs and checks (the reference);
- `convert`: plain data -> `Recipe`, every problem collected with its key path and a "did you mean";
- `load`: the YAML file, duplicate keys, `--set` overrides, paths resolved next to the recipe, dump;
- `catalogue`: the bundled recipes and the reference printer (`python -m ligertune.recipe`).
"""

from ligertune.recipe.catalogue import (
    bundled_recipe,
    bundled_recipes,
    bundled_recipes_dir,
    field_docs,
    json_default,
    recipe_description,
    reference_markdown,
    type_label,
)
from ligertune.recipe.convert import describe_value, recipe_from_dict
from ligertune.recipe.load import apply_overrides, dump_recipe, load_recipe, parse_yaml, resolve_paths
from ligertune.recipe.schema import (
    DEFAULT_BETAS,
    IGNORE_INDEX,
    INT_MAX,
    INT_MIN,
    MAX_EPOCHS,
    MAX_GRAD_ACCUM,
    MAX_LORA_RANK,
    MAX_MICRO_BATCH,
    MAX_SAMPLES,
    MAX_THREADS,
    OBJECTIVE_DEFAULTS,
    PAIRED_OBJECTIVES,
    PREFERENCE_FORMATS,
    REFERENCE_OBJECTIVES,
    SFT_FORMATS,
    DataConfig,
    DataSource,
    DistributedConfig,
    KernelsConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    OutputConfig,
    Recipe,
    TrainConfig,
    check_objective_data,
    objective_data_problem,
)

__all__ = [
    "DEFAULT_BETAS", "IGNORE_INDEX", "INT_MAX", "INT_MIN", "MAX_EPOCHS", "MAX_GRAD_ACCUM", "MAX_LORA_RANK",
    "MAX_MICRO_BATCH", "MAX_SAMPLES", "MAX_THREADS", "OBJECTIVE_DEFAULTS", "PAIRED_OBJECTIVES",
    "PREFERENCE_FORMATS", "REFERENCE_OBJECTIVES", "SFT_FORMATS",
    "DataConfig", "DataSource", "DistributedConfig", "KernelsConfig", "LoraConfig", "LossConfig",
    "ModelConfig", "ObjectiveConfig", "OptimConfig", "OutputConfig", "Recipe", "TrainConfig",
    "apply_overrides", "bundled_recipe", "bundled_recipes", "bundled_recipes_dir", "describe_value",
    "check_objective_data", "dump_recipe", "field_docs", "json_default", "load_recipe", "objective_data_problem", "parse_yaml", "recipe_description",
    "recipe_from_dict", "reference_markdown", "resolve_paths", "type_label",
]
