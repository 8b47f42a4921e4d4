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


def config_or_exit(argv: List[str], usage: str, mode: str = "sft") -> RunConfig:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        print("Every key is documented in docs/config.md" + (" and docs/dpo.md." if mode == "dpo" else "."))
        sys.exit(0 if argv else EXIT_CONFIG_ERROR)
    path, overrides = split_argv(argv)
    try:
        return load_config(path, overrides, mode=mode)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def pop_tool_args(argv: List[str], spec: dict) -> Tuple[dict, List[str]]:
    """Take a tool's own ``--name value`` options out of argv (the rest are config overrides).

    ``pop_tool_args(["c.json", "--tolerance", "1e-4", "--lora", "true"], {"tolerance": float})``
    -> ``({"tolerance": 1e-4}, ["c.json", "--lora", "true"])``.
    """
    found, rest, i = {}, [], 0
    while i < len(argv):
        name = argv[i][2:].split("=", 1)[0] if argv[i].startswith("--") else None
        if name in spec:
            if "=" in argv[i]:
                raw, i = argv[i].split("=", 1)[1], i + 1
            elif i + 1 < len(argv):
                raw, i = argv[i + 1], i + 2
            else:
                print(f"--{name} needs a value", file=sys.stderr)
                sys.exit(EXIT_CONFIG_ERROR)
            try:
                found[name] = spec[name](raw)
            except ValueError:
                print(f"--{name}: invalid value {raw!r}", file=sys.stderr)
                sys.exit(EXIT_CONFIG_ERROR)
        else:
            rest.append(argv[i])
            i += 1
    return found, rest


def run_or_exit_code(run, cfg: RunConfig) -> int:
    """Run a validated config; a ConfigError found while building is exit 2, a DataError exit 1."""
    from ..data.reader import DataError

    try:
        run(cfg)
    except ConfigError as e:
        print(e.report(), file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 1
    return 0
