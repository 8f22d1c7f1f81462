"""Lazy public names of a package (PEP 562), so importing one module of a stage, a parser or the
edge SDK, does not import the whole stage (its Kafka client, HTTP client, DuckDB)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """Return a module ``__getattr__`` for ``package`` that imports each public name of
    ``exports`` (name → defining module) on first use.

    The returned function raises ``AttributeError`` for a name not in ``exports``, as Python
    expects of a module ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
