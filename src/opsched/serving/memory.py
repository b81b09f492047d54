"""What a server's preparation may hold in memory: the heap's freed pages handed back after each model, and the
kernels the plans are chosen on cut back to eager where choosing them would not fit.

``--kernels auto`` makes each graph's blocks, and the whole graph, into ONNX Runtime sessions to time them, each
with its own copy of the weights. Measured on 2 cores (x86_64, 24 GiB): one ResNet-18 (47 MB of weights) peaked
1.1 GB over what its plans kept, about 24 times its weights; the fused graph of 16 ResNet-18 grew past 7.5 GB over
the 9.5 GB the models' plans held before it was stopped, and an unguarded server was killed by the system at
20.5 GB. So choosing is allowed ``CHOICE_FACTOR`` times the weights of what it chooses for, against the memory
the system reports available.

    >>> fits_kernel_choice(10_000_000, available=1_000_000_000)
    True
    >>> fits_kernel_choice(750_000_000, available=14_000_000_000)
    False
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from typing import Any

CHOICE_FACTOR = 25  # the bytes choosing kernels may hold, per byte of the weights chosen for (measured about 24)


def weight_bytes(models: Iterable[Any]) -> int:
    """The bytes of the parameters and buffers of ``models`` (torch modules; anything else counts nothing)."""
    total = 0
    for model in models:
        for tensor in [*getattr(model, "parameters", list)(), *getattr(model, "buffers", list)()]:
            total += tensor.numel() * tensor.element_size()
    return total


def available_bytes() -> int | None:
    """The memory the system says can be taken without swapping (``MemAvailable``; free pages where that is not
    reported); None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fits_kernel_choice(weights: int, available: int | None) -> bool:
    """Whether choosing kernels for a graph of ``weights`` bytes fits in ``available`` bytes (None: unknown, assumed
    to fit)."""
    return available is None or CHOICE_FACTOR * weights <= available


def kernels_that_fit(options: dict, models: Iterable[Any], what: str) -> tuple[dict, str]:
    """``options`` with eager kernels where they ask for ``auto`` (the default) and choosing for ``models`` would
    not fit in memory, and the line that says so (empty where nothing changed)."""
    if options.get("kernels", "auto") != "auto":
        return options, ""
    weights, available = weight_bytes(models), available_bytes()
    if fits_kernel_choice(weights, available):
        return options, ""
    return {**options, "kernels": "eager"}, (
        f"{what}: eager kernels: choosing kernels would hold about {CHOICE_FACTOR * weights / 1e9:.1f} GB, more than "
        f"the {available / 1e9:.1f} GB available")


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing). Choosing kernels
    makes and drops about a hundred ONNX Runtime sessions a ResNet-18, whose freed memory glibc keeps: four
    ResNet-18 held 4.4 GB once ready, and 3.0 GB trimmed after each model (2.0 GB on eager kernels)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols already loaded: libc's, on Linux
    except (AttributeError, OSError, TypeError):
        return
    trim(0)
