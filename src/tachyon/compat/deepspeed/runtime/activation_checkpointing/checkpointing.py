"""``deepspeed.runtime.activation_checkpointing.checkpointing`` (= ``deepspeed.checkpointing``):
tachyon's activation checkpointing module, `tachyon.engine.activation_checkpointing`.

Its public functions are re-exported here as the same objects (``checkpoint``,
``checkpoint_sequential``, ``configure``, ``is_configured``, ``reset``, ...), so settings made
through either name are the same settings. See docs/activation_checkpointing.md.
"""

from __future__ import annotations

from tachyon.engine import activation_checkpointing as _tachyon

_PUBLIC = [name for name in dir(_tachyon) if not name.startswith("_")
           and callable(getattr(_tachyon, name)) and getattr(getattr(_tachyon, name), "__module__", "") == _tachyon.__name__]
globals().update({name: getattr(_tachyon, name) for name in _PUBLIC})


def __getattr__(name: str):
    try:
        return getattr(_tachyon, name)
    except AttributeError:
        raise AttributeError(f"deepspeed.checkpointing.{name} is not mapped by tachyon; it maps: "
                             f"{', '.join(sorted(_PUBLIC))}") from None


__all__ = sorted(_PUBLIC)
