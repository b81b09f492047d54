"""Models sent to another process (a Ray Serve replica, the process engine's models' process) with cloudpickle: the
classes that are the user's own code go by value, the rest by reference."""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def user_code_by_value(cloudpickle: Any, models: Sequence[torch.nn.Module]) -> None:
    """Have ``cloudpickle`` (the module: Ray's copy or the package) pickle by value the modules defining the models'
    classes that are the user's own code (not an installed package, nor the standard library, nor opsched): the
    other process may not import them (a script's module, a test file, a folder on this process's path only), and
    torchvision's or timm's it imports itself."""
    installed = {Path(p).resolve() for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib",
                                                                                     "purelib", "platlib")}
    for model in models:
        for name in {type(m).__module__ for m in model.modules()}:
            module = sys.modules.get(name)
            file = getattr(module, "__file__", None)
            if module is None or file is None or name == "__main__" or name.split(".")[0] == "opsched":
                continue
            where = Path(file).resolve()
            if not any(where.is_relative_to(root) for root in installed) and \
                    not {"site-packages", "dist-packages"} & set(where.parts):
                cloudpickle.register_pickle_by_value(module)
