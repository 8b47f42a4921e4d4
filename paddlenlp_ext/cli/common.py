"""Shared CLI plumbing: config loading with exit code 2 on config errors."""

import sys
from typing import List, Optional, Tuple

from ..config.parse import ConfigError, RunConfig, load_config

EXIT_CONFIG_ERROR = 2


def split_argv(argv: List[str]) -> Tuple[Optional[str], List[str]]:
    """``["cfg.json", "--lora", "true"]`` -> ``("cfg.json", ["--lora", "true"])``."""
    if argv and not argv[0].startswith("--"):
        return argv[0], argv[1:]
    return None, argv


def config_or_exit(argv: List[str], usage: str) -> RunConfig:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        print("Every key is documented in docs/config.md.")
        sys.exit(0 if argv else EXIT_CONFIG_ERROR)
    path, overrides = split_argv(argv)
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
