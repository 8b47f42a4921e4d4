"""Plumbing shared by the ``llm/`` scripts: config loading, tool options, exit codes."""
