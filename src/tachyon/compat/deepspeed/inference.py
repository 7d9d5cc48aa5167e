"""``deepspeed.init_inference`` on tachyon's inference engine (`tachyon.init_inference`), resolved
when called, so it works as soon as tachyon.inference exists (until then: NotImplementedError).

One DeepSpeed form needs translating: the legacy ``injection_policy={LayerClass: PolicyClass}``,
whose values are policy classes (``module_inject.replace_policy.HFGPT2LayerPolicy``, ...) and which
asks for kernel injection with that policy. tachyon chooses the injection policy from the model's
class, and its ``injection_policy`` means tensor slicing alone ({LayerClass: ('attn.out_proj', ...)},
DeepSpeed's newer form, passed through unchanged). So a dict of policy classes becomes
``replace_with_kernel_inject=True`` after checking that the policy tachyon picks for the model is
the one named; a mismatch is a ValueError naming both.
"""

from __future__ import annotations

from typing import Any


def _legacy_policies(policy: Any, base: type) -> list[type] | None:
    """The policy classes of a legacy ``{LayerClass: PolicyClass}`` dict, else None."""
    if not isinstance(policy, dict) or not policy:
        return None
    values = list(policy.values())
    if all(isinstance(v, type) and issubclass(v, base) for v in values):
        return values
    return None


def init_inference(model: Any, config: Any = None, **kwargs: Any) -> Any:
    """DeepSpeed's ``init_inference(model, config=None, **kwargs)`` -> tachyon's InferenceEngine."""
    from tachyon.compat._names import Unsupported, resolve
    from tachyon.compat.deepspeed import inference_target

    real = resolve("deepspeed.init_inference", inference_target("init_inference"))
    if isinstance(real, Unsupported):
        return real(model, config, **kwargs)  # raises NotImplementedError naming the missing engine
    policy = kwargs.get("injection_policy")
    if policy is not None:
        from tachyon.inference.policies import policy_for
        from tachyon.inference.policies.base import Policy

        legacy = _legacy_policies(policy, Policy)
        if legacy is not None:
            chosen = type(policy_for(model))
            named = {cls.__name__ for cls in legacy}
            if any(not issubclass(chosen, cls) for cls in legacy):
                raise ValueError(f"init_inference: injection_policy names {sorted(named)}, but tachyon injects "
                                 f"{type(model).__name__} with {chosen.__name__} (the policy follows the model's "
                                 "class); drop injection_policy")
            if kwargs.get("replace_with_kernel_inject") is False:
                raise ValueError("init_inference: injection_policy with policy classes asks for kernel injection, "
                                 "but replace_with_kernel_inject=False")
            kwargs = {k: v for k, v in kwargs.items() if k != "injection_policy"}
            kwargs["replace_with_kernel_inject"] = True
    return real(model, config, **kwargs)


__all__ = ["init_inference"]
