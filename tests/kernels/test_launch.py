"""The cached launch path (kernels/launch.py) and the launch stub (profiling/launch_stub.py).

Both need Triton's GPU launch path, which this process (Triton's interpreter) does not have: the
checks run in a subprocess without TRITON_INTERPRET, under `StubLaunches` (an sm_90 stand-in
driver; compilation and the driver launch are stubbed, every Python step of a launch runs).
"""

from __future__ import annotations

import json

import pytest
import torch

from tachyon.kernels.launch import FastKernel, fast_launch
from tests.utils.aot import run_without_interpreter

def _script_results(script: str) -> dict:
    """The JSON a script run without TRITON_INTERPRET prints on its ``RESULTS`` line."""
    out = run_without_interpreter(script)
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULTS ")).removeprefix("RESULTS "))


_CACHE_SCRIPT = r'''
import json
import torch
import triton
import triton.language as tl
from tachyon.kernels import launch
from tachyon.kernels.launch import FastKernel, fast_launch
from tachyon.profiling.launch_stub import StubLaunches


@fast_launch
@triton.jit
def _scale(X, Y, n, stride, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs * stride, tl.load(X + offs * stride, mask=offs < n) * alpha, mask=offs < n)


@fast_launch
@triton.autotune(configs=[triton.Config({"BLOCK": 32}, num_warps=1), triton.Config({"BLOCK": 64}, num_warps=2)],
                 key=["n"])
@triton.jit
def _tuned(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


assert isinstance(_scale, FastKernel) and isinstance(_tuned, FastKernel)
results = {}
plain_runs = []
original_run = _scale.jit.run


def counting_run(*args, **kwargs):
    plain_runs.append(1)
    return original_run(*args, **kwargs)


_scale.jit.run = counting_run


def scale(x, n=64, stride=1, block=64):
    y = torch.empty_like(x)
    _scale[(1,)](x, y, n, stride, 2.0, BLOCK=block)


def state(stub, name):
    return {"compiles": len(stub.compiles), "launches": len(stub.launches), "plain": len(plain_runs)}


with StubLaunches() as stub:
    x32 = torch.randn(256)
    scale(x32); results["first"] = state(stub, "first")
    scale(x32); results["same"] = state(stub, "same")
    scale(torch.randn(256)); results["other tensor, same specialization"] = state(stub, "")
    scale(x32.half()); results["fp16"] = state(stub, "")
    scale(x32[1:]); results["misaligned"] = state(stub, "")
    scale(x32, n=63); results["n not a multiple of 16"] = state(stub, "")
    scale(x32, n=1); results["n == 1"] = state(stub, "")
    scale(x32, stride=2); results["stride 2"] = state(stub, "")
    scale(x32, block=32); results["constexpr"] = state(stub, "")
    stub.device = 1
    scale(x32); results["device 1"] = state(stub, "")
    stub.device = 0
    scale(x32); results["device 0 again"] = state(stub, "")
    launch.set_fast_launch(False)
    scale(x32); results["fast path off"] = state(stub, "")
    launch.set_fast_launch(True)

    def tuned(n, dtype=torch.float32):
        x = torch.randn(128, dtype=dtype)
        before = len(stub.launches)
        config = _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, torch.empty_like(x), n)
        return {"launches": len(stub.launches) - before, "config": config.kwargs["BLOCK"],
                "best": _tuned.best_config.kwargs["BLOCK"], "grid": list(stub.launches[-1].grid)}

    results["tuned n=100"] = tuned(100)
    results["tuned n=100 again"] = tuned(100)
    results["tuned n=120"] = tuned(120)
    results["tuned n=100 third"] = tuned(100)
    results["tuned n=100 fp16"] = tuned(100, torch.float16)
    results["tuned n=100 fp16 again"] = tuned(100, torch.float16)
    results["tuned n=100 fp32 after fp16"] = tuned(100)
    results["cache sizes"] = [list(_scale.cache_sizes()), list(_tuned.cache_sizes())]
print("RESULTS", json.dumps(results))
'''


@pytest.fixture(scope="module")
def cache_results():
    return _script_results(_CACHE_SCRIPT)


def test_same_specialization_launches_without_recompiling_or_triton_run(cache_results):
    r = cache_results
    assert r["first"] == {"compiles": 1, "launches": 1, "plain": 1}
    # the second call and a call on another tensor of the same kind: the fast path, no JITFunction.run
    assert r["same"] == {"compiles": 1, "launches": 2, "plain": 1}
    assert r["other tensor, same specialization"] == {"compiles": 1, "launches": 3, "plain": 1}


@pytest.mark.parametrize("case", ["fp16", "misaligned", "n not a multiple of 16", "n == 1", "stride 2",
                                  "constexpr", "device 1"])
def test_a_changed_specialization_recompiles(cache_results, case):
    """Each case changes one thing Triton specializes on (dtype, 16-byte alignment, divisibility by
    16, the value 1, a constexpr, the device): one more compile, through JITFunction.run."""
    names = list(cache_results)
    prev = cache_results[names[names.index(case) - 1]]
    now = cache_results[case]
    assert now["compiles"] == prev["compiles"] + 1, (case, prev, now)
    assert now["plain"] == prev["plain"] + 1 and now["launches"] == prev["launches"] + 1


def test_back_on_a_seen_specialization_and_with_the_fast_path_off(cache_results):
    r = cache_results
    assert r["device 0 again"]["compiles"] == r["device 1"]["compiles"]
    assert r["device 0 again"]["plain"] == r["device 1"]["plain"]  # cached: fast path
    assert r["fast path off"]["plain"] == r["device 0 again"]["plain"] + 1
    assert r["fast path off"]["compiles"] == r["device 0 again"]["compiles"]
    assert r["cache sizes"][0] == [0, 8]  # 8 specializations seen (the fast-path-off call adds none)


def test_autotuning_runs_once_per_key_and_the_chosen_config_is_reused(cache_results):
    r = cache_results
    # first n=100: both configs benchmarked (one launch each under the stub) + the real launch
    assert r["tuned n=100"]["launches"] == 3
    assert r["tuned n=100"]["config"] == r["tuned n=100"]["best"] == 32  # equal stub timings: the first
    assert r["tuned n=100"]["grid"] == [4, 1, 1]  # cdiv(100, 32): the grid of the chosen config
    assert r["tuned n=100 again"]["launches"] == 1 and r["tuned n=100 again"]["grid"] == [4, 1, 1]
    assert r["tuned n=120"]["launches"] == 3  # a new key value: tuned again
    assert r["tuned n=100 third"]["launches"] == 1
    # the tensors' dtypes are part of the key (as in Autotuner.run): a new dtype tunes again
    assert r["tuned n=100 fp16"]["launches"] == 3 and r["tuned n=100 fp16 again"]["launches"] == 1
    assert r["tuned n=100 fp32 after fp16"]["launches"] == 1
    assert r["cache sizes"][1][0] == 3  # three autotuning keys: n=100, n=120, n=100 in fp16


_KEY_SCRIPT = r"""
import json
import random
import torch
import triton
import triton.language as tl
import triton.runtime.jit as triton_jit
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch
from tachyon.profiling import launch_stub
from tachyon.profiling.launch_stub import StubLaunches


@fast_launch
@triton.jit
def _spec(X, Y, a, b, c, eps, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs) * eps + a + b + c)


called = []
real_call = launch_stub._StubLauncher.__call__


def recording_call(self, *args):
    called.append(self)
    return real_call(self, *args)


launch_stub._StubLauncher.__call__ = recording_call
VALUES = [0, 1, 2, 7, 15, 16, 17, 32, 48, 1000, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**40 + 1,
          2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16, -1, -16, True, False]
results = {}
with StubLaunches() as stub:
    rng = random.Random(0)
    bases = {dt: torch.empty(64, dtype=dt) for dt in (torch.float32, torch.float16, torch.bfloat16)}
    binds = negative_trials = 0
    mismatches = []
    for trial in range(600):
        dt = rng.choice(list(bases))
        x = bases[dt][rng.randrange(8):]
        y = bases[rng.choice(list(bases))][rng.randrange(8):]
        a, b, c = (rng.choice(VALUES) for _ in range(3))
        negative_trials += min(a, b, c) < 0
        block = rng.choice((16, 32))
        kwargs = dict(BLOCK=block, num_warps=rng.choice((1, 2)))
        for again in range(2):  # the second time with the same arguments: an argument-key hit unless a < 0
            called.clear()
            _spec[(1,)](x, y, a, b, c, 0.5, **kwargs)
            if trial == 0 and again == 0:  # count the binder's calls from here on (JITFunction.run's too)
                compiled_before = len(stub.compiles)
                cache = _spec.jit.device_caches[0]
                real_binder = cache[4]

                def counting_binder(*args, **kw):
                    global binds
                    binds += 1
                    return real_binder(*args, **kw)

                _spec.jit.device_caches[0] = (*cache[:4], counting_binder, *cache[5:])
            _, spec, options = real_binder(x, y, a, b, c, 0.5, **kwargs)
            want = _spec._entries.get((0, *spec, *options.items()), (None,))[0]  # None: never compiled
            if called != [want]:
                mismatches.append([str(dt), x.data_ptr() % 16, y.data_ptr() % 16, a, b, c, block])
    results["rules hold"] = launch.argument_key_holds(_spec._active_backend())
    results["binder calls"] = binds - (len(stub.compiles) - compiled_before)  # without JITFunction.run's
    results["negative trials"] = negative_trials
    results["mismatches"] = mismatches[:5]
    results["mismatch count"] = len(mismatches)
    results["argument keys"] = _spec.argument_keys()
    # new integer values of a seen class (1056 and 1072: residue 0, 11 bits; 35 and 51: residue 3, 6 bits):
    # served by the class key, no binder call
    x = bases[torch.float32]
    _spec[(1,)](x, x, 32 + 1024, 35, 7, 0.5, BLOCK=16, num_warps=1)
    before = binds
    _spec[(1,)](x, x, 48 + 1024, 51, 7, 0.5, BLOCK=16, num_warps=1)
    results["binder calls for a seen class"] = binds - before
    results["specializations"] = _spec.cache_sizes()[1]

    # a specializer that also looks at divisibility by 32: the argument key no longer decides, so it is not used
    real_spec = triton_jit.native_specialize_impl

    def finer(backend, arg, is_const, specialize, align):
        out = real_spec(backend, arg, is_const, specialize, align)
        if type(arg) is int and arg % 32 == 0 and out[0] != "constexpr":
            return (out[0], "D32")
        return out

    triton_jit.native_specialize_impl = finer
    launch._KEY_CHECK = None
    results["finer rules hold"] = launch.argument_key_holds(_spec._active_backend())
    triton_jit.native_specialize_impl = real_spec
    launch._KEY_CHECK = False  # as a process whose Triton failed the check

    @fast_launch
    @triton.jit
    def _other(X, n, BLOCK: tl.constexpr):
        tl.store(X + tl.arange(0, BLOCK), n)

    x = torch.empty(64)
    for _ in range(3):
        _other[(1,)](x, 16, BLOCK=16)
    results["keys without the check"] = _other.argument_keys()
    results["launches without the check"] = len([l for l in stub.launches if l.name == "_other"])
print("RESULTS", json.dumps(results))
"""


@pytest.fixture(scope="module")
def key_results():
    return _script_results(_KEY_SCRIPT)


def test_the_argument_key_selects_the_kernel_tritons_binder_selects(key_results):
    """600 launches with random dtypes, pointer offsets, integers (0, 1, multiples of 16, around
    2**31, 2**63 and 2**64, negatives, bools) and constexprs: each runs exactly the compiled kernel
    of the specialization Triton's binder computes for its arguments."""
    r = key_results
    assert r["rules hold"] is True
    assert r["mismatch count"] == 0, r["mismatches"]
    # the key path was taken: every repeated call without a negative integer found its argument key
    # (the binder ran for the first calls and for the repeats with a negative integer only)
    assert r["argument keys"] > 100 and r["specializations"] > 10
    assert r["binder calls for a seen class"] == 0
    assert r["binder calls"] <= 600 + r["negative trials"]


def test_where_tritons_rules_differ_the_argument_key_is_not_used(key_results):
    r = key_results
    assert r["finer rules hold"] is False
    assert r["keys without the check"] == 0 and r["launches without the check"] == 3


def test_under_the_interpreter_fast_launch_takes_the_plain_path():
    import triton
    import triton.language as tl

    @triton.jit
    def _k(X, BLOCK: tl.constexpr):
        tl.store(X + tl.arange(0, BLOCK), tl.arange(0, BLOCK).to(tl.float32))

    wrapped = fast_launch(_k)  # an InterpretedFunction: nothing to cache, every launch is Triton's own
    assert isinstance(wrapped, FastKernel) and wrapped.kernel is _k and wrapped.jit is None
    x = torch.zeros(4)
    assert wrapped[(1,)](x, BLOCK=4) is None  # no autotuner: no config
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert wrapped.cache_sizes() == (0, 0)


_LAYER_SCRIPT = r'''
import json
import torch
import tachyon.nn as tnn
from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
from tachyon.profiling.launch_stub import StubLaunches

torch.manual_seed(0)
with StubLaunches() as stub:
    out = {}
    for pre_ln in (True, False):
        config = TransformerKernelConfig(batch_size=2, max_seq_length=8, hidden_size=32, intermediate_size=64, heads=2,
                                         attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2,
                                         initializer_range=0.02, seed=1, pre_layer_norm=pre_ln)
        layer = TransformerKernelLayer(config)
        x = torch.randn(2, 8, 32, requires_grad=True)
        mask = torch.ones(2, 8)
        mask[1, 5:] = 0
        layer(x, mask).sum().backward()  # the first call autotunes (extra launches)
        stub.clear()
        layer(x, mask).sum().backward()
        out["bert pre-LN" if pre_ln else "bert post-LN"] = stub.names
    te = tnn.TransformerLayer(32, 64, 2, hidden_dropout=0.1, attention_dropout=0.1)
    xs = torch.randn(8, 2, 32, requires_grad=True)
    te(xs).sum().backward()
    stub.clear()
    te(xs).sum().backward()
    out["te"] = stub.names

    # FP8 casts: a Linear's forward and backward under each recipe, twice (the first compiles)
    import tachyon
    from tachyon.kernels.fp8_block_cast import triton as block_cast
    from tachyon.kernels.fp8_cast import triton as cast
    from tachyon.kernels.launch import FastKernel

    fp8_kernels = {"cast_flat": cast._cast_flat_kernel, "cast_transpose": cast._cast_transpose_kernel,
                   "block_cast": block_cast._block_cast_kernel, "scale_from_amax": block_cast._scale_from_amax_kernel}
    out["fp8 fast kernels"] = sorted(name for name, k in fp8_kernels.items() if isinstance(k, FastKernel))
    plain = []
    for k in fp8_kernels.values():
        if isinstance(k, FastKernel):
            k.jit.run = (lambda run: lambda *a, **kw: (plain.append(1), run(*a, **kw))[1])(k.jit.run)
    for name in ("delayed", "current", "block"):
        recipe = FP8_RECIPES[name]()
        linear = tnn.Linear(32, 32, params_dtype=torch.bfloat16)
        x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2):
            stub.clear()
            plain.clear()
            with tachyon.autocast(recipe=recipe):
                y = linear(x)
            y.float().sum().backward()
        out[f"fp8 {name}"] = stub.names
        out[f"fp8 {name} plain runs"] = len(plain)
print("RESULTS", json.dumps(out))
'''

_FP8_RECIPES = '''
from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
FP8_RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}
'''
_LAYER_SCRIPT = _LAYER_SCRIPT.replace("from tachyon.profiling.launch_stub import StubLaunches\n",
                                      "from tachyon.profiling.launch_stub import StubLaunches\n" + _FP8_RECIPES, 1)


@pytest.fixture(scope="module")
def stubbed_launches():
    return _script_results(_LAYER_SCRIPT)


def _interpreted_launches(fn) -> list[str]:
    """Names of the Triton kernels ``fn`` launches under the interpreter, in order."""
    from triton.runtime.interpreter import GridExecutor

    names: list[str] = []
    original = GridExecutor.__call__

    def record(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    GridExecutor.__call__ = record
    try:
        fn()
    finally:
        GridExecutor.__call__ = original
    return names


def test_the_stub_sees_every_launch_a_layer_makes(stubbed_launches):
    """The stubbed GPU path of the BERT kernel layer (pre- and post-LN) and of TransformerLayer
    launches exactly the kernels, in the same order, that the same layers launch under Triton's
    interpreter (which runs them): nothing the layers launch escapes the stub's count."""
    import tachyon
    import tachyon.nn as tnn
    from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer

    stubbed = stubbed_launches
    interpreted = {}
    with tachyon.use_backend("triton"):
        for pre_ln in (True, False):
            config = TransformerKernelConfig(batch_size=2, max_seq_length=8, hidden_size=32, intermediate_size=64,
                                             heads=2, attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1,
                                             num_hidden_layers=2, initializer_range=0.02, seed=1, pre_layer_norm=pre_ln)
            layer = TransformerKernelLayer(config)
            x = torch.randn(2, 8, 32, requires_grad=True)
            mask = torch.ones(2, 8)
            mask[1, 5:] = 0
            interpreted["bert pre-LN" if pre_ln else "bert post-LN"] = _interpreted_launches(
                lambda layer=layer, x=x, mask=mask: layer(x, mask).sum().backward())
        te = tnn.TransformerLayer(32, 64, 2, hidden_dropout=0.1, attention_dropout=0.1)
        xs = torch.randn(8, 2, 32, requires_grad=True)
        interpreted["te"] = _interpreted_launches(lambda: te(xs).sum().backward())
    for name in interpreted:
        assert len(interpreted[name]) >= 10, (name, interpreted[name])
        assert stubbed[name] == interpreted[name], (name, stubbed[name], interpreted[name])


def test_fp8_cast_kernels_launch_through_the_cached_path(stubbed_launches):
    """The FP8 cast kernels (per-tensor cast, cast + transpose, block cast, scale from amax) are
    FastKernels: a tachyon.nn.Linear's second forward + backward under each recipe launches them
    without Triton's own run, and the stub sees the same launches as the interpreter runs."""
    import tachyon
    import tachyon.nn as tnn
    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

    stubbed = stubbed_launches
    assert stubbed["fp8 fast kernels"] == ["block_cast", "cast_flat", "cast_transpose", "scale_from_amax"]
    recipes = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}
    with tachyon.use_backend("triton"):
        for name, cls in recipes.items():
            linear = tnn.Linear(32, 32, params_dtype=torch.bfloat16)
            x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
            recipe = cls()

            def step(linear=linear, x=x, recipe=recipe):
                with tachyon.autocast(recipe=recipe):
                    y = linear(x)
                y.float().sum().backward()

            step()
            interpreted = _interpreted_launches(step)
            assert stubbed[f"fp8 {name}"] == interpreted, (name, stubbed[f"fp8 {name}"], interpreted)
            assert stubbed[f"fp8 {name} plain runs"] == 0, name
    assert any(n == "_block_cast_kernel" for n in stubbed["fp8 block"])
    assert "_scale_from_amax_kernel" in stubbed["fp8 current"]
