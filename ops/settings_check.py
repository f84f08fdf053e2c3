"""Every service's settings checked before `epd up` starts anything (and before `epd compose` or
`epd kube` writes anything).

A typo in a topology (an unknown key, a number written as a string) would otherwise surface as a
service that exits at start, is restarted, exits again, until `epd up` gives up. Here each service's
settings, as its first replica would get them (named peers resolved, pinned devices set), are parsed
with the dataclass the service itself parses them into (services/catalog.py SETTINGS), so the same
keys and types are accepted and refused.
"""
from __future__ import annotations

import sys

from ops.topology import Topology
from services.catalog import settings_class
from services.runtime.settings import parse_settings


def settings_errors(topology: Topology) -> list[str]:
    """One line per service whose settings its kind would refuse, naming the service and the file."""
    errors, seen = [], set()
    for spec, _replica, config in topology.instances():
        cls = settings_class(spec.kind)
        if spec.name in seen or cls is None:
            continue
        seen.add(spec.name)
        try:
            parse_settings(cls, config.settings, f"service {spec.name} ({spec.kind})")
        except ValueError as exc:
            errors.append(f"{topology.source or 'topology'}: {exc}")
    return errors


def refuse_bad_settings(topology: Topology, command: str) -> bool:
    """Print `epd COMMAND: <error>` to stderr for each service whose settings would be refused; True if
    any was (the command then exits 2 before it starts or writes anything)."""
    errors = settings_errors(topology)
    for error in errors:
        print(f"epd {command}: {error}", file=sys.stderr)
    return bool(errors)
