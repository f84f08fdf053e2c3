"""The engine talks to models through `engine.models.spec` only: no attribute probing or type-name tests
on models, configs or states anywhere in engine/, and V4.1 shares code with V4 through
`engine.models.common`, never by importing `engine.models.v4`."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine"

# getattr with a default on something that is not a model: (file, the object's source) -> why
NOT_MODELS = {
    ("engine/models/v4/moe.py", "F"): "torch.nn.functional: grouped_mm by torch version",
    ("engine/models/v4/moe.py", "torch"): "torch: _grouped_mm by torch version",
    ("engine/models/v41/engram_table.py", "result"): "a CUDA runtime status: an int or an enum by torch version",
}


def _python_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def duck_typing(relative: str, source: str) -> list[str]:
    """`hasattr(...)`, `getattr(x, name, default)` and `type(x).__name__` compared to something, in
    one file's source, as 'file:line: code'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3
                                             and (relative, ast.unparse(node.args[0])) not in NOT_MODELS):
                found.append(f"{relative}:{node.lineno}: {ast.get_source_segment(source, node)}")
        if isinstance(node, ast.Compare) and any(_is_type_name(side) for side in [node.left, *node.comparators]):
            found.append(f"{relative}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def _is_type_name(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "__name__" and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "type")


def test_the_engine_probes_no_model_config_or_state_for_attributes():
    found = [hit for path in _python_files(ENGINE)
             for hit in duck_typing(path.relative_to(REPO).as_posix(), path.read_text())]
    assert found == [], "ask engine.models.spec's contract instead:\n" + "\n".join(found)


def test_the_duck_typing_check_finds_what_it_forbids():
    source = ('def f(model, config, exc):\n    a = hasattr(model, "decode_graphs")\n'
              '    b = getattr(config, "last_kv_source", -1)\n    c = f"{type(exc).__name__}"\n'
              '    return type(model).__name__ == "X"\n')
    assert [hit.split(": ", 1)[1] for hit in duck_typing("engine/sample.py", source)] == [
        'hasattr(model, "decode_graphs")', 'getattr(config, "last_kv_source", -1)', 'type(model).__name__ == "X"']


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_v41_does_not_import_v4():
    bad = sorted(f"{path.relative_to(REPO)}: {name}" for path in _python_files(ENGINE / "models" / "v41")
                 for name in imported_modules(path)
                 if name == "engine.models.v4" or name.startswith("engine.models.v4."))
    assert bad == [], "share through engine.models.common instead:\n" + "\n".join(bad)


def test_the_engine_outside_the_families_imports_neither_family_but_to_load():
    """KV manager, runner, scheduler, EngineCore and quantization are typed against the contract; only
    the loader that picks a family by its config.json may name one."""
    loaders = {"engine/loading.py"}
    bad = []
    for path in _python_files(ENGINE):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith(("engine/models/", "engine/kernels/")) or relative in loaders:
            continue
        bad += [f"{relative}: {name}" for name in imported_modules(path)
                if name.startswith(("engine.models.v4.", "engine.models.v41.")) or name in ("engine.models.v4",
                                                                                           "engine.models.v41")]
    assert bad == [], "\n".join(sorted(bad))
