"""Run a function right after a module finishes importing, without importing it now.

``import fastpar`` must not import torch (the ``fastpar`` command answers at once), yet
``dist.init_process_group("fastpar")`` must work in any program that imported fastpar, whichever of
fastpar and torch it imported first. So the backend is registered now when torch is already loaded, and
otherwise the moment torch's own import completes (an import hook that removes itself once used).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# The finder and loader below follow importlib's protocols without subclassing importlib.abc: importing that
# module alone costs more than the rest of ``import fastpar``.


class _CallAfterLoad:
    """Wraps the module's real loader: executes the module, then calls ``callback``."""

    def __init__(self, loader: Any, callback: Callable[[], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # the module sees its own loader afterwards
        self._callback()

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


class _Finder:
    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # once: the real finders answer from here on
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallAfterLoad(spec.loader, self.callback)
        return spec


def call_after_import(module: str, callback: Callable[[], None]) -> None:
    """``callback()`` now if top-level ``module`` is imported already, else right after its import completes."""
    if module in sys.modules:
        callback()
    elif not any(isinstance(f, _Finder) and f.name == module for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(module, callback))
