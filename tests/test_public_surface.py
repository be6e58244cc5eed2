"""The public surface's polish (issue 33): every public callable says why it exists, the version is
pyproject's, and the package ships its type hints (PEP 561)."""
from __future__ import annotations

import re
import typing
from pathlib import Path

import globaltensor as gt

ROOT = Path(__file__).resolve().parent.parent


def test_every_public_callable_has_a_docstring():
    aliases = {n for n in gt.__all__ if typing.get_origin(getattr(gt, n)) is not None}  # SBP, SbpLike, PlanLike
    assert {"SBP", "SbpLike", "PlanLike"} <= aliases
    missing = [n for n in gt.__all__ if n not in aliases and callable(getattr(gt, n))
               and not (getattr(gt, n).__doc__ or "").strip()]
    assert missing == []


def test_factories_are_named_for_help():
    for name in ("randn", "rand", "zeros", "ones", "empty"):
        assert getattr(gt, name).__name__ == name


def test_version_is_pyprojects():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert gt.__version__ == version
    init = (ROOT / "globaltensor" / "__init__.py").read_text()
    assert f'__version__ = "{version}"' in init, "the fallback for an uninstalled tree is pyproject's version"


def test_py_typed_ships():
    assert (ROOT / "globaltensor" / "py.typed").is_file()
    assert re.search(r'^\[tool\.setuptools\.package-data\]\nglobaltensor = \["py\.typed"\]',
                     (ROOT / "pyproject.toml").read_text(), re.M)
