"""Several registries' Prometheus text as one: each part's samples labelled with its name (a several-model
server's ``/metrics``, ``model="..."``), each metric family's ``# HELP`` and ``# TYPE`` written once."""

from __future__ import annotations

from tokenmill.observability.metrics import escape_label


def merge_expositions(label: str, parts: dict[str, bytes]) -> bytes:
    """``parts`` (label value → a registry's text exposition) as one exposition, every sample carrying
    ``label``; a family's samples from every part follow its one header."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for value, text in parts.items():
        header, samples = families.setdefault("", ([], []))
        pair = f'{label}="{escape_label(value)}"'
        for line in text.decode("utf-8").splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                header, samples = families.setdefault(line.split(" ", 3)[2], ([], []))
                if line not in header:
                    header.append(line)
            elif line and not line.startswith("#"):
                samples.append(labelled(line, pair))
    lines = [line for header, samples in families.values() for line in (*header, *samples)]
    return ("\n".join(lines) + "\n").encode("utf-8") if lines else b""


def labelled(sample: str, pair: str) -> str:
    """A sample line (``name{a="1"} 2`` or ``name 2``) with one more label pair, first."""
    name_end = min(index for index in (sample.find("{"), sample.find(" "), len(sample)) if index >= 0)
    name, rest = sample[:name_end], sample[name_end:]
    if rest.startswith("{"):
        return f"{name}{{{pair}{'' if rest.startswith('{}') else ','}{rest[1:]}"
    return f"{name}{{{pair}}}{rest}"
