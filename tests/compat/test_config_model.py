"""``deepspeed.runtime.config_utils.DeepSpeedConfigModel``: DeepSpeed's deprecated-field handling
(moved values, nested targets, conflicts refused before anything changes), "auto" placeholders,
strict extra fields."""

from __future__ import annotations

import logging

import pydantic
import pytest
from pydantic import Field

from tachyon.compat.deepspeed.runtime.config_utils import DeepSpeedConfigModel, get_config_default


class Inner(DeepSpeedConfigModel):
    size: int = 1


class Conf(DeepSpeedConfigModel):
    inner: Inner = Inner()
    old_size: int | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "inner.size",
                                                          "new_param_fn": lambda x: 2 * x})
    legacy: bool = Field(False, json_schema_extra={"deprecated": True, "deprecated_msg": "it does nothing"})
    kept: int | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "count",
                                                      "set_new_param": False})
    count: int = 3
    name: str = "x"


def test_deprecated_fields_move_warn_and_conflict(caplog):
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        conf = Conf(old_size=5, legacy=True, kept=7)
    assert conf.inner.size == 10 and conf.count == 3 and conf.legacy is True
    assert "old_size is deprecated use inner.size instead" in caplog.text and "it does nothing" in caplog.text
    with pytest.raises(ValueError, match="'old_size' and replacing parameter 'inner.size'") as error:
        Conf(old_size=5, inner={"size": 2})
    assert isinstance(error.value, AssertionError)  # what DeepSpeed's assert raises
    assert Conf().inner.size == 1 and "old_size" not in Conf().model_fields_set


def test_auto_values_take_defaults_unless_strict_and_extras_are_refused():
    assert Conf(name="auto", count="auto").count == 3 and Conf(name="auto").name == "x"
    assert Conf(strict=True, name="auto").name == "auto"
    with pytest.raises(pydantic.ValidationError):
        Conf(typo=1)
    with pytest.raises(pydantic.ValidationError):
        Conf().count = "many"  # assignments are validated
    assert get_config_default(Conf, "count") == 3
    with pytest.raises(ValueError, match="not a field"):
        get_config_default(Conf, "nope")
