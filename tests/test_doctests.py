"""Every docstring example in the package runs and shows what it says."""

import doctest
import importlib
import pkgutil

import pytest

import opsched

MODULES = sorted(m.name for m in pkgutil.walk_packages(opsched.__path__, "opsched."))
# packages whose modules or examples need an optional extra (pyproject's serve): skipped without it, as their tests are
NEEDS = {"opsched.serving": ("starlette", "uvicorn")}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    for package, extras in NEEDS.items():
        if name == package or name.startswith(package + "."):
            for extra in extras:
                pytest.importorskip(extra)
    module = importlib.import_module(name)
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0
