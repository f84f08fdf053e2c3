"""Test-only: how `make test` spreads the suite over pytest-xdist processes (`--dist loadfile`).

Files stay whole (a module's stack starts once), and every file that starts service processes (any
test in it marked slow) joins one unit that a single process runs one file after another. Two stacks
starting at once on a 2-core machine each took twice as long, timing tests failed under that load,
and the session's default stack would start in every process that ran one of its files. The other
processes take the remaining files; whoever finishes first takes what is left.

xdist's own `--dist loadgroup` cannot do this on pytest 9: it renames items through `item._nodeid`,
which pytest 9 no longer reads. The controller never collects, so the stack files are found here by
reading the test files for the marker."""
from __future__ import annotations

import re
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

STACKS = "stacks"
SLOW_MARK = re.compile(r"\bpytest\.mark\.slow\b")


def stack_files(root: Path, tests_dir: str = "tests") -> set[str]:
    """Paths (relative to `root`, as in node ids) of the test files that mark any test slow."""
    return {path.relative_to(root).as_posix() for path in sorted((root / tests_dir).rglob("test_*.py"))
            if SLOW_MARK.search(path.read_text(encoding="utf-8"))}


class StackFilesTogether(LoadFileScheduling):
    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.stack_files = stack_files(Path(config.rootpath))

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return STACKS if path in self.stack_files else path
