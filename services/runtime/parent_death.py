"""Child processes that must not outlive the process that started them (Linux)."""
from __future__ import annotations

import ctypes
import os
import signal


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (PR_SET_PDEATHSIG), and
    exit at once if the parent is already gone (it died before the request was made)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the parent's own cleanup has to do
        pass
    if os.getppid() != parent_pid:
        os._exit(1)
