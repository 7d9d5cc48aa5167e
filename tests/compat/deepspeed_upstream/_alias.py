"""Make ``import deepspeed`` / ``from deepspeed.x import y`` resolve to `tachyon.compat.deepspeed`
and ``unit.common`` / ``unit.simple_model`` / ``unit.util`` to this directory's stand-ins, so the
vendored DeepSpeed tests run with only their imports redirected (their files are unchanged).
``import hjson`` resolves to the stand-in ``_hjson`` (its ``dump``) when the hjson package is not
installed; an installed one is used as it is."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ALIASES = {"deepspeed": "tachyon.compat.deepspeed", "unit": "tests.compat.deepspeed_upstream.unit"}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        pass


class AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        head = fullname.split(".", 1)[0]
        if head not in ALIASES:
            return None
        real = ALIASES[head] + fullname[len(head):]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


def install() -> None:
    if "hjson" not in ALIASES and importlib.util.find_spec("hjson") is None:
        ALIASES["hjson"] = "tests.compat.deepspeed_upstream._hjson"
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
