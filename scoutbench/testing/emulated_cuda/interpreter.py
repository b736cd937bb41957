"""Triton kernels on the emulated device: triton's interpreter runs them on the device's CPU tensors.

Why: the lent H200 has triton and no flashinfer, so its decode runs the project's Triton kernels (the split-KV decode,
the fused ops). Emulated CUDA would reach them with `torch.cuda.is_available()` patched to True, and a compiled
launch needs libcuda. `TRITON_INTERPRET=1` must be set before triton is first imported (triton decorates its own
library functions at import), so a process either interprets every Triton kernel or none; the emulation reads which
(`triton_path`) and never launches a compiled kernel:

- interpreted (`backends.INTERPRETED`): `backends.triton_available()` is true, the dispatch picks the Triton kernels
  as on the H200, and each launch on device tensors is device work of the current stream, as a kernel launch is: now
  on the default stream, queued on another, recorded by a capture with its device tensors by identity and its Python
  arguments by value (the interpreter reads the tensors' memory when it runs, so a replay reads each step's data);
  torch function modes do not see the interpreter's own torch calls (on a GPU a launch is no torch call). A fused
  op's body runs its Triton kernel (`kernels/fused_ops.py`).
- otherwise (`backends.REFERENCE`): the kernels' torch references stand for them, as without triton.

Two changes to the interpreter (triton 3.9) while the emulation runs, neither changing what a kernel computes:
- it multiplies bfloat16 operands of `tl.dot` as their raw 16-bit patterns (it stores bfloat16 as uint16): a bf16
  operand is widened to fp32 first (exact, as a GPU's tensor cores read it), so bf16 kernels are checked too. Its
  fp32 -> bf16 cast still truncates where a GPU rounds (one unit in the last place);
- it patches the language modules a jit helper's module sees at every call of the helper (`online_softmax_step`
  runs once per key tile: a third of a decode kernel's time) and never restores them: within a launch, a helper of
  a module whose languages an earlier call patched runs at once.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from scoutbench.kernels import backends
from scoutbench.testing.emulated_cuda.state import require_active
from scoutbench.testing.emulated_cuda.tensors import EmulatedTensor, tree_leaves, tree_map


def triton_path() -> str:
    """How this process's emulated device serves the Triton kernels: `backends.INTERPRETED` where triton is
    installed and was imported (or is imported now) with TRITON_INTERPRET=1, else `backends.REFERENCE`."""
    try:
        import triton.language  # noqa: PLC0415 - optional
        from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    except Exception:  # noqa: BLE001 - any import failure: triton is unavailable
        return backends.REFERENCE
    # triton's own library functions are jit-decorated at its import: interpreted only if TRITON_INTERPRET was set then
    interpreted = isinstance(triton.language.standard.cdiv, InterpretedFunction)
    return backends.INTERPRETED if interpreted else backends.REFERENCE


def interpreter_patches() -> dict[tuple[Any, str], Any]:
    """What `activate` patches in triton's interpreter while the emulation runs: launches as device work, jit
    helpers called at once inside a launch, and bfloat16 `tl.dot` operands widened to fp32 (module docstring)."""
    import numpy as np  # noqa: PLC0415 - the interpreter's arrays
    import triton.language as tl  # noqa: PLC0415
    from triton.runtime.interpreter import (  # noqa: PLC0415
        InterpretedFunction,
        InterpreterBuilder,
        InterpreterError,
        TensorHandle,
    )

    run, call, dot = InterpretedFunction.run, InterpretedFunction.__call__, InterpreterBuilder.create_dot
    # this thread's launch: the modules (by their globals) whose jit helpers patched the language modules they see
    running = threading.local()

    def interpret(self: Any, args: Any, grid: Any, kwargs: Any) -> None:
        require_active().triton_launches[self.__name__] += 1
        running.patched = set()
        try:
            run(self, *args, grid=grid, warmup=False, **kwargs)
        finally:
            running.patched = None

    def launch(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        if warmup:
            return None
        if not any(isinstance(leaf, EmulatedTensor) for leaf in tree_leaves([args, kwargs])):
            return interpret(self, args, grid, kwargs)  # a fused op's body on the device's data, run now
        host_args, host_kwargs = tree_map(_data, list(args)), tree_map(_data, kwargs)

        def kernel() -> None:
            with torch._C.DisableTorchFunction():  # the interpreter's torch calls are no launches of the caller
                interpret(self, host_args, grid, host_kwargs)

        require_active().run_device(kernel, inplace=True)
        return None

    def helper_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched, module = getattr(running, "patched", None), id(self.fn.__globals__)
        if patched is None or module not in patched:
            result = call(self, *args, **kwargs)
            if patched is not None:
                patched.add(module)
            return result
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as error:
            raise InterpreterError(repr(error)) from error

    def widened(handle: Any) -> Any:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    return {(InterpretedFunction, "run"): launch, (InterpretedFunction, "__call__"): helper_call,
            (InterpreterBuilder, "create_dot"): create_dot}


def _data(value: Any) -> Any:
    return value._inner if isinstance(value, EmulatedTensor) else value
