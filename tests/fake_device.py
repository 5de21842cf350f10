"""A device that is not the CPU, on a CPU: every tensor a run puts "on the device" is recorded as there, and an
operation that mixes it with a CPU tensor fails as it would on a GPU.

No GPU is lent to the project's CI, and on a CPU every run's tensors share one device, so a tensor left on
the CPU by a load (``torch.load(map_location="cpu")``) mixes silently with the run's. Here the run's device
is ``DEVICE`` (torch's ``meta`` device, the one device besides the CPU that a CPU build of torch can place
tensors on): a tensor moved or created there is an ``OnDevice`` tensor, a wrapper subclass that reports
device ``meta`` and computes with a CPU tensor it holds, so a run computes real values. Which operations
may mix devices follows a GPU: a CPU tensor with dimensions only as the source of ``copy_`` / ``to`` or as
the indices of advanced indexing (``MIXABLE``), and a 0-dim CPU tensor where torch's own device checks allow
it (the operation is run on empty ``meta`` tensors in place of the device's, with the CPU arguments as they
are; torch's meta kernels check devices as its CUDA kernels do for element-wise and shape operations, not
for matmuls, hence the explicit rule). A refused operation raises ``DeviceMixed``, naming it. Every mixing operation is also recorded (``FakeDevice.mixed``), so a caller that swallows an
error (a client step turning it into ``ClientFailure``) is still caught.

``fake_device()`` enters it: a dispatch mode that puts factory results (``torch.zeros(..., device=DEVICE)``)
and ``.to(DEVICE)`` copies on the device, and ``torch.tensor`` / ``torch.as_tensor`` with a device (which
torch builds outside the dispatcher) routed through ``.to``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing

DEVICE = torch.device("meta")
aten = torch.ops.aten


def _is_device(dev) -> bool:
    return dev is not None and torch.device(dev).type == DEVICE.type


class OnDevice(torch.Tensor):
    """A tensor on ``DEVICE`` (as its ``device`` says) whose values live in a CPU tensor, ``elem``."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        if type(elem) is not torch.Tensor or elem.device.type != "cpu":
            raise TypeError(f"OnDevice wraps a plain CPU tensor, not {type(elem).__name__} on {elem.device}")
        out = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                  storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                  layout=elem.layout, device=DEVICE,
                                                  requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"

    # what a GPU tensor offers besides operations: values back to Python, pickling (torch.save of a CUDA
    # tensor stores its values), and no numpy view (torch says "use Tensor.cpu()")
    @property
    def is_meta(self) -> bool:  # nn.Module treats meta parameters as placeholders without values
        return False

    def tolist(self):
        return self.elem.tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert a tensor on the run's device to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    def __array__(self, *args, **kwargs):
        return self.numpy()

    def __reduce_ex__(self, protocol):
        return self.elem.__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OnDevice(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_devices(func, args, kwargs)
        to_cpu = func is aten._to_copy.default and kwargs.get("device") is not None and not _is_device(kwargs["device"])
        args_cpu, kwargs_cpu = pytree.tree_map(_unwrap, (args, kwargs))
        out = func(*args_cpu, **kwargs_cpu)
        if to_cpu:  # .to("cpu"), .cpu(): a plain CPU tensor, as from a GPU
            return out
        out = pytree.tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out)
        return return_and_correct_aliasing(func, args, kwargs, out)


def _unwrap(x):
    if isinstance(x, OnDevice):
        return x.elem
    if isinstance(x, torch.device) and _is_device(x):
        return torch.device("cpu")
    return x


def _as_meta(x):
    if isinstance(x, OnDevice):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


class DeviceMixed(RuntimeError):
    """An operation mixed a tensor on the run's device with a CPU tensor where torch refuses it."""


class FakeDevice(TorchDispatchMode):
    """The dispatch mode: factories with ``device=DEVICE`` and ``.to(DEVICE)`` of CPU tensors land on the device."""

    current: FakeDevice | None = None

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_device(kwargs.get("device")) and not any(isinstance(t, OnDevice) for t in pytree.tree_leaves((args, kwargs))):
            out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return pytree.tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out)
        return func(*args, **kwargs)


#: operations a GPU runs with a CPU tensor of any shape among their arguments: the source of a copy, and the
#: indices of advanced indexing (``x[idx]``, ``x[idx] = v``)
MIXABLE = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put.default,
           aten.index_put_.default, aten._index_put_impl_.default}


def _check_devices(func, args, kwargs) -> None:
    """Refuse a CPU tensor beside the device's: one with dimensions anywhere but in ``MIXABLE``, and any
    mix torch's own device checks refuse when ``func`` runs on empty meta tensors in place of the device's
    (0-dim CPU tensors, which a GPU takes as scalars where torch allows it)."""
    cpu = [t for t in pytree.tree_leaves((args, kwargs)) if type(t) is torch.Tensor and t.device.type == "cpu"]
    if not cpu:
        return
    why = None
    if func not in MIXABLE and any(t.dim() > 0 for t in cpu):
        why = "a CPU tensor with dimensions beside tensors on the run's device"
    else:
        try:
            meta_args, meta_kwargs = pytree.tree_map(_as_meta, (args, kwargs))
            func(*meta_args, **meta_kwargs)
        except Exception as exc:  # only device errors count: a meta kernel may lack other support
            text = str(exc)
            if "device" in text and "cpu" in text.lower():
                why = text.splitlines()[0]
    if why is not None:
        shapes = ", ".join(f"{tuple(t.shape)}" for t in cpu)
        where = f"{func}: CPU tensor(s) {shapes} mixed with tensors on the run's device ({why})"
        if FakeDevice.current is not None:
            FakeDevice.current.mixed.append(where)
        raise DeviceMixed(where)


_TENSOR, _AS_TENSOR = torch.tensor, torch.as_tensor


def _tensor(data, *args, device=None, **kwargs):
    if _is_device(device):
        return _TENSOR(data, *args, **kwargs).to(DEVICE)
    return _TENSOR(data, *args, device=device, **kwargs)


def _as_tensor(data, *args, device=None, **kwargs):
    if _is_device(device):
        if isinstance(data, OnDevice):
            return data if not args and not kwargs.get("dtype") else data.to(*args, **kwargs)
        return _AS_TENSOR(data, *args, **kwargs).to(DEVICE)
    return _AS_TENSOR(data, *args, device=device, **kwargs)


@contextlib.contextmanager
def fake_device() -> Iterator[FakeDevice]:
    """Within: ``DEVICE`` behaves as a device separate from the CPU (module docstring)."""
    mode = FakeDevice()
    torch.tensor, torch.as_tensor = _tensor, _as_tensor
    FakeDevice.current = mode
    try:
        with mode:
            yield mode
    finally:
        torch.tensor, torch.as_tensor = _TENSOR, _AS_TENSOR
        FakeDevice.current = None


def on_device(tree) -> bool:
    """Every tensor in ``tree`` is on ``DEVICE``."""
    return all(isinstance(t, OnDevice) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))
