"""CPU pinning for `epd bench grammar --ttft`: the grammar compiler on some CPUs, everything else on
others, standing in for "compilers on separate machines" on a many-core host.

Linux sets affinity per thread (sched_setaffinity on a pid sets only that thread), and new threads
and processes inherit the affinity of the thread that creates them. So every thread (/proc/<pid>/task)
of every process of a tree is pinned, and pinning passes repeat until one finds nothing left to
change (a thread started during a pass by a thread not yet pinned is caught by the next). Compile
processes the compiler starts later (a replacement after a timeout) inherit its CPUs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

MAX_PASSES = 5
COMPILER_KIND = "grammar_compiler"


def parse_cpu_list(text: str) -> frozenset[int]:
    """"0-7,12,14-15" -> {0..7, 12, 14, 15}; the format of taskset -c and /sys/.../cpulist."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected numbers and ranges such as 0-7,12")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return frozenset(cpus)


def format_cpu_list(cpus) -> str:
    """The inverse of parse_cpu_list, ranges folded: {0,1,2,5} -> "0-2,5"."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(_span(run))
        run = [cpu]
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def check_cpu_sets(compiler: frozenset[int], stack: frozenset[int], usable: frozenset[int]) -> str:
    """Why these two sets cannot be used here, or ""."""
    missing = (compiler | stack) - usable
    if missing:
        return f"CPUs {format_cpu_list(missing)} are not usable here (usable: {format_cpu_list(usable)})"
    if compiler & stack:
        return f"--compiler-cpus and --stack-cpus share CPUs {format_cpu_list(compiler & stack)}"
    return ""


def children_of(proc_root: str = "/proc") -> dict[int, list[int]]:
    """parent pid -> its child pids, from every /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc_root}/{name}/stat") as f:
                ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue   # gone meanwhile
        children.setdefault(ppid, []).append(int(name))
    return children


def tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    """pid and all its descendants."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, ()))
    return out


@dataclass
class PinPlan:
    """Which processes (each with all its threads) go on which CPUs."""
    groups: dict[str, tuple[frozenset[int], list[int]]] = field(default_factory=dict)   # name -> (cpus, pids)

    def threads(self) -> dict[str, int]:
        return {name: sum(len(_tids(p)) for p in pids) for name, (_, pids) in self.groups.items()}


def plan_for_stack(state: dict, compiler_cpus: frozenset[int], stack_cpus: frozenset[int],
                   own_pid: int | None = None, proc_root: str = "/proc") -> PinPlan:
    """From a stack's state.json: each grammar compiler and its descendants on compiler_cpus; every
    other service with its descendants, the supervisor and this process (the clients) on stack_cpus."""
    children = children_of(proc_root)
    compiler, stack = [], [state["supervisor_pid"]]
    for service in state["services"]:
        if service.get("pid"):
            (compiler if service["kind"] == COMPILER_KIND else stack).extend(tree(service["pid"], children))
    if own_pid is not None:
        stack.append(own_pid)
    return PinPlan({"compiler": (compiler_cpus, compiler), "stack": (stack_cpus, stack)})


def apply(plan: PinPlan) -> dict[str, int]:
    """Pin every thread of every planned process; returns threads per group. Raises when threads are
    still being started off their CPUs after MAX_PASSES passes."""
    for _ in range(MAX_PASSES):
        changed = 0
        for cpus, pids in plan.groups.values():
            for pid in pids:
                changed += _pin_threads(pid, cpus)
        if not changed:
            return plan.threads()
    raise RuntimeError(f"threads kept appearing off their CPUs after {MAX_PASSES} pinning passes")


def misplaced(plan: PinPlan) -> list[str]:
    """Threads of the planned processes not on their group's CPUs (checked again after the run)."""
    out = []
    for name, (cpus, pids) in plan.groups.items():
        for pid in pids:
            for tid in _tids(pid):
                actual = _affinity(tid)
                if actual is not None and actual != cpus:
                    out.append(f"{name} pid {pid} thread {tid} on {format_cpu_list(actual)}")
    return out


def _pin_threads(pid: int, cpus: frozenset[int]) -> int:
    changed = 0
    for tid in _tids(pid):
        current = _affinity(tid)
        if current is None or current == cpus:
            continue
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue   # the thread ended
        changed += 1
    return changed


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _affinity(tid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except ProcessLookupError:
        return None
