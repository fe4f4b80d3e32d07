"""`python -m ligertune` runs the command line."""

from ligertune.cli.main import main

main()
