"""``python -m bench NAME [args]``: one table from each scenario's name to the module that runs it.

Every module of the table has a ``main(argv)`` that takes the arguments after the name: ``python -m
bench mixed --duration 60`` calls ``mixed.main(["--duration", "60"])``, whatever comes before or after
the name. The comparison of tokenmill and its peers (``bench.compare``: ``quick``, ``vllm``,
``defaults``, ``full``) reads its scenario name among its own arguments, and runs ``quick`` when no
name is given; its ``--help`` lists every scenario of the table.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from bench import coldstart, compare, dtype, grammar, latency, lora, mixed, multiturn, quant, shards, soak, speculate

SCENARIOS: dict[str, ModuleType] = {
    **dict.fromkeys(compare.SCENARIOS, compare), "latency": latency, "mixed": mixed, "multiturn": multiturn,
    "grammar": grammar, "quant": quant, "shards": shards, "lora": lora, "soak": soak, "dtype": dtype,
    "speculate": speculate, "coldstart": coldstart,
}


def about(name: str) -> str:
    """What scenario ``name`` runs, in a line of ``python -m bench --help``."""
    module = SCENARIOS[name]
    return compare.SCENARIOS[name].about if module is compare else module.ABOUT


def main(argv: list[str] | None = None) -> Any:
    args = list(sys.argv[1:] if argv is None else argv)
    name = next((arg for arg in args if arg in SCENARIOS), None)
    module = SCENARIOS[name] if name else compare
    if module is compare:
        return compare.main(args, {scenario: about(scenario) for scenario in SCENARIOS})
    args.remove(name)  # its first occurrence: the name itself
    return module.main(args)


if __name__ == "__main__":
    main()
