"""``deepspeed.add_config_arguments``: the command-line arguments DeepSpeed adds to a script's parser.

DeepSpeed adds one argument group with ``--deepspeed`` (a flag for the user's own code),
``--deepspeed_config PATH`` (read by ``initialize(args=args)``) and the deprecated
``--deepscale`` / ``--deepscale_config``. tachyon's ``initialize`` reads ``args.deepspeed_config``;
``--deepscale_config`` (deprecated since DeepSpeed 0.3) is accepted on the command line and copied
to ``deepspeed_config`` when that is not given, so old scripts keep working.
"""

from __future__ import annotations

import argparse


class _DeprecatedConfig(argparse.Action):
    """``--deepscale_config PATH``: stored under its own name and, unless --deepspeed_config is
    given too, as deepspeed_config."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        if getattr(namespace, "deepspeed_config", None) is None:
            namespace.deepspeed_config = values


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's configuration arguments to ``parser`` and return it (DeepSpeed's signature)."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_config_arguments needs an argparse.ArgumentParser; got {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepscale_config", default=None, type=str, action=_DeprecatedConfig,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser


__all__ = ["add_config_arguments"]
