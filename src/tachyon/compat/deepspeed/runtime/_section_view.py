"""DeepSpeed's config section classes (``DeepSpeedZeroConfig``, ``DeepSpeedBF16Config``, ...) as
views over tachyon's section models.

A view is built from the section's keys as DeepSpeed's class is (``DeepSpeedZeroConfig(stage=2,
reduce_bucket_size=5e8)``). The keys go through `tachyon.config.parse_config` as that section of a
config, so a view accepts exactly what ``tachyon.initialize`` accepts: a feature tachyon does not
have is refused by name, an unknown key gets a did-you-mean, all as `ConfigError` (a ValueError).
Every field of DeepSpeed's class is then an attribute with DeepSpeed's value: the tachyon model's
where tachyon reads the key, else the value given (a key tachyon accepts and ignores) or
DeepSpeed's default. DeepSpeed's aliases (``stage3_max_live_parameters`` for
``max_live_parameters``) and deprecated fields (their value moves to the replacing field; giving
both raises `DeprecatedFieldConflict`) work as in DeepSpeed. Assigning an attribute re-validates
the whole section and leaves the view unchanged when refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from tachyon.compat.deepspeed.runtime.config_utils import DeprecatedFieldConflict
from tachyon.config import ConfigError, parse_config
from tachyon.config.errors import render

logger = logging.getLogger("DeepSpeed")

@dataclasses.dataclass(frozen=True)
class DSField:
    """One field of a DeepSpeed section class.

    default: DeepSpeed's default (a callable is called for each view).
    alias: DeepSpeed's other key for the field (``stage3_...``).
    tachyon: the attribute of tachyon's section model holding the value, when tachyon reads it.
    replaces: for a deprecated field, the field its value moves to, and how it is converted.
    deprecated: for a deprecated field whose value moves nowhere, what to use instead.
    """

    default: Any = None
    alias: str | None = None
    tachyon: str | None = None
    replaces: str | None = None
    convert: Callable[[Any], Any] = lambda value: value
    deprecated: str | None = None


class SectionView:
    """Base of the DeepSpeed section classes (module docstring)."""

    SECTION: ClassVar[str]
    """The section's key in a DeepSpeed config (``"zero_optimization"``)."""
    FIELDS: ClassVar[dict[str, DSField]]

    def __init__(self, **data: Any) -> None:
        self._load(data)

    # -- building -------------------------------------------------------------------------
    def _canonical(self, data: dict[str, Any]) -> dict[str, Any]:
        """The given keys by DeepSpeed field name; both spellings of one field is an error."""
        by_alias = {spec.alias: name for name, spec in self.FIELDS.items() if spec.alias}
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = by_alias.get(key, key)
            if name in out:
                raise ConfigError(f"`{self.SECTION}.{key}` and `{self.SECTION}.{name}` name the same setting; keep one")
            out[name] = value
        return out

    def _load(self, data: dict[str, Any]) -> None:
        given = self._canonical(data)
        for name, spec in self.FIELDS.items():
            if spec.replaces and name in given and spec.replaces in given:
                raise DeprecatedFieldConflict(
                    f"Cannot provide deprecated parameter '{name}' and replacing parameter '{spec.replaces}' together")
        for name in given:
            spec = self.FIELDS.get(name)
            if spec is not None and (spec.replaces or spec.deprecated):
                logger.warning(f"Config parameter {name} is deprecated use {spec.replaces or spec.deprecated} instead")
        parsed = parse_config({self.SECTION: dict(data)})
        section = getattr(parsed, self.SECTION)
        ignored = {path.split(".", 1)[1] for path in parsed.ignored_keys if path.startswith(f"{self.SECTION}.")}
        values: dict[str, Any] = {}
        for name, spec in self.FIELDS.items():
            if spec.tachyon is not None and name in given and ({name, spec.alias} & ignored):
                values[name] = given[name]  # validated, then set aside by tachyon in this combination
            elif spec.tachyon is not None:
                values[name] = getattr(section, spec.tachyon)
            elif name in given:
                values[name] = self._check_type(name, given[name], spec)
            else:
                values[name] = spec.default() if callable(spec.default) else spec.default
        for name, spec in self.FIELDS.items():
            if spec.replaces and given.get(name) is not None and self.FIELDS[spec.replaces].tachyon is None:
                values[spec.replaces] = spec.convert(given[name])
        self._resolve(values, given)
        object.__setattr__(self, "_given", dict(data))
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "tachyon_config", section)

    def _resolve(self, values: dict[str, Any], given: dict[str, Any]) -> None:
        """Fill in values DeepSpeed derives from others (subclasses)."""

    def _check_type(self, name: str, value: Any, spec: DSField) -> Any:
        """A key tachyon ignores still gets DeepSpeed's type check (bool / int fields)."""
        default = spec.default
        if isinstance(default, bool) or (default is None and spec.replaces and
                                          isinstance(self.FIELDS[spec.replaces].default, bool)):
            ok = isinstance(value, bool) or (value is None and default is None)
        elif isinstance(default, int):
            ok = not isinstance(value, bool) and (isinstance(value, int) or
                                                  isinstance(value, float) and value.is_integer())
            value = int(value) if ok else value
        else:
            ok = True
        if not ok:
            kind = "true or false" if isinstance(default, bool) or default is None else "an integer"
            raise ConfigError(f"`{self.SECTION}.{name}` should be {kind}; got {render(value)}")
        return value

    # -- DeepSpeed's model surface --------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        by_alias = {spec.alias: field for field, spec in self.FIELDS.items() if spec.alias}
        if name in by_alias:
            return values[by_alias[name]]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}; its fields: {', '.join(self.FIELDS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        by_alias = {spec.alias: field for field, spec in self.FIELDS.items() if spec.alias}
        field = by_alias.get(name, name)
        if field not in self.FIELDS:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}; its fields: {', '.join(self.FIELDS)}")
        data = {key: item for key, item in self._given.items() if by_alias.get(key, key) != field}
        data[field] = value
        self._load(data)  # validates everything first: a refused value leaves the view as it was

    def model_dump(self) -> dict[str, Any]:
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values == self._values

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


def section_dict(param_dict: dict[str, Any], key: str, old_key: str | None = None) -> dict[str, Any]:
    """``param_dict[key]`` (or its older name), DeepSpeed's ``{}`` when absent."""
    value = param_dict.get(key)
    if value is None and old_key is not None:
        value = param_dict.get(old_key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"`{key}` should be a JSON object (a section of keys); got {render(value)}")
    return value


__all__ = ["DSField", "SectionView", "section_dict"]
