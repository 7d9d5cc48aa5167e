"""DeepSpeed- and Transformer-Engine-shaped names over tachyon, so a script ports by changing its imports.

    import tachyon.compat.deepspeed as deepspeed                  # was: import deepspeed
    import tachyon.compat.transformer_engine.pytorch as te        # was: import transformer_engine.pytorch as te
    from tachyon.compat.transformer_engine.common.recipe import Format, DelayedScaling

Every name maps to tachyon's own object (``deepspeed.initialize is tachyon.initialize``,
``te.TransformerLayer is tachyon.nn.TransformerLayer``), resolved when first used; a few are thin
adapters where the foreign signature differs (DeepSpeed's FusedAdam/FusedLamb argument order,
Transformer Engine's ``checkpoint`` keywords, ``zero.Init`` / ``zero.GatheredParameters``, which
are no-ops below ZeRO-3 in DeepSpeed too, and ``add_config_arguments``).

Names of features tachyon does not have (yet) import fine and raise NotImplementedError naming the
feature and what to use instead when used. Features that other parts of tachyon will provide
(pipeline parallelism, the inference engine, the flops profiler, 1-bit optimizers) are looked up
in their tachyon modules each time, so they work here as soon as those modules exist. Names the
compat layer does not map at all raise AttributeError listing the ones it does.
docs/compat.md lists every mapped name.
"""

__all__ = ["deepspeed", "transformer_engine"]
