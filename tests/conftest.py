"""Fixtures shared across the test tree."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

MODEL_NAME = "deepseek-v4-tiny"
V41_MODEL_NAME = "deepseek-v41-tiny"


def pytest_configure(config):
    """Under pytest-xdist (`pytest -n N`), each worker draws its stacks' ports from its own slice of
    the range, so two workers never start stacks on the same ports (ops/ports.py)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and "EPD_PORT_RANGE" not in os.environ:
        from ops.ports import port_range
        low, high = port_range()
        size = (high - low) // int(count)
        index = int(worker.removeprefix("gw"))
        os.environ["EPD_PORT_RANGE"] = f"{low + index * size}-{low + (index + 1) * size}"


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N --dist loadfile` (`make test`): whole files, and the files that start service
    processes run in one process, one after another (tests/helpers/test_helper_xdist.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.helpers.test_helper_xdist import StackFilesTogether
    return StackFilesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    """The scheduler above finds stack files by reading them; a slow test it would miss stops the run."""
    from tests.helpers.test_helper_xdist import stack_files
    found = stack_files(Path(config.rootpath))
    missed = sorted({item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")} - found)
    if missed:
        raise pytest.UsageError(f"tests marked slow where tests/helpers/test_helper_xdist.py does not see "
                                f"`pytest.mark.slow` in the file: {missed}")


# Python's collector counts objects, not bytes: an in-process worker's engine (~1 GB of pools) kept by a
# reference cycle (a task, a future's traceback) outlives its test until a full collection happens to
# run, and a test process grew to 15 GB over tests/workers that way. A full collection whenever the
# process grew by COLLECT_AFTER_BYTES since the last one keeps it near 1-3 GB at a few collections a run.
COLLECT_AFTER_BYTES = 1 << 30
_HAS_STATM = os.path.exists("/proc/self/statm")   # Linux; elsewhere the rule is off
_rss_after_collect = [0]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    if _HAS_STATM and _rss_bytes() - _rss_after_collect[0] > COLLECT_AFTER_BYTES:
        gc.collect()
        _rss_after_collect[0] = _rss_bytes()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny V4 model (real vocabulary, seed 0), written once per session; the V4 stack tests serve it."""
    from engine.models.v4.random_init import write_random_model_dir
    out = tmp_path_factory.mktemp("models") / MODEL_NAME
    write_random_model_dir("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_v41_model_dir(tmp_path_factory) -> Path:
    """The default stack's model: `epd model init --arch v4.1` (tiny V4.1, released layout, seed 0)."""
    from engine.models.v41.random_init import write_random_v41_model_dir
    out = tmp_path_factory.mktemp("models41") / V41_MODEL_NAME
    write_random_v41_model_dir("tiny-v41", out, seed=0)
    return out


@pytest.fixture(scope="session")
def default_stack(tmp_path_factory, tiny_v41_model_dir):
    """The default topology (E/P/D) as real processes on the default model, started once per session
    (a start costs tens of seconds on a 2-core machine) and shared by the tests that only send it
    requests (tests/gateway, tests/workers). A test that kills or reshapes a stack starts its own."""
    from tests.helpers.test_helper_stack import down_stack, up_stack
    stack = up_stack(tmp_path_factory.mktemp("default_stack"), "default", tiny_v41_model_dir)
    yield stack
    down_stack(stack)
