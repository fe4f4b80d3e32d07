"""`python -m ligertune.recipe > docs/recipe.md`: print the recipe reference."""

from ligertune.recipe.catalogue import reference_markdown

print(reference_markdown(), end="")
