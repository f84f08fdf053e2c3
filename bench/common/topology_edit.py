"""Edits of a topology's text for the benches that start a local stack with other settings: one
kind's `replicas` and `[service.settings]` keys, set (added or replaced) in every service of that
kind, and the `[model]` table's keys (with_model). The text is edited, not re-serialized, so the copy keeps its comments and order; the result is
parsed back and checked, so an edit that did not land raises instead of benching the wrong stack.
"""
from __future__ import annotations

import json
import re
import tomllib
from typing import Any

_SERVICE = re.compile(r"(?m)^(?=\[\[service\]\])")
_SETTINGS = re.compile(r"(?m)^\[service\.settings\]\s*$")


def with_service_settings(text: str, kind: str, settings: dict[str, Any] | None = None,
                          replicas: int | None = None) -> str:
    """The topology text with `settings` in every `kind` service's settings and, when given, its
    `replicas`; ValueError when the topology has no such service or the edit did not take."""
    settings = settings or {}
    blocks = _SERVICE.split(text)
    found = False
    for n, block in enumerate(blocks):
        if not re.search(rf'(?m)^kind\s*=\s*"{re.escape(kind)}"', block):
            continue
        found = True
        if replicas is not None:
            block = _set_replicas(block, replicas)
        for key, value in settings.items():
            block = _set_setting(block, key, value)
        blocks[n] = block
    if not found:
        raise ValueError(f"the topology has no {kind} service")
    edited = "".join(blocks)
    for service in tomllib.loads(edited).get("service", []):
        if service.get("kind") != kind:
            continue
        wrong = {k: v for k, v in settings.items() if service.get("settings", {}).get(k) != v}
        if wrong or (replicas is not None and service.get("replicas", 1) != replicas):
            raise ValueError(f"could not set {kind}'s {sorted(wrong) or 'replicas'} in the topology")
    return edited


def _toml_value(value: Any) -> str:
    if isinstance(value, (bool, int, float, str)):
        return json.dumps(value)   # true/false, numbers and plain strings read the same in TOML
    raise ValueError(f"topology setting values are str, int, float or bool, got {type(value).__name__}")


def _set_replicas(block: str, replicas: int) -> str:
    line = f"replicas = {int(replicas)}"
    if re.search(r"(?m)^replicas\s*=", block):
        return re.sub(r"(?m)^replicas\s*=.*$", line, block, count=1)
    # a top-level key of the service: after the [[service]] header, before its settings table
    return re.sub(r"(?m)^(\[\[service\]\][^\n]*\n)", rf"\g<1>{line}\n", block, count=1)


def _set_setting(block: str, key: str, value: Any) -> str:
    line = f"{key} = {_toml_value(value)}"
    settings = _SETTINGS.search(block)
    if settings is None:
        return block.rstrip("\n") + f"\n[service.settings]\n{line}\n"
    head, body = block[:settings.end()], block[settings.end():]
    pattern = rf"(?m)^{re.escape(key)}\s*=.*$"
    if re.search(pattern, body):
        return head + re.sub(pattern, lambda _: line, body, count=1)
    return head + f"\n{line}" + body


def with_model(text: str, model: dict[str, Any]) -> str:
    """The topology text with `model` set in its [model] table (the model every service serves)."""
    header = re.search(r"(?m)^\[model\][^\n]*\n", text)
    if header is None:
        first = _SERVICE.search(text)
        at = first.start() if first else len(text)
        text, header_end = text[:at] + "[model]\n\n" + text[at:], at + len("[model]\n")
    else:
        header_end = header.end()
    table_end = re.compile(r"(?m)^\[").search(text, header_end)
    head, body, tail = text[:header_end], text[header_end:table_end.start() if table_end else len(text)], \
        text[table_end.start() if table_end else len(text):]
    for key, value in model.items():
        line, pattern = f"{key} = {_toml_value(value)}", rf"(?m)^{re.escape(key)}\s*=.*$"
        body = re.sub(pattern, lambda _: line, body, count=1) if re.search(pattern, body) else f"{line}\n{body}"
    edited = head + body + tail
    wrong = {k: v for k, v in model.items() if tomllib.loads(edited).get("model", {}).get(k) != v}
    if wrong:
        raise ValueError(f"could not set the [model] table's {sorted(wrong)} in the topology")
    return edited
