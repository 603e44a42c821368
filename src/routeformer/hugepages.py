"""Large CPU tensors on 2 MiB pages: PyTorch's ``THP_MEM_ALLOC_ENABLE``.

A fresh 4 KiB page costs a page fault and a clear when it is first touched. The fused kernels write fresh outputs
at every call (out, lse, the gradients; the ranges operator a scratch row per entry), so at long sequences the
faults are a large share of a call. PyTorch's CPU allocator asks the kernel for transparent huge pages for every
allocation of 2 MiB or more when ``THP_MEM_ALLOC_ENABLE=1``: one fault per 2 MiB. At 16k tokens that takes routing's
forward + backward to about 0.7x the time, local attention's to 0.8x, full attention's unchanged (docs/benchmarks.md,
"Huge pages").

PyTorch reads the variable once, at its first allocation, so it must be set before any tensor exists: the command
line sets it (``request``) unless the user has; a library user sets it in the environment. The system's THP mode
must be ``madvise`` or ``always`` (``never`` turns the request into nothing).
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "THP_MEM_ALLOC_ENABLE"
_SYSTEM_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def request() -> None:
    """Sets ``THP_MEM_ALLOC_ENABLE=1`` unless the environment already names a value (the user's choice, 0
    included). Call it before the process makes its first tensor; later it changes nothing in this process."""
    os.environ.setdefault(VARIABLE, "1")


def system_mode() -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), None where it cannot be read (not Linux)."""
    try:
        text = _SYSTEM_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def in_effect() -> bool | None:
    """Whether a fresh 8 MiB CPU tensor lands on huge pages in this process (its mapping's ``AnonHugePages`` in
    /proc/self/smaps after a write); None where that cannot be read (not Linux)."""
    import torch

    x = torch.empty(2 * 2**20)  # 8 MiB of float32
    x.fill_(1.0)
    address = x.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's range, "start-end perms ..."
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) > 0
    return False


def state() -> str:
    """``on``, ``off`` or ``unknown``: ``in_effect`` as the benchmarks' headers print it."""
    return {True: "on", False: "off", None: "unknown"}[in_effect()]


def describe() -> str:
    """``routeformer env``'s line: the state and why (the variable, the system's mode)."""
    value = os.environ.get(VARIABLE, "unset")
    return f"{state()} ({VARIABLE}={value}, system THP mode {system_mode() or 'unknown'})"
