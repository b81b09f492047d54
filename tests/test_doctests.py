"""Every docstring example in the package runs and shows what it says."""

import doctest
import importlib
import pkgutil

import pytest

import opsched

MODULES = sorted(m.name for m in pkgutil.walk_packages(opsched.__path__, "opsched."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert failures == 0
