"""The ops as ``torch.library`` custom ops: the form in which ``torch.compile`` and ``torch.export`` take them whole.

Each op ``name`` is two custom ops in the ``visionssm`` namespace, tied together by ``register_autograd``:

* ``visionssm::name(*inputs, *attrs) -> (*outputs, Tensor[] saved)``: the forward. ``inputs`` are the op's tensors
  (``Tensor`` or ``Tensor?``), ``attrs`` its other arguments; ``saved`` holds what the backward reads besides the
  inputs (the Triton path's chunk states, say; empty on the PyTorch path).
* ``visionssm::name_backward(Tensor[] grads, Tensor?[] inputs, Tensor[] saved, *attrs) -> Tensor[]``: the gradient
  of every input that is not ``None``, in order, from those of the outputs.

Both pick their backend when they run (:func:`visionssm.kernels.dispatch.op_backend`), so the PyTorch reference is the
CPU kernel of the same op; on that path the backward recomputes the reference forward and differentiates it
(:func:`reference_backward`). Under ``torch.compile`` with static shapes, where the call runs the Triton kernels on a
GPU, both are traced through, as ``torch.library.triton_op`` does: the compiler's graph holds their Triton launches
and its generated code makes them itself, with none of a custom op's per-call host work (:func:`_decompose_static`).
Eager calls keep each op's ``torch.autograd.Function``: a custom op costs host time per call, and the small models are
host-bound in eager mode. The public functions take the registered op while ``torch.compile`` or ``torch.export``
traces them (:func:`tracing`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from . import tuning
from .dispatch import exporting, interpreter_enabled, op_backend
from .utils import traced

__all__ = ["NAMESPACE", "REGISTERED", "register", "reference_backward", "runs_triton", "tracing"]

NAMESPACE = "visionssm"
#: The forward ops registered so far, by name.
REGISTERED: dict[str, torch._ops.OpOverload] = {}


def tracing() -> bool:
    """Whether the caller is being traced by ``torch.compile`` / ``torch.export`` (take the registered op), and not
    for an ONNX, TorchScript or FX export (those take the PyTorch reference)."""
    return torch.compiler.is_compiling() and not exporting()


def runs_triton(op: str, *tensors: torch.Tensor | None) -> bool:
    """Whether a registered op's call on ``tensors`` runs the Triton kernels: :func:`~.dispatch.op_backend` chooses
    them and the op's launch setting ``reference`` (:mod:`.tuning`) does not send it to the PyTorch path."""
    return op_backend(*tensors) == "triton" and not tuning.overrides(op).get("reference", False)


def _is_tensor_type(arg) -> bool:
    return str(arg.type) in ("Tensor", "Optional[Tensor]")


#: The alignment Inductor assumes of a custom op's outputs (its fakes start at offset 0) and asserts at run time.
_ALIGN = 16


def _fresh(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """``outputs`` contiguous (as the fake kernels promise), starting 16-byte aligned in their storage and
    sharing no memory with an input or with each other (a custom op's contract): a copy of any that would not.
    Traced through by the compiler (:func:`_decompose_static`), the outputs are the graph's to place."""
    if any(traced(t) for t in outputs):
        return [t.contiguous() for t in outputs]
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    fresh = []
    for t in outputs:
        t = t.contiguous()
        if (t.numel() and t.untyped_storage().data_ptr() in seen) or t.storage_offset() * t.element_size() % _ALIGN:
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return fresh


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values``, lists searched (the backward ops take lists of tensors)."""
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)]


def _launches_on_gpu(name: str, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether op ``name`` called on ``tensors`` (fake ones: their device, dtype and sizes) runs its Triton kernels
    compiled for a GPU with plain sizes, the only calls whose launches the compiler can take over: not in Triton's
    interpreter (it runs a kernel at once, on CPU tensors), not on the PyTorch path, not with symbolic sizes (a
    dynamic-shape trace; the launch plans are built for plain sizes)."""
    if interpreter_enabled() or not any(t.is_cuda for t in tensors):
        return False
    if any(isinstance(n, torch.SymInt) for t in tensors for n in t.shape):
        return False
    return runs_triton(name, *tensors)


def _decompose_static(name: str, op, impl: Callable) -> None:
    """Let AOTAutograd trace ``op``'s body (``impl``) where :func:`_launches_on_gpu`, as ``torch.library.triton_op``
    does for every call: the body's Triton launches are recorded (``torch.library.wrap_triton``, see
    :class:`.utils.DirectLaunch`) and the compiler launches the kernels from its own generated code. Other calls keep
    the op whole, as does ``torch.export`` (whose programs keep custom ops high-level unless asked to decompose
    them)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def decompose(mode, func, types, args, kwargs):
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if any(t not in (torch.Tensor, FunctionalTensor) and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented
        whole = custom_triton_ops_decomposition_disabled()
        if whole or not _launches_on_gpu(name, _tensors([*args, *kwargs.values()])):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return impl(*args, **kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, decompose)


def register(name: str, forward: Callable, forward_fake: Callable, backward: Callable,
             backward_fake: Callable | None = None, *, saved_outputs: Sequence[int] = ()):
    """Register op ``name`` (see the module docstring) and return the forward op (``torch.ops.visionssm.<name>``).

    ``forward`` and ``backward`` are annotated Python functions (their annotations give the schemas); the fakes compute
    shapes only. ``backward_fake`` defaults to one contiguous tensor shaped like each present input.
    ``saved_outputs``: indices of the forward's outputs the backward also reads; they lead its ``saved`` list."""

    def forward_impl(*args):
        *outputs, saved = forward(*args)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        fresh = _fresh([*outputs, *saved], inputs)
        return (*fresh[:len(outputs)], fresh[len(outputs):])

    forward_impl.__signature__ = inspect.signature(forward, eval_str=True)
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward_impl, mutates_args=())
    op.register_fake(forward_fake)
    _decompose_static(name, op, forward_impl)

    def backward_impl(grads, inputs, saved, *attrs):
        return _fresh(backward(grads, inputs, saved, *attrs), [*grads, *inputs, *saved])

    backward_impl.__signature__ = inspect.signature(backward, eval_str=True)
    backward_op = torch.library.custom_op(f"{NAMESPACE}::{name}_backward", backward_impl, mutates_args=())
    backward_op.register_fake(backward_fake or _grads_like_inputs)
    _decompose_static(name, backward_op, backward_impl)

    arguments = op._opoverload._schema.arguments
    tensor_slots = [i for i, arg in enumerate(arguments) if _is_tensor_type(arg)]
    attr_slots = [i for i, arg in enumerate(arguments) if not _is_tensor_type(arg)]
    n_outputs = len(op._opoverload._schema.returns) - 1
    saved_outputs = tuple(saved_outputs)

    def setup_context(ctx, inputs, output):
        *outputs, saved = output
        ctx.save_for_backward(*(inputs[i] for i in tensor_slots), *(outputs[i] for i in saved_outputs), *saved)
        ctx.attrs = tuple(inputs[i] for i in attr_slots)

    def backward_formula(ctx, *grads):
        tensors = ctx.saved_tensors
        inputs = list(tensors[:len(tensor_slots)])
        grads_in = iter(backward_op(list(grads[:n_outputs]), inputs, list(tensors[len(tensor_slots):]), *ctx.attrs))
        result = [None] * len(arguments)
        for slot, t in zip(tensor_slots, inputs):
            if t is not None:
                result[slot] = next(grads_in)
        return tuple(result)

    op.register_autograd(backward_formula, setup_context=setup_context)
    REGISTERED[name] = op._opoverload
    return op._opoverload


def _grads_like_inputs(grads, inputs, saved, *attrs):
    return [torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in inputs if t is not None]


def reference_backward(reference: Callable, grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor | None],
                       *attrs) -> list[torch.Tensor]:
    """The backward of the PyTorch path: ``reference(*inputs, *attrs)`` (returning a tensor or a tuple of them, the
    outputs ``grads`` belong to) recomputed and differentiated by ``torch.func.vjp``. Returns the gradient of each
    present input, zeros for one the outputs do not depend on."""
    present = [t for t in inputs if t is not None]
    differentiable = [t.dtype.is_floating_point for t in present]

    def run(*leaves):
        it = iter(leaves)
        args = [None if t is None else next(it) for t in inputs]
        outputs = reference(*args, *attrs)
        return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)

    # torch.func rather than torch.autograd: an op's kernel runs below the autograd dispatch key, where a nested
    # autograd graph would not be recorded
    _, vjp = torch.func.vjp(run, *present)
    found = vjp(tuple(grads))
    return [g if ok else torch.zeros_like(t) for g, t, ok in zip(found, present, differentiable)]
