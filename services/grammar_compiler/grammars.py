"""A constraint (messages/grammar.py) -> llguidance grammar text.

JSON is written the way DeepSeek models write it in their chat format (`{"a": [1, 2]}`: ", " and
": " separators, no other whitespace). Flexible whitespace lets a weak or confused model spend its
whole budget on spaces and newlines between tokens; one fixed spelling cannot.

Tool calls are DSML, the model's own format (services/gateway/adapter/tool_calls.py):
    <｜DSML｜ calls>\n<｜DSML｜ invoke name="NAME">\n
    <｜DSML｜ parameter name="P" string="true|false">VALUE</｜DSML｜ parameter>\n ...
    </｜DSML｜ invoke>\n</｜DSML｜ calls>
(V4 spells the tags without the space and names the block `tool_calls`.) The constraint applies to
the arguments inside the DSML: each declared parameter in its schema's order, required ones always,
optional ones maybe; a plain string parameter is written raw (string="true", any text without the
fullwidth bar that starts every DSML marker); every other value is JSON for its own schema
(string="false"). Forced calls (`required`, `named`) start with the block; an `optional` call (auto
with strict tools) may follow answer text, and answer text alone is fine.
"""
from __future__ import annotations

import json

from messages.errors import InvalidRequest

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DSML = "｜DSML｜"
TAGS = {"v4": ("tool_calls", "invoke", "parameter"), "v4.1": (" calls", " invoke", " parameter")}
MODES = ("required", "named", "optional")
# Raw string values may hold anything but the bar that opens every DSML marker (so a value can never
# close its own tag early); answer text before an optional call likewise.
_RAW = "(?s:[^｜])"
# A plain string parameter is written raw only when its schema asks nothing a raw value can't show.
_RAW_STRING_KEYS = {"type", "description", "title", "minLength", "maxLength", "examples", "default"}


def build_grammar(constraint: dict) -> str:
    """The llguidance grammar for one constraint. InvalidRequest for a malformed constraint."""
    if not isinstance(constraint, dict):
        raise InvalidRequest("a constraint must be a JSON object")
    kind = constraint.get("kind")
    if kind == "json_object":
        return _json_grammar({"type": "object"}, strict=True)
    if kind == "json_schema":
        schema = constraint.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("a json_schema constraint needs its schema as a JSON object")
        return _json_grammar(schema, strict=bool(constraint.get("strict", True)))
    if kind == "tool_calls":
        return _tool_calls_grammar(constraint)
    raise InvalidRequest(f"unknown constraint kind {kind!r}; known: json_object, json_schema, tool_calls")


def _json_grammar(schema: dict, strict: bool) -> str:
    from llguidance import LLMatcher
    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(strict))
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the JSON schema is not usable: {exc}") from None


def _json_options(strict: bool) -> dict:
    # lenient: keywords the library cannot enforce are ignored (OpenAI's non-strict schemas are best
    # effort); strict: they are refused, naming the keyword (services/grammar_compiler/check.py).
    return {**JSON_STYLE, "lenient": not strict}


def _tool_calls_grammar(constraint: dict) -> str:
    mode, name, tags = constraint.get("mode"), constraint.get("name"), constraint.get("tags", "v4.1")
    tools = constraint.get("tools")
    if mode not in MODES:
        raise InvalidRequest(f"tool_calls mode must be one of {', '.join(MODES)}, got {mode!r}")
    if tags not in TAGS:
        raise InvalidRequest(f"tool_calls tags must be one of {', '.join(TAGS)}, got {tags!r}")
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("a tool_calls constraint needs at least one tool")
    for tool in tools:
        if not (isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool["name"]):
            raise InvalidRequest("every tool needs a non-empty name")
        if '"' in tool["name"] or "\n" in tool["name"]:
            raise InvalidRequest(f"tool name {tool['name']!r} cannot be written in DSML")
    if mode == "named":
        tools = [t for t in tools if t["name"] == name]
        if not tools:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not a declared tool")
    block, invoke, parameter = TAGS[tags]
    rules = [f"invoke: {' | '.join(f'invoke_{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        rules += _invoke_rules(i, tool, invoke, parameter)
    many = "+" if mode != "named" and constraint.get("parallel", True) else ""   # one call, or several
    body = f'invoke{many} "</{DSML}{block}>"'
    if constraint.get("opened"):          # the prompt ended with the block's opening tag
        lines = [f"start: {body}"]
    elif mode == "optional":
        # Answer text, or answer text then a block. The lexer is greedy and never gives a byte back,
        # so the text and the block's opening tag are one lexeme (OPEN): a text lexeme on its own
        # would swallow the "<" that starts the tag. Text holds no "<" directly before the bar.
        text = f"(?s:([^{DSML[0]}<]|<[^{DSML[0]}])*)"
        lines = ["start: TEXT | OPEN " + body, f"TEXT: /{text}<?/",
                 f"OPEN: /{text}{_regex_literal(f'<{DSML}{block}>')}\\n/"]
    else:
        lines = [f'start: "<{DSML}{block}>\\n" {body}']
    return "%llguidance {}\n" + "\n".join(lines + rules) + "\n"


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in ".^$*+?()[]{}|\\/" else c for c in text)


def _invoke_rules(i: int, tool: dict, invoke: str, parameter: str) -> list[str]:
    schema = tool.get("schema") or {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"tool {tool['name']!r}: parameters must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise InvalidRequest(f"tool {tool['name']!r}: parameters must be an object schema")
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    unknown = required - set(properties)
    if unknown:
        raise InvalidRequest(f"tool {tool['name']!r}: required parameters {sorted(unknown)} are not in properties")
    strict = bool(tool.get("strict", False))
    parts, rules = [], []
    for j, (pname, pschema) in enumerate(properties.items()):
        if not isinstance(pschema, dict):
            raise InvalidRequest(f"tool {tool['name']!r}: parameter {pname!r} needs a schema object")
        if '"' in pname or "\n" in pname:
            raise InvalidRequest(f"tool {tool['name']!r}: parameter name {pname!r} cannot be written in DSML")
        rule = f"param_{i}_{j}"
        open_tag = f"<{DSML}{parameter} name=\\\"{pname}\\\" string=\\\""
        close_tag = f"</{DSML}{parameter}>\\n"
        if _raw_string(pschema):
            lo, hi = pschema.get("minLength", 0), pschema.get("maxLength")
            rules.append(f'{rule}: "{open_tag}true\\">" VALUE_{i}_{j} "{close_tag}"')
            rules.append(f"VALUE_{i}_{j}: /{_RAW}{{{lo},{'' if hi is None else hi}}}/")
        else:
            value_schema = {**pschema, "x-guidance": _json_options(strict)}
            rules.append(f'{rule}: "{open_tag}false\\">" %json {json.dumps(value_schema)} "{close_tag}"')
        parts.append(rule if pname in required else f"{rule}?")
    head = f'"<{DSML}{invoke} name=\\"{tool["name"]}\\">\\n"'
    tail = f'"</{DSML}{invoke}>\\n"'
    return [f"invoke_{i}: {head} {' '.join(parts)} {tail}", *rules]


def _raw_string(schema: dict) -> bool:
    return schema.get("type") == "string" and set(schema) <= _RAW_STRING_KEYS
