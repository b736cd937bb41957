"""Device memory: `EmulatedTensor` says `cuda:0` and keeps its data in a CPU tensor. Every torch call on it
runs on that data, now on the default stream, queued on another, recorded (not run) on a capturing one; host
reads, data-dependent shapes and indexing with host indices are recorded as syncs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from scoutbench.testing.emulated_cuda.capture import NOT_PERMITTED
from scoutbench.testing.emulated_cuda.state import CPU, EMULATED_DEVICE, call_site, require_active
from scoutbench.timing import METADATA_CALLS

if TYPE_CHECKING:
    from scoutbench.testing.emulated_cuda.capture import Capture
    from scoutbench.testing.emulated_cuda.runtime import EmulatedRuntime
    from scoutbench.testing.emulated_cuda.streams import EmulatedStream


def tree_map(fn: Callable[[Any], Any], value: Any) -> Any:
    """`fn` over the leaves of nested tuples, lists and dicts (torch's pytree is several times slower here)."""
    if isinstance(value, (list, tuple)):
        mapped = [tree_map(fn, item) for item in value]
        if type(value) is list:
            return mapped
        return tuple(mapped) if type(value) is tuple else type(value)(mapped)
    if isinstance(value, dict):
        return {key: tree_map(fn, item) for key, item in value.items()}
    return fn(value)


def tree_leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from tree_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tree_leaves(item)
    else:
        yield value


def is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)  # `.to(0)`, `device=0`: a CUDA ordinal


def _is_host_device(value: Any) -> bool:
    return value is not None and not is_cuda_device(value) and torch.device(value).type == "cpu"


def _unwrap(value: Any) -> Any:
    if isinstance(value, EmulatedTensor):
        return value._inner
    if isinstance(value, torch.device) and value.type == "cuda":
        return CPU
    return value


_METADATA = METADATA_CALLS
_HOST_READS = {torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.__bool__: "bool(tensor)",
               torch.Tensor.__int__: "int(tensor)", torch.Tensor.__float__: "float(tensor)",
               torch.Tensor.__index__: "tensor used as an index", torch.Tensor.numpy: ".numpy()",
               torch.Tensor.__array__: "numpy conversion", torch.Tensor.__repr__: "repr(tensor)",
               torch.Tensor.__format__: "format(tensor)", torch.Tensor.__str__: "str(tensor)"}
_DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
                   torch.unique, torch.Tensor.unique, torch.argwhere, torch.Tensor.argwhere,
                   torch.unique_consecutive, torch.Tensor.unique_consecutive}
_SHAPE_CHANGING = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_",
                   "swapdims_", "swapaxes_"}


class EmulatedTensor(torch.Tensor):
    """A tensor on the emulated `cuda:0`: metadata of its own, data in `_inner` (a CPU tensor)."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> EmulatedTensor:
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=EMULATED_DEVICE, requires_grad=False)
        tensor._inner = inner
        return tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise RuntimeError(f"emulated CUDA: {func} reached the dispatcher (call it through torch's Python API)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206, C901
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch._has_compatible_shallow_copy_type:
            return False  # `Module.to("cuda")`: new device parameters, never host storage swapped for device data
        runtime = require_active()
        if func in _HOST_READS:
            runtime.record_sync(_HOST_READS[func])
            stream = runtime.current_stream()
            if not (stream.is_default or runtime.executing):  # CUDA copies on the current stream and waits for it:
                runtime.flush(stream, stream.tail)  # a side stream's queued work runs first
            inner = args[0]._inner
            if func in (torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__):
                return f"{func(inner, *args[1:], **kwargs)} (emulated cuda:0)"
            return func(inner, *[_unwrap(a) for a in args[1:]], **kwargs)
        if func is torch.Tensor.copy_:
            return _copy(runtime, args[0], args[1], bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory,
                    torch.Tensor.is_pinned, torch.Tensor.record_stream, torch.Tensor.data_ptr,
                    torch.Tensor.untyped_storage):
            result = _tensor_method(runtime, func, args, kwargs)
            if result is not NotImplemented:
                return result
        if func in _DATA_DEPENDENT:
            runtime.record_sync(f"{func.__name__} (its output size depends on device data)")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            _index_syncs(runtime, args)
        inner_args = _unwrap_all(args)
        inner_kwargs = {key: _unwrap(value) if not isinstance(value, (list, tuple)) else tree_map(_unwrap, value)
                        for key, value in kwargs.items()} if kwargs else kwargs
        if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            _check_same_device(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name in _SHAPE_CHANGING:
            raise RuntimeError(f"emulated CUDA: in-place shape change {name} is not emulated")
        if _is_host_device(kwargs.get("device")):  # `t.new_empty(0, device="cpu")` (Triton's interpreter): host
            return func(*inner_args, **inner_kwargs)
        if func in EMPTY_CALLS and runtime.poison_empty and not inplace_name(name):
            with runtime.lock:
                return _wrap_result(poison(func(*inner_args, **inner_kwargs)), args, kwargs)
        inplace = (inplace_name(name) or name in _INPLACE_DUNDERS or "out" in kwargs or kwargs.get("inplace") is True
                   or writes_arguments(func))
        stream = runtime.current_stream()
        capture = runtime.capturing(stream)
        if capture is not None:
            return _capture_op(capture, stream, func, inplace, args, kwargs)
        if stream.is_default or runtime.executing:
            runtime.check_last_error()
            with runtime.lock:
                result = func(*inner_args, **inner_kwargs)
            return _wrap_result(result, args, kwargs)
        return _side_stream_op(runtime, stream, func, inner_args, inner_kwargs, inplace, args, kwargs)

    def __reduce_ex__(self, protocol: int) -> Any:
        raise TypeError("an emulated CUDA tensor cannot be pickled or deep-copied; copy the CPU model instead")


def inplace_name(name: str) -> bool:
    return name.endswith("_") and not name.startswith("__")


def writes_arguments(func: Any) -> bool:
    """An operator whose schema writes its arguments (a custom op's `mutates_args`, such as
    `scoutbench::select_split` filling a static plan): in-place device work, whatever its name."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(arg.alias_info is not None and arg.alias_info.is_write
                                      for arg in schema.arguments)


def _inplace_result(func: Any, args: tuple, kwargs: dict) -> Any:
    """What an in-place or `out=` operation returns without running: its `out` (several as torch's named tuple,
    such as `torch.return_types.topk`), else the tensor it modified (`__setitem__`, and an operator that writes
    its arguments and returns nothing: None)."""
    out = kwargs.get("out")
    if isinstance(out, (tuple, list)):
        return getattr(torch.return_types, getattr(func, "__name__", ""), tuple)(out)
    if out is not None:
        return out
    if getattr(func, "__name__", "") == "__setitem__" or (writes_arguments(func) and not func._schema.returns):
        return None
    return args[0]


_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _wrap_result(result: Any, args: tuple, kwargs: dict) -> Any:
    """Device tensors for the CPU results of an operation; an in-place operation returns its own argument."""
    if isinstance(result, torch.Tensor):
        for arg in args:
            if isinstance(arg, EmulatedTensor) and arg._inner is result:
                return arg
        return result if isinstance(result, EmulatedTensor) else EmulatedTensor(result)
    if isinstance(result, (list, tuple)):
        return tree_map(lambda value: _wrap_result(value, args, kwargs), result)
    return result


def _unwrap_all(values: Any) -> Any:
    """`_unwrap` over call arguments: one level of tuples/lists covers torch's signatures (cat, indexing)."""
    out = []
    for value in values:
        if isinstance(value, EmulatedTensor):
            out.append(value._inner)
        elif isinstance(value, (list, tuple, dict)):
            out.append(tree_map(_unwrap, value))
        elif isinstance(value, torch.device) and value.type == "cuda":
            out.append(CPU)
        else:
            out.append(value)
    return out


def _check_same_device(func: Any, args: Any, kwargs: Any) -> None:
    """CUDA refuses an operation mixing device tensors with host tensors of one or more dimensions."""
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor) and not isinstance(item, EmulatedTensor) and item.dim() > 0:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"cuda:0 and cpu! (emulated CUDA: {getattr(func, '__name__', func)} got a host "
                                   f"tensor of shape {tuple(item.shape)})")


def _index_syncs(runtime: EmulatedRuntime, args: tuple) -> None:
    """Indexing a device tensor with host index tensors copies them (a sync); boolean masks need `nonzero`."""
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    for entry in index:
        if isinstance(entry, list) and any(isinstance(i, int) for i in tree_leaves(entry)):
            runtime.record_sync("indexing a device tensor with a Python list (blocking copy)")
        for item in tree_leaves(entry):
            if isinstance(item, torch.Tensor) and item.dtype == torch.bool and item.dim() > 0:
                runtime.record_sync("indexing with a boolean mask (nonzero)")
            elif isinstance(item, torch.Tensor) and not isinstance(item, EmulatedTensor) and item.dim() > 0:
                runtime.record_sync("indexing a device tensor with a host index tensor (blocking copy)")
    if len(args) > 2 and isinstance(args[2], torch.Tensor) and not isinstance(args[2], EmulatedTensor) \
            and args[2].dim() > 0:
        runtime.record_sync("assigning a host tensor into a device tensor (blocking copy)")


def _side_stream_op(runtime: EmulatedRuntime, stream: EmulatedStream, func: Any, inner_args: Any,
                    inner_kwargs: Any, inplace: bool, args: tuple, kwargs: dict) -> Any:
    """Work issued on a non-default stream: queued. Its outputs are allocated now from the shapes torch's meta
    kernels give (the inputs may not hold their data yet); views are made now (metadata only)."""
    if inplace:
        stream.enqueue(lambda: func(*inner_args, **inner_kwargs))
        return _inplace_result(func, args, kwargs)
    metas: set[int] = set()

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            metas.add(id(meta))
            return meta
        return torch.device("meta") if isinstance(value, torch.device) else value

    try:
        shapes = func(*tree_map(to_meta, inner_args), **tree_map(to_meta, inner_kwargs))
    except Exception:  # noqa: BLE001 - no meta kernel (or data-dependent): run the stream up to here, then this
        runtime.flush(stream, stream.tail)
        with runtime.lock:
            return _wrap_result(func(*inner_args, **inner_kwargs), args, kwargs)
    outputs = [t for t in tree_leaves(shapes) if isinstance(t, torch.Tensor)]
    if outputs and all(t._base is not None and id(t._base) in metas for t in outputs):
        return _wrap_result(func(*inner_args, **inner_kwargs), args, kwargs)  # views: no data is read
    buffers = tree_map(lambda t: poison(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))
                       if isinstance(t, torch.Tensor) else t, shapes)

    def run() -> None:
        fresh = func(*inner_args, **inner_kwargs)
        for buffer, value in zip(list(tree_leaves(buffers)), list(tree_leaves(fresh)), strict=True):
            if isinstance(buffer, torch.Tensor):
                buffer.copy_(value)

    stream.enqueue(run)
    return tree_map(lambda t: EmulatedTensor(t) if isinstance(t, torch.Tensor) else t, buffers)


def _copy(runtime: EmulatedRuntime, dst: torch.Tensor, src: Any, non_blocking: bool) -> torch.Tensor:
    dst_device, src_device = isinstance(dst, EmulatedTensor), isinstance(src, EmulatedTensor)
    if dst_device and src_device:
        runtime.run_device(lambda: dst._inner.copy_(src._inner), inplace=True)
    elif dst_device:
        src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
        runtime.check_last_error()
        runtime.host_to_device(dst._inner, src, non_blocking)
    else:
        runtime.check_last_error()
        runtime.device_to_host(dst, src._inner, non_blocking)
    return dst


def _tensor_method(runtime: EmulatedRuntime, func: Any, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    if func is torch.Tensor.record_stream:
        return None  # the emulator never reuses memory (see docs/gpu.md: what it cannot catch)
    if func is torch.Tensor.is_pinned:
        return False
    if func is torch.Tensor.pin_memory:
        raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
    if func in (torch.Tensor.data_ptr, torch.Tensor.untyped_storage):
        capture = runtime.capturing(runtime.current_stream())
        if capture is not None:
            capture.fail(f"emulated CUDA: {func.__name__}() of a device tensor inside a capture, "
                         f"{call_site('').where()}: a kernel that reads device memory by address (Triton's "
                         "interpreter) would run now, at capture, and no replay would run it; capturing it is not "
                         "emulated (on a GPU the kernel's launch is captured)")
        return func(tensor._inner)
    if func is torch.Tensor.cpu:
        return _to_host(runtime, tensor, non_blocking=False)
    if func is torch.Tensor.cuda:
        return tensor
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    if device is not None and device.type == "cpu":
        host = _to_host(runtime, tensor, non_blocking)
        return host.to(dtype=dtype) if dtype is not None else host
    return NotImplemented  # a dtype or layout change on the device: an ordinary device operation


def _to_host(runtime: EmulatedRuntime, tensor: EmulatedTensor, non_blocking: bool) -> torch.Tensor:
    """`.cpu()` / `.to("cpu")`: with non_blocking torch returns pinned memory that is valid once waited on."""
    if non_blocking:
        out = runtime.pinned_empty(tensor.shape, dtype=tensor.dtype)
        runtime.device_to_host(out, tensor._inner, True)
        return out
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    runtime.device_to_host(out, tensor._inner, False)
    return out


def to_host_h2d(runtime: EmulatedRuntime, host: torch.Tensor, non_blocking: bool) -> EmulatedTensor:
    """`host.to("cuda")`: a fresh device tensor filled from host memory."""
    runtime.check_last_error()
    out = torch.empty_like(host, device=CPU)
    if runtime.poison_empty:
        poison(out)
    runtime.host_to_device(out, host, non_blocking)
    return EmulatedTensor(out)


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fill fresh `empty` memory the way a reused allocation looks: NaN, a huge negative index, True, 0xA5."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    elif tensor.dtype == torch.uint8:
        tensor.fill_(0xA5)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min // 2)
    return tensor


EMPTY_CALLS = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty}


def captured_leaf(value: Any) -> Any:
    """An argument as a recorded operation keeps it: device tensors by identity (their data as it is at each
    replay), host scalar tensors and Python values by their value at capture (a kernel's launch arguments)."""
    if isinstance(value, EmulatedTensor):
        return value._inner
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, torch.device) and value.type == "cuda":
        return CPU
    return value


def _refill(buffers: list[torch.Tensor], func: Any, args: Any, kwargs: dict) -> None:
    """Run a recorded operation and write its outputs into the tensors capture allocated for them."""
    fresh = [value for value in tree_leaves(func(*args, **kwargs)) if isinstance(value, torch.Tensor)]
    for buffer, value in zip(buffers, fresh, strict=True):
        buffer.copy_(value)


def _allocate_outputs(shapes: Any) -> Any:
    """Poisoned CPU tensors shaped as the meta results: what the captured work will write, unwritten yet."""
    return tree_map(lambda t: poison(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))
                    if isinstance(t, torch.Tensor) else t, shapes)


def record_outputs(capture: Capture, stream: EmulatedStream, func: Any, args: Any, kwargs: dict,
                    shapes: Any) -> Any:
    buffers = _allocate_outputs(shapes)
    leaves = [b for b in tree_leaves(buffers) if isinstance(b, torch.Tensor)]
    capture.record(stream, functools.partial(_refill, leaves, func, args, kwargs))
    return tree_map(lambda t: EmulatedTensor(t) if isinstance(t, torch.Tensor) else t, buffers)


def refuse_generator(capture: Capture, name: str, kwargs: dict) -> None:
    if kwargs.get("generator") is not None:
        capture.fail(f"{NOT_PERMITTED} (emulated CUDA: {name} with an explicit generator inside a capture is not "
                     "emulated; use the default generator, whose draws a replay repeats afresh)")


def _capture_op(capture: Capture, stream: EmulatedStream, func: Any, inplace: bool, args: tuple,
                kwargs: dict) -> Any:
    """A device operation issued on a capturing stream: recorded, not run. Outputs are allocated now from the
    shapes torch's meta kernels give, poisoned; views are made now (metadata only); an operation whose result
    needs device data on the host (no meta result) is refused, as CUDA refuses the sync it would take."""
    name = getattr(func, "__name__", str(func))
    refuse_generator(capture, name, kwargs)
    call_args, call_kwargs = tree_map(captured_leaf, args), tree_map(captured_leaf, kwargs)
    if inplace:
        capture.record(stream, functools.partial(func, *call_args, **call_kwargs))
        return _inplace_result(func, args, kwargs)
    input_storages: set[int] = set()

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            input_storages.add(meta.untyped_storage()._cdata)
            return meta
        return torch.device("meta") if isinstance(value, torch.device) else value

    try:
        shapes = func(*tree_map(to_meta, call_args), **tree_map(to_meta, call_kwargs))
    except Exception as error:  # noqa: BLE001 - no meta result: the result depends on device data
        capture.fail(f"{NOT_PERMITTED} (emulated CUDA: {name} {call_site('').where()} needs device data on the "
                     f"host to produce its result: {str(error).splitlines()[0] if str(error) else type(error)})")
    aliases = [t.untyped_storage()._cdata in input_storages for t in tree_leaves(shapes)
               if isinstance(t, torch.Tensor)]
    if all(aliases):  # views of the inputs, the inputs themselves, or metadata: no device work
        return _wrap_result(func(*call_args, **call_kwargs), args, kwargs)
    if any(aliases):
        capture.fail(f"{NOT_PERMITTED} (emulated CUDA: capturing {name}, which returns views of its inputs "
                     "beside new tensors, is not emulated)")
    return record_outputs(capture, stream, func, call_args, call_kwargs, shapes)
