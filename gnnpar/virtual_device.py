"""A simulated accelerator for device-neutrality checks on a machine without one.

gnnpar must keep every tensor of a run on ``grid.device`` (a GPU under NCCL) and copy to the
host only where it means to. On a CPU-only machine a missing ``.to(device)`` is invisible:
every tensor is already on the one device there is. :func:`simulated_device` makes it
visible. Inside it, ``grid.device`` is the *virtual device*: tensors created there (factory
functions and ``.to(device)``) are wrappers around real CPU tensors whose ``device`` reads
``lazy``, so they compute real values (losses, accuracies and checkpoints are the CPU run's,
bit for bit), but

- an operation that mixes a virtual-device tensor with a host tensor raises
  :class:`CrossDeviceError` naming the operation and both devices, as CUDA would (0-d host
  tensors are allowed, as CUDA allows CPU scalars);
- ``.numpy()`` of a virtual-device tensor fails, as it fails for a CUDA tensor;
- ``.cpu()`` / ``.to("cpu")`` return plain host tensors, ``.item()`` / ``.tolist()`` work (a
  synchronisation on a GPU).

Why not the plain ``meta`` device: it holds no values (a run stops at its first ``.item()``)
and many meta kernels accept host operands silently; gnnpar also uses real meta tensors for
deferred initialisation, which must stay distinct. Why not a fake CUDA device: autograd and
the optimizers ask the CUDA runtime for device guards. The wrapper carries ``lazy`` (torch's
lazy-tensor device type, whose device guard every CPU build registers) as its device type;
no lazy-tensor backend ever runs, since every operation is answered here.

It is a test instrument, not a backend: collectives cannot move wrapper tensors (gloo reads
host memory), so a simulated run is a world of one process; :mod:`gnnpar.comm` checks that
every collective's tensor is on ``grid.device`` in every world, which catches the host
tensors that a world of one never sends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "VIRTUAL",
    "CrossDeviceError",
    "Simulation",
    "VirtualTensor",
    "active",
    "simulated_device",
]

VIRTUAL = torch.device("lazy")
"""The device a simulated run's ``grid.device`` is."""


class CrossDeviceError(RuntimeError):
    """An operation mixed a virtual-device tensor with a host tensor."""


class VirtualTensor(torch.Tensor):
    """A tensor on the virtual device: its values live in ``elem``, a host tensor."""

    elem: torch.Tensor
    # Results are wrapped at the dispatcher, not by torch's default function-level subclassing
    # (which would turn host results of .cpu() into value-less wrappers).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> VirtualTensor:
        # A wrapper cannot carry a sparse layout (torch asks its TensorImpl for it): a sparse
        # host tensor is wrapped as strided; ops on it still run the sparse kernels.
        sparse = elem.layout != torch.strided
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=_contiguous_strides(elem.shape) if sparse else elem.stride(),
            storage_offset=0 if sparse else elem.storage_offset(),
            dtype=elem.dtype,
            device=VIRTUAL,
            requires_grad=elem.requires_grad,
        )
        r.elem = elem
        return r

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        return f"VirtualTensor({self.elem!r})"

    # Aliasing checks and storage freeing (ZeRO-3) act on the host tensor's memory.
    def data_ptr(self) -> int:  # noqa: D102
        return self.elem.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:  # noqa: D102
        return self.elem.untyped_storage()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        raise CrossDeviceError(
            "can't convert a tensor on the accelerator to numpy: copy it to the host first "
            "(.cpu())"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: D105
        return _dispatch(func, args, kwargs or {})


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _unwrap(x: Any) -> Any:
    return x.elem if isinstance(x, VirtualTensor) else x


def _wrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, VirtualTensor):
        return VirtualTensor(x)
    return x


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _target(device: Any) -> bool:
    """Whether ``device`` names the virtual device."""
    if device is None:
        return False
    try:
        return torch.device(device) == VIRTUAL
    except (TypeError, RuntimeError):
        return False


# Results that leave the device: Python scalars and booleans.
_HOST_RESULTS = frozenset({"_local_scalar_dense", "equal", "is_same_size", "_nnz"})
_ATEN = torch.ops.aten


def _dispatch(func, args: tuple, kwargs: dict) -> Any:
    name = func.overloadpacket.__name__
    if _target(kwargs.get("device")):
        # A factory function or a copy onto the device: compute on the host, wrap.
        kwargs = {**kwargs, "device": torch.device("cpu")}
        return tree_map(_wrap, func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))
    tensors = _tensors((args, kwargs))
    if not any(isinstance(t, VirtualTensor) for t in tensors):
        return func(*args, **kwargs)
    if func is _ATEN._to_copy.default and torch.device(kwargs.get("device", VIRTUAL)).type == "cpu":
        return func(_unwrap(args[0]), *args[1:], **kwargs)  # device → host
    if func is _ATEN.copy_.default and not isinstance(args[0], VirtualTensor):
        return func(args[0], _unwrap(args[1]), *args[2:], **kwargs)  # into a host tensor
    if func is not _ATEN.copy_.default:
        host = [t for t in tensors if not isinstance(t, VirtualTensor) and t.dim() > 0]
        if host:
            raise CrossDeviceError(
                f"aten.{name}: a tensor on the accelerator ({VIRTUAL}) met a host tensor of "
                f"shape {tuple(host[0].shape)}; move it with .to(grid.device)"
            )
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if name in _HOST_RESULTS:
        return out
    if func._schema.is_mutable and isinstance(args[0], VirtualTensor) and out is args[0].elem:
        return args[0]  # in-place ops return their (wrapped) self
    return tree_map(_wrap, out)


# Arithmetic that a run on an accelerator should never do on the host.
_COMPUTE = frozenset(
    {
        "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_sparse_mm", "_sparse_addmm",
        "_embedding_bag", "_embedding_bag_forward_only", "embedding_dense_backward",
        "_softmax", "_log_softmax", "nll_loss_forward", "nll_loss_backward",
        "_scaled_dot_product_flash_attention_for_cpu", "native_layer_norm",
    }
)  # fmt: skip


class _Mode(TorchDispatchMode):
    """Routes factory functions and copies onto the virtual device to :func:`_dispatch`,
    and records arithmetic done on host tensors (:attr:`host_compute`)."""

    def __init__(self) -> None:
        super().__init__()
        self.host_compute: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _COMPUTE:
            tensors = _tensors(args)
            if tensors and not any(isinstance(t, VirtualTensor) for t in tensors):
                shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
                self.host_compute.append(f"aten.{name}({shapes})")
        return _dispatch(func, args, kwargs)


# Tensors built from Python data: torch builds them on the target device below the
# dispatcher (a real tensor of the target device type), so they are caught before it.
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor})


class _Data(TorchFunctionMode):
    """Routes tensors made from Python data onto the virtual device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and isinstance(args[0], VirtualTensor):
            return args[0].elem.tolist()  # a synchronising read, as on a GPU
        if func in _FROM_DATA:
            on_virtual = _target(kwargs.get("device"))
            if func is torch.Tensor.new_tensor and isinstance(args[0], VirtualTensor):
                on_virtual = on_virtual or kwargs.get("device") is None
                args = (args[0].elem, *args[1:])
            if on_virtual:
                out = func(*args, **{**kwargs, "device": "cpu"})
                return VirtualTensor(out)
        return func(*args, **kwargs)


def active() -> bool:
    """Whether this thread runs inside :func:`simulated_device`."""
    return any(isinstance(m, _Mode) for m in _get_current_dispatch_mode_stack())


class Simulation:
    """What :func:`simulated_device` yields: the device, and the host arithmetic it saw."""

    def __init__(self, mode: _Mode) -> None:
        self.device = VIRTUAL
        self._mode = mode

    @property
    def host_compute(self) -> list[str]:
        """Matrix products, embedding bags, softmaxes and losses that ran on host tensors
        (each as ``aten.op(shapes)``): work a run on an accelerator would do on the CPU."""
        return list(self._mode.host_compute)

    def clear(self) -> None:
        """Forget the host arithmetic seen so far."""
        self._mode.host_compute.clear()


@contextlib.contextmanager
def simulated_device() -> Iterator[Simulation]:
    """Run the enclosed code with :data:`VIRTUAL` as the accelerator (see the module
    docstring); ``gnnpar.init`` gives grids this device while it is active."""
    mode = _Mode()
    with _Data(), mode:
        yield Simulation(mode)
