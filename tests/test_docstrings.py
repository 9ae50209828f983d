"""Every docstring example in keras_avae runs and gives the output it shows.

Also lists the public classes and functions whose docstrings have no
example yet; the list may only shrink (`MISSING_EXAMPLES` is the measured
state, and a new public name without an example fails the test).
"""

import doctest
import importlib
import inspect
import pkgutil

import numpy as np
import pytest

import keras_avae

MODULES = sorted(name for _, name, _ in pkgutil.walk_packages(keras_avae.__path__, "keras_avae."))


def public_members(module):
    for name, member in vars(module).items():
        if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(member) or inspect.isfunction(member):
            yield f"{module.__name__}.{name}", member


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, module_name, globs={"np": np, **vars(module)}):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} failing docstring example(s) in {module_name}"


def test_public_names_have_examples():
    missing = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for qualified, member in public_members(module):
            if ">>>" not in (inspect.getdoc(member) or ""):
                missing.append(qualified)
    new = sorted(set(missing) - MISSING_EXAMPLES)
    assert not new, f"public names without a docstring example: {new}"


# Examples still to write (none as of 2026-11-23): keep it that way.
MISSING_EXAMPLES = set()
