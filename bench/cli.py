"""``python -m bench NAME [args]``: one table from each scenario's name to the module that runs it.

Every module of the table has a ``main(argv)`` that takes the arguments after the name: ``python -m
bench mixed --duration 60`` calls ``mixed.main(["--duration", "60"])``, whatever comes before or after
the name. The comparison of tokenmill and its peers (``bench.compare``: ``quick``, ``vllm``,
``defaults``, ``full``) reads its scenario name among its own arguments, and runs ``quick`` when no
name is given; its ``--help`` lists every scenario of the table.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Any

from bench import (
    coldstart,
    compare,
    dtype,
    embed,
    grammar,
    latency,
    lora,
    mixed,
    multiturn,
    quant,
    shards,
    soak,
    speculate,
)

SCENARIO_MODULES: dict[str, ModuleType] = {
    **dict.fromkeys(compare.SCENARIOS, compare), "latency": latency, "mixed": mixed, "multiturn": multiturn,
    "grammar": grammar, "quant": quant, "shards": shards, "lora": lora, "soak": soak, "dtype": dtype,
    "speculate": speculate, "coldstart": coldstart, "embed": embed,
}


def about(name: str) -> str:
    """What scenario ``name`` runs, in a line of ``python -m bench --help``."""
    module = SCENARIO_MODULES[name]
    return compare.SCENARIOS[name].about if module is compare else module.ABOUT


def scenario_lines() -> dict[str, str]:
    """Every scenario of the table and what it runs, as ``python -m bench --help`` lists them."""
    return {name: about(name) for name in SCENARIO_MODULES}


def route(argv: list[str]) -> tuple[ModuleType, list[str]]:
    """The module that runs ``python -m bench ARGS`` and the arguments its ``main`` takes: the module of the first
    argument that names a scenario, without that name (``bench.compare``, which reads the name itself, gets them
    all, and runs when none is named)."""
    args = list(argv)
    name = next((arg for arg in args if arg in SCENARIO_MODULES), None)
    module = SCENARIO_MODULES[name] if name else compare
    if module is not compare:
        args.remove(name)  # its first occurrence: the name itself
    return module, args


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser that ``python -m bench ARGS`` parses its arguments with, and those arguments."""
    module, args = route(argv)
    return (compare.parser(scenario_lines()) if module is compare else module.parser()), args


def main(argv: list[str] | None = None) -> Any:
    module, args = route(sys.argv[1:] if argv is None else argv)
    if module is compare:
        return compare.main(args, scenario_lines())
    return module.main(args)


if __name__ == "__main__":
    main()
