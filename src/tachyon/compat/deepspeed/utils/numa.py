"""``deepspeed.utils.numa``: DeepSpeed's core-list syntax (its launcher's ``--bind_core_list``).

``parse_range_list("0,2-4,6") == [0, 2, 3, 4, 6]``: comma-separated numbers or inclusive
``a-b`` ranges, ascending, not overlapping, no spaces; anything else is a ValueError. tachyon's
launcher (``tachyon run``, torchrun underneath) does not bind ranks to cores: ``numactl``
command building (``get_numactl_cmd``) is not provided.
"""

from __future__ import annotations

from tachyon.compat._names import module_getattr, unsupported


def parse_range(rng: str) -> range:
    """``"5"`` -> range(5, 6); ``"2-4"`` -> range(2, 5)."""
    if rng.isdigit():
        return range(int(rng), int(rng) + 1)
    parts = rng.split("-")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        raise ValueError(f"Bad range: {rng!r}, a range is a number or two numbers separated by a dash")
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        raise ValueError(f"Bad range: {rng!r}, the end must be larger than or equal to the start")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """The numbers of a comma-separated list of numbers and ranges (ascending, not overlapping)."""
    numbers: list[int] = []
    for sub in range_str.split(","):
        values = parse_range(sub)
        if numbers and values[0] <= numbers[-1]:
            raise ValueError(f"Bad range: {range_str!r}, sub ranges must not overlap and must be in ascending order")
        numbers.extend(values)
    return numbers


_TABLE = {
    "get_numactl_cmd": unsupported("binding ranks to cores with numactl is not done by tachyon's launcher; run "
                                   "`numactl` around the command yourself"),
}
__getattr__ = module_getattr(__name__, "deepspeed.utils.numa", _TABLE, lambda: ["parse_range", "parse_range_list"])
__all__ = ["parse_range", "parse_range_list"]
