"""How the compatibility modules hand out names: tachyon's own objects, resolved when first used.

Each compat module keeps a table ``{foreign name: Target}``. A `Target` lists where tachyon has
(or will have) the object, as (module, attribute) candidates tried in order; the first that
exists is returned *itself* (no wrapper, no copy), so ``compat.deepspeed.initialize is
tachyon.initialize``. A candidate counts as absent only when its own module does not exist
(``ModuleNotFoundError`` for that very module) or lacks the attribute; an import that fails for
any other reason propagates, so a broken tachyon module is never mistaken for a missing feature.

Names with no candidate present resolve to an `Unsupported` placeholder: importing it works (a
script may import names it only uses on some paths), and any use -- calling it, entering it as a
context manager, subclassing it, ``isinstance`` against it, reading an attribute -- raises
NotImplementedError naming the feature and what to use instead. Nothing is cached, so a feature
that lands later (e.g. ``tachyon.inference``) is picked up without touching the compat layer.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
from collections.abc import Callable
from typing import Any


class Unsupported:
    """Stands for a foreign name tachyon does not implement (yet). Any use raises
    NotImplementedError with ``message``."""

    def __init__(self, qualname: str, message: str):
        self.__qualname = qualname
        self.__message = f"{qualname}: {message}"

    def _refuse(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(self.__message)

    __call__ = _refuse
    __enter__ = _refuse
    __iter__ = _refuse
    __instancecheck__ = _refuse  # isinstance(x, placeholder) names the feature too
    __subclasscheck__ = _refuse

    def __exit__(self, *exc: Any) -> None:
        self._refuse()

    def __mro_entries__(self, bases: tuple) -> tuple:
        self._refuse()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # copy, pickle, inspect probing dunders
        self._refuse()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<not supported by tachyon: {self.__message}>"


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a foreign name lives in tachyon: ``candidates`` as (module, attribute) pairs, tried
    in order (attribute None: the module itself); ``missing`` is the message used when none
    exists (what the feature is and what to use instead)."""

    candidates: tuple[tuple[str, str | None], ...]
    missing: str = ""


def unsupported(message: str) -> Target:
    """A name tachyon does not provide at all: always the placeholder."""
    return Target((), message)


def _absent(exc: ModuleNotFoundError, module: str) -> bool:
    """True when ``exc`` says that ``module`` itself (or a package above it) does not exist."""
    name = exc.name or ""
    return bool(name) and (module == name or module.startswith(name + "."))


def resolve(qualname: str, target: Target) -> Any:
    """The first candidate of ``target`` that exists, else an `Unsupported` placeholder."""
    for module_name, attribute in target.candidates:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if _absent(exc, module_name):
                continue
            raise
        if attribute is None:
            return module
        try:
            value = getattr(module, attribute)
        except ModuleNotFoundError as exc:
            # a package's lazy attribute whose submodule is not there (yet); tables list the
            # submodule itself as an earlier candidate, so a broken submodule already raised there
            if (exc.name or "").startswith(module_name + "."):
                continue
            raise
        except AttributeError:
            continue
        if isinstance(value, types.ModuleType):
            continue  # a submodule of the same name shadowing a package's lazy attribute
        return value
    message = target.missing or "not implemented by tachyon"
    return Unsupported(qualname, message)


def module_getattr(module_name: str, foreign: str, table: dict[str, Target],
                   extra: Callable[[], list[str]] = list, *, submodules: tuple[str, ...] = ()) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``table`` and importing the package's ``submodules`` when
    first read; an unknown name is an AttributeError listing the names this compat module maps
    (``extra()`` and the submodules included; with a did-you-mean)."""

    def __getattr__(name: str) -> Any:
        if name in submodules:
            return importlib.import_module(f"{module_name}.{name}")
        if name in table:
            return resolve(f"{foreign}.{name}", table[name])
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        known = sorted({*table, *extra(), *submodules})
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AttributeError(
            f"{foreign}.{name} is not one of the names tachyon maps ({module_name}); it maps: "
            f"{', '.join(known)}.{hint}"
        )

    return __getattr__


__all__ = ["Target", "Unsupported", "module_getattr", "resolve", "unsupported"]
