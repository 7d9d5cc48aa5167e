"""Strict scalar types shared by the config models.

Models are strict: ``"stage": "2"``, ``"enabled": 1`` and ``"train_batch_size": 32.0`` are errors,
not silently coerced. Two deliberate exceptions: an int is accepted where a float is expected
(``"lr": 1``), and bucket sizes accept integral floats because DeepSpeed configs write them as
``5e8`` (which JSON parses as a float).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    """Base of every config model: strict types, no extra keys, no NaN/inf."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True
    )


def problem(message: str) -> PydanticCustomError:
    """An error raised inside a validator whose text is shown to the user as-is."""
    return PydanticCustomError("tachyon", "{message}", {"message": message})


def _one_of(*allowed: Any):
    names = ", ".join(map(str, allowed[:-1])) + f" or {allowed[-1]}"

    def check(value: Any) -> Any:
        if value not in allowed:
            raise PydanticCustomError("one_of", "should be {names}", {"names": names})
        return value

    return check


def _integral_float(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "bfloat": "bf16", "torch.bfloat16": "bf16",
}  # fmt: skip


def _canonical_dtype(value: Any) -> Any:
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.lower(), value)
    return value


PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
UnitFloat = Annotated[float, Field(ge=0, le=1)]
"""A float in [0, 1] (ratios, momentum)."""
BucketSize = Annotated[int, BeforeValidator(_integral_float), Field(gt=0)]
"""Number of elements; accepts ``5e8``."""
ZeroStage = Annotated[int, AfterValidator(_one_of(0, 1, 2, 3))]
DType = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_canonical_dtype)]
"""``"fp32" | "fp16" | "bf16"``; DeepSpeed's other spellings (``"bfloat16"``, ...) map here."""
WarmupType = Literal["log", "linear"]
