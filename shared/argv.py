"""Command lines as `vllm serve` takes them: `--config FILE.yaml` and underscores in flag names.

`normalize(argv)` turns them into what Tandem's parsers read: every `--flag_name` is written
`--flag-name`, and the keys of a `--config` YAML file become flags placed before the rest, so
a flag given on the command line wins over the file (vLLM's order). In the file, a key is a
flag's name without the dashes (`max_model_len: 4096`, `max-model-len: 4096`); `true` turns a
switch on, `false` writes its `--no-` form (or drops a switch that has none); a list gives
the flag once with every item.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    """A --config file that cannot be read as flags."""


def normalize(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """`argv` with underscores turned to dashes and --config files expanded; `parser` tells
    which switches have a `--no-` form (for `false` in a config file)."""
    argv = [_dashes(arg) for arg in argv]
    files, rest = _take_config(argv)
    known = option_strings(parser) if parser is not None else None
    flags: list[str] = []
    for path in files:
        flags += config_flags(path, known)
    return flags + rest


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands' parsers."""
    found: set[str] = set()
    for action in parser._actions:  # argparse has no public listing of its actions
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= option_strings(sub)
    return found


def _dashes(arg: str) -> str:
    """--max_model_len=8 -> --max-model-len=8; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def _take_config(argv: list[str]) -> tuple[list[str], list[str]]:
    files, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigFileError("--config needs a file name")
            files.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return files, rest


def config_flags(path: str, known: Collection[str] | None = None) -> list[str]:
    """The flags a YAML config file stands for (`known`: the option strings that exist)."""
    import yaml  # only when a config file is given

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(f"--config {path}: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        flags += _flag(str(key), value, known)
    return flags


def _flag(key: str, value: Any, known: Collection[str] | None) -> list[str]:
    name = "--" + key.lstrip("-").replace("_", "-")
    if value is True:
        return [name]
    if value is False:
        negative = "--no-" + name[2:]
        return [negative] if known is None or negative in known else []
    if value is None:
        return []
    if isinstance(value, list):
        return [name, *map(str, value)]
    return [name, str(value)]
