"""Calls without a device tensor among their arguments, caught by a torch function mode: factories with
`device=cuda`, host tensors moving to the device, pinning, and the device's random generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from scoutbench.testing.emulated_cuda.state import CPU
from scoutbench.testing.emulated_cuda.tensors import (
    EMPTY_CALLS,
    EmulatedTensor,
    captured_leaf,
    is_cuda_device,
    poison,
    record_outputs,
    refuse_generator,
    to_host_h2d,
    tree_map,
)

if TYPE_CHECKING:
    from scoutbench.testing.emulated_cuda.capture import Capture
    from scoutbench.testing.emulated_cuda.runtime import EmulatedRuntime


_FACTORY_SYNCS = {torch.tensor: "torch.tensor(host data, device=cuda) (a blocking copy)",
                  torch.as_tensor: "torch.as_tensor(host data, device=cuda) (a blocking copy)"}


class EmulationMode(TorchFunctionMode):
    """Calls without a device tensor among their arguments: factories with `device=cuda`, host tensors moving to
    the device, and pinning. (Thread-local, as torch function modes are: the decode loop's thread has it.)"""

    def __init__(self, runtime: EmulatedRuntime):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        runtime = self.runtime
        if types and any(issubclass(t, EmulatedTensor) for t in types):
            return func(*args, **kwargs)  # EmulatedTensor.__torch_function__ handles it
        if func is torch.Tensor.pin_memory:
            return runtime.pinned_like(args[0])
        if func is torch.Tensor.is_pinned:
            return runtime.is_pinned(args[0])
        if func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(args[0], torch.Tensor):
            if func is torch.Tensor.cuda:
                return to_host_h2d(runtime, args[0], bool(kwargs.get("non_blocking", False)))
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cuda":
                moved = to_host_h2d(runtime, args[0], non_blocking)
                return moved.to(dtype) if dtype is not None else moved
            return func(*args, **kwargs)
        if kwargs.get("pin_memory"):
            if func is torch.empty:
                pinned = runtime.pinned_empty(*args, **kwargs)
                return poison(pinned) if runtime.poison_empty else pinned
            return runtime.pinned_like(func(*args, **{k: v for k, v in kwargs.items() if k != "pin_memory"}))
        device = kwargs.get("device")
        if device is not None and is_cuda_device(device):
            runtime.check_last_error()
            capture = runtime.capturing(runtime.current_stream())
            if capture is not None:
                return _capture_factory(runtime, capture, func, args, kwargs)
            kwargs = {**kwargs, "device": CPU}
            result = func(*args, **kwargs)
            if func in _FACTORY_SYNCS:  # host data copied to the device, synchronously
                runtime.record_sync(_FACTORY_SYNCS[func])
                runtime.count_transfer("h2d", runtime.current_stream(), result)
            if func in EMPTY_CALLS and runtime.poison_empty:
                poison(result)
            return tree_map(lambda t: EmulatedTensor(t) if isinstance(t, torch.Tensor) else t, result)
        return func(*args, **kwargs)


def _capture_factory(runtime: EmulatedRuntime, capture: Capture, func: Any, args: tuple, kwargs: dict) -> Any:
    """A factory with `device=cuda` on a capturing stream: its fill is device work, recorded and redone at every
    replay with the values it had at capture; `empty` only allocates; host data copied in is a blocking copy."""
    name = getattr(func, "__name__", str(func))
    if func in _FACTORY_SYNCS:
        capture.refuse(_FACTORY_SYNCS[func])
    refuse_generator(capture, name, kwargs)
    host_kwargs = {**kwargs, "device": CPU}
    if func in EMPTY_CALLS:
        result = func(*args, **host_kwargs)
        return EmulatedTensor(poison(result) if runtime.poison_empty else result)
    call_args, call_kwargs = tree_map(captured_leaf, args), tree_map(captured_leaf, host_kwargs)
    shapes = func(*call_args, **{**call_kwargs, "device": torch.device("meta")})
    return record_outputs(capture, runtime.current_stream(), func, call_args, call_kwargs, shapes)


class EmulatedGenerator(torch.Generator):
    """`torch.Generator(device="cuda")` on the emulated device: a CPU generator (random streams differ from CUDA)."""

    def __new__(cls, device: Any = "cpu") -> EmulatedGenerator:
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = "cpu") -> None:
        pass
