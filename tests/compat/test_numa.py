"""``deepspeed.utils.numa.parse_range_list``: DeepSpeed's core-list syntax."""

import pytest

from tachyon.compat.deepspeed.utils.numa import parse_range_list


def test_parse_range_list():
    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    assert parse_range_list("7") == [7] and parse_range_list("3-3") == [3]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "1-2-3", "a", "1, 2", ""):
        with pytest.raises(ValueError, match="Bad range"):
            parse_range_list(bad)
    import tachyon.compat.deepspeed.utils.numa as numa

    with pytest.raises(NotImplementedError, match="numactl"):
        numa.get_numactl_cmd(None, 1, 0)
