"""Command-line entry points, one module per command. Only this package maps errors to exit codes."""
