"""``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the pydantic base class of
DeepSpeed's config sections, for code that defines its own sections on it.

    class MyConf(DeepSpeedConfigModel):
        new: list[str] | None = None
        old: str | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                         "new_param_fn": lambda x: [x]})

    MyConf(old="a").new == ["a"]          # a warning names the deprecated field

As DeepSpeed's: unknown fields are refused (``extra="forbid"``), aliases and field names are both
accepted, assignments are validated, and enums are stored as their values. A field marked
``deprecated`` in ``json_schema_extra`` logs a warning when given; with ``new_param`` (a dotted
path for a nested section) its value, through ``new_param_fn``, moves to that field unless
``set_new_param`` is False. Giving both the deprecated field and its replacement raises
`DeprecatedFieldConflict` (a ValueError, and an AssertionError as DeepSpeed's assert raises).
``strict=False`` (the default) drops keys whose value is ``"auto"`` (Hugging Face's placeholder)
so they take their defaults, except ``replace_method``.

tachyon's own config sections (`tachyon.config`) are separate pydantic models; this class is the
API DeepSpeed users subclass, not what ``initialize`` reads.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_serializer

logger = logging.getLogger("DeepSpeed")


class DeprecatedFieldConflict(ValueError, AssertionError):
    """A deprecated config field and the field replacing it were both given."""


class DeepSpeedConfigModel(BaseModel):
    """pydantic base for config sections with DeepSpeed's deprecated-field handling (module docstring)."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # Hugging Face writes "auto" for values it fills in later
            data = {key: value for key, value in data.items() if key == "replace_method" or
                    not (isinstance(value, str) and value == "auto")}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False):
                self._apply_deprecated(name, extra)

    def _apply_deprecated(self, name: str, extra: dict) -> None:
        if name not in self.model_fields_set:
            return
        new = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {name} is deprecated" + (f" use {new} instead" if new else "")
                       + (f". {note}" if note else ""))
        if not new or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, name))
        *parents, leaf = new.split(".")
        target = functools.reduce(getattr, parents, self)
        if leaf in target.model_fields_set:
            raise DeprecatedFieldConflict(f"Cannot provide deprecated parameter '{name}' and replacing parameter "
                                          f"'{new}' together")
        delattr(self, name)
        setattr(target, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def serialize_torch_dtype(dtype: torch.dtype) -> str:
        return str(dtype)


def get_config_default(config: type[BaseModel], field_name: str) -> Any:
    """The default of ``field_name`` in the config model ``config`` (ValueError when the field
    does not exist or is required)."""
    field = config.model_fields.get(field_name)
    if field is None:
        raise ValueError(f"'{field_name}' is not a field in {config.__name__}")
    if field.is_required():
        raise ValueError(f"'{field_name}' is a required field and does not have a default value")
    return field.get_default()


__all__ = ["DeepSpeedConfigModel", "DeprecatedFieldConflict", "get_config_default"]
