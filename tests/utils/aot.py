"""Ahead-of-time compilation of Triton kernels for a GPU target on a machine without a GPU.

Under TRITON_INTERPRET=1 (set by tests/conftest.py when there is no GPU) ``@triton.jit`` returns
an interpreted function and Triton's compiler never runs, so a kernel that the interpreter accepts
but the compiler rejects (type errors, unsupported ops, bad constexpr use) would go unnoticed
until a GPU session. Triton can still compile for a target it cannot run on:
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))``
lowers TTIR -> TTGIR -> LLIR -> PTX -> cubin with Triton's bundled ptxas, no driver needed.

Use from a test::

    _AOT_SCRIPT = '''
    from tests.utils.aot import compile_sm90
    from tachyon.kernels.foo import triton as tri
    compile_sm90(tri._foo_kernel, {"X": "*bf16", "eps": "fp32"}, dict(BLOCK=1024), num_warps=4)
    '''

    def test_kernels_compile_for_sm90_without_a_gpu():
        compile_in_subprocess(_AOT_SCRIPT, expected=1)

The script runs in a fresh interpreter with TRITON_INTERPRET removed from its environment (it
must be unset before triton is imported, which pytest's process already did), with the repository
root as working directory and on sys.path so ``tests.utils.aot`` and ``tachyon`` import; it is
written to a temporary file first, so it may define ``@triton.jit`` kernels of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
SM90 = ("cuda", 90, 32)  # backend, compute capability, warp size: an H100


def signature(arg_names, types: dict[str, str | tuple[str, ...]], constexprs: dict,
              default: str = "i32") -> dict[str, str | tuple[str, ...]]:
    """Triton signature dict for a kernel's arguments, in order.

    arg_names: the kernel's ``arg_names``; types: name -> Triton type string ("*bf16", "*fp32",
    "fp32", "i64", ...), or a tuple of them for a tuple argument, for every argument that is not
    ``default``; constexprs: the constexpr
    values (their arguments get "constexpr"). Raises ValueError naming unknown names in either map.
    """
    names = list(arg_names)
    unknown = sorted((set(types) | set(constexprs)) - set(names))
    if unknown:
        raise ValueError(f"types/constexprs name {unknown}, which are not kernel arguments; arguments: {names}")
    both = sorted(set(types) & set(constexprs))
    if both:
        raise ValueError(f"{both} are given both a type and a constexpr value; give one")
    return {n: "constexpr" if n in constexprs else types.get(n, default) for n in names}


def aligned_attrs(arg_names, sig: dict[str, str | tuple[str, ...]], also=()) -> dict[tuple[int, ...], list]:
    """``tt.divisibility 16`` on every pointer and on the integer arguments named in ``also``
    (strides, sizes), as Triton's JIT specializes 16-aligned pointers and multiples of 16. A tuple
    argument (its type a tuple of type strings) gets it on each pointer element (path (i, j))."""
    also = set(also)
    attrs = {}
    for i, n in enumerate(arg_names):
        if isinstance(sig[n], tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j, t in enumerate(sig[n]) if t.startswith("*")})
        elif sig[n].startswith("*") or n in also:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int | None = None,
                 aligned_ints=(), target=SM90):
    """Compile one ``@triton.jit`` kernel for ``target`` (default sm_90) and print a "compiled" line.

    Call only in a process where TRITON_INTERPRET is unset (see :func:`compile_in_subprocess`).
    Returns the CompiledKernel (its ``asm`` holds ttir/ttgir/llir/ptx/cubin).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction) and hasattr(fn, "fn"):
        fn = fn.fn  # an Autotuner/Heuristics wraps the JITFunction
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise ValueError(f"kernel must be a @triton.jit function (is TRITON_INTERPRET set?), got {type(fn).__name__}")
    sig = signature(fn.arg_names, types, constexprs)
    attrs = aligned_attrs(fn.arg_names, sig, aligned_ints)
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs), attrs=attrs),
                              target=GPUTarget(*target), options=options)
    if "cubin" not in compiled.asm:
        raise AssertionError(f"{fn.__name__}: no cubin produced; stages: {sorted(compiled.asm)}")
    print("compiled", fn.__name__, constexprs, f"num_warps={num_warps}", flush=True)
    return compiled


def run_without_interpreter(script: str, timeout: float = 300) -> str:
    """Run ``script`` in a fresh Python without TRITON_INTERPRET (Triton's GPU code path, e.g. under
    `tachyon.profiling.launch_stub.StubLaunches`); assert it exited 0 and return its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), str(_ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as tmp:  # a file, not -c: @triton.jit needs the source of what it wraps
        path = Path(tmp) / "script.py"
        path.write_text(script)
        proc = subprocess.run([sys.executable, str(path)], env=env, cwd=_ROOT, capture_output=True, text=True,
                              timeout=timeout)
    assert proc.returncode == 0, (f"script failed (rc={proc.returncode}).\n"
                                  f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


def compile_in_subprocess(script: str, expected: int, timeout: float = 300) -> str:
    """Run ``script`` in a fresh Python without TRITON_INTERPRET; assert it exited 0 and printed
    "compiled" ``expected`` times. Returns its stdout."""
    stdout = run_without_interpreter(script, timeout)
    count = sum(line.startswith("compiled") for line in stdout.splitlines())
    assert count == expected, f"expected {expected} kernels compiled, got {count}:\n{stdout}"
    return stdout
