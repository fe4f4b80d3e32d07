"""The `ligertune` command line: one module per command, each a thin wrapper over the library."""
