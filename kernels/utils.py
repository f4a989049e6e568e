"""Helpers shared by every op: output allocation (with NaN poisoning for tests), input validation,
autocast decorators and the relative-error comparison used by the tests and benchmarks."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["FLOAT_DTYPES", "assert_close", "autocast_custom_bwd", "autocast_custom_fwd", "check_bool", "check_dtype",
           "check_same_device", "check_shape", "contiguous", "device_guard", "empty_output", "empty_output_like",
           "input_guard", "poison_outputs", "relative_error", "DEFAULT_TOLERANCES", "DirectLaunch", "aligned16", "cdiv",
           "heads_per_program", "jit_launch", "launch_options", "needs_grad", "next_pow2", "placeholder", "sm_count",
           "traced", "wave_slots"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
POISON_ENV = "VISIONSSM_POISON_OUTPUTS"
_poison = threading.local()


# ---------------------------------------------------------------------------------------------------------------
# Output allocation


# read once: an os.environ lookup per allocation costs more host time than the allocation itself
_POISON_BY_ENV = os.environ.get(POISON_ENV, "0") == "1"


def _poisoning() -> bool:
    forced = getattr(_poison, "enabled", None)
    return _POISON_BY_ENV if forced is None else forced


@contextlib.contextmanager
def poison_outputs(enabled: bool = True) -> Iterator[None]:
    """While active, :func:`empty_output` fills new buffers with NaN, so any element a kernel forgets to write
    shows up as NaN in the result (tests use this through the ``poison_outputs`` fixture)."""
    previous = getattr(_poison, "enabled", None)
    _poison.enabled = enabled
    try:
        yield
    finally:
        _poison.enabled = previous


def empty_output(shape: Sequence[int], *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Allocate a tensor every element of which the caller promises to write (NaN-filled while poisoning: inside
    :func:`poison_outputs`, or everywhere when ``VISIONSSM_POISON_OUTPUTS=1`` at import)."""
    if _poisoning() and dtype.is_floating_point:
        return torch.full(tuple(shape), float("nan"), device=device, dtype=dtype)
    return torch.empty(tuple(shape), device=device, dtype=dtype)


def empty_output_like(like: torch.Tensor) -> torch.Tensor:
    """:func:`empty_output` with ``like``'s shape, dtype and device (``torch.empty_like``: the cheapest allocation
    on the host, for ops whose launch work is the bottleneck)."""
    if _poisoning() and like.dtype.is_floating_point:
        return torch.full_like(like, float("nan"), memory_format=torch.contiguous_format)
    return torch.empty_like(like, memory_format=torch.contiguous_format)


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def placeholder(device: torch.device) -> torch.Tensor:
    """One never-read fp32 word per device, for the pointer arguments a launch does not use; launch plans keep it.

    It is allocated on a thread of its own: a CUDA-graph memory pool (``torch.compile(mode="reduce-overhead")``) takes
    the allocations of the thread that warms up or records the graph, and a word that outlives the graph must not be
    one of them (the graph's liveness check fails on it)."""
    word = _PLACEHOLDERS.get(device)
    if word is None:
        allocate = functools.partial(torch.empty, 1, device=device, dtype=torch.float32)
        if device.type == "cuda":
            worker = threading.Thread(target=lambda: _PLACEHOLDERS.setdefault(device, allocate()))
            worker.start()
            worker.join()
            word = _PLACEHOLDERS[device]
        else:
            word = _PLACEHOLDERS.setdefault(device, allocate())
    return word


def cdiv(a: int, b: int) -> int:
    """Ceiling division of plain integers, for launch shapes (``triton.cdiv`` is a JIT function: its host-side call
    costs microseconds per launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1): Triton block sizes."""
    return 1 << (max(1, n) - 1).bit_length()


def sm_count(device: torch.device, off_gpu: int) -> int:
    """The streaming multiprocessors of CUDA ``device``, which launch heuristics size grids by; ``off_gpu`` for other
    devices (Triton's interpreter on CPU), where each heuristic picks what its tests need."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return off_gpu


def wave_slots(setting: int | None, sms: int, per_sm: int, measured: bool) -> int:
    """Programs of a kernel the GPU runs at once, for the plans that balance a grid's last wave: ``setting`` when one
    is forced (0: no balancing), else ``per_sm`` (counted for one launch layout) times the SM count when ``measured``
    says the kernel runs that layout, else 0 (a layout whose count was not measured is not balanced)."""
    if setting is not None:
        return setting
    return sms * per_sm if measured else 0


def heads_per_program(H: int, BD: int, max_width: int = 128) -> int:
    """How many heads of width BD (a power of two) one program takes: the largest power of two dividing H whose
    heads together stay within ``max_width`` columns."""
    HB = 1
    while H % (2 * HB) == 0 and max_width >= 2 * HB * BD:
        HB *= 2
    return HB


# ---------------------------------------------------------------------------------------------------------------
# Validation: every public op checks its arguments and raises ValueError/TypeError naming the bad one.


def check_dtype(name: str, tensor: torch.Tensor, dtypes: Sequence[torch.dtype] = FLOAT_DTYPES) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(tensor.dtype).replace('torch.', '')}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in [``minimum``, ``maximum``]; TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if maximum is None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return value


def check_positive(name: str, value) -> float:
    """``value`` as a float if it is a finite number > 0 (not a bool); TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None], layout: str) -> None:
    """Check ``tensor.shape`` against ``expected`` (``None`` matches any size); ``layout`` names the axes."""
    if tensor.dim() != len(expected) or any(e is not None and s != e for s, e in zip(tensor.shape, expected)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
        raise ValueError(f"{name} must have shape {layout} = {want}, got {tuple(tensor.shape)}")


def check_layout(name: str, tensor: torch.Tensor, layout: str, nonempty: str) -> tuple[int, ...]:
    """The shape of an op's leading tensor, whose axes ``layout`` names (``"(B, T, H, K)"``); the axes listed in
    ``nonempty`` (``"B, T, H"``) must be at least 1. A ValueError naming ``name`` otherwise."""
    axes = layout.strip("()").split(", ")
    if tensor.dim() != len(axes):
        raise ValueError(f"{name} must have shape {layout}, got {tuple(tensor.shape)}")
    sizes = dict(zip(axes, tensor.shape))
    if any(sizes[axis] < 1 for axis in nonempty.split(", ")):
        raise ValueError(f"{name} must have {nonempty} >= 1, got shape {tuple(tensor.shape)}")
    return tuple(tensor.shape)


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    present = {k: t for k, t in tensors.items() if t is not None}
    devices = {k: t.device for k, t in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"all tensors must be on one device: {first_name} is on {first}, {name} is on {device}")
    return first


# ---------------------------------------------------------------------------------------------------------------
# Kernel-launch helpers (FLA's conventions)


_NO_DEVICE_SWITCH = contextlib.nullcontext()


def contiguous(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` made contiguous, ``None`` entries kept: the layout the kernels read."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether an op called on ``tensors`` (``None`` entries skipped) must record an autograd node: grad mode is on
    and one of them requires a gradient (otherwise the op runs its forward alone and saves nothing)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def device_guard(tensor: torch.Tensor | None):
    """A context making ``tensor``'s CUDA device current for kernel launches; a shared no-op context when there is
    nothing to switch (no tensor, a CPU tensor, or one GPU: skipping the switch saves two driver calls per launch)."""
    if tensor is not None and tensor.is_cuda and torch.cuda.device_count() > 1:
        return torch.cuda.device(tensor.device)
    return _NO_DEVICE_SWITCH


def input_guard(fn: Callable) -> Callable:
    """Make tensor arguments contiguous and run the launch on the tensors' CUDA device."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        with device_guard(next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_cuda),
                               None)):
            return fn(*args, **kwargs)

    return wrapper


autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type="cuda")
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type="cuda")


# ---------------------------------------------------------------------------------------------------------------
# Comparison


#: Relative-error bounds ‖actual − expected‖ / ‖expected‖ by the dtype the computation ran in.
DEFAULT_TOLERANCES = {
    torch.float64: 1e-10,
    torch.float32: 1e-3,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖₂ / ‖expected‖₂ in float64 (absolute error when ``expected`` is all zeros);
    ``inf`` when either side holds a NaN or an infinity."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        return float("inf")
    scale = e.norm().item()
    diff = (a - e).norm().item()
    return diff / scale if scale > 0 else diff


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                 tol: float | None = None, name: str = "tensor") -> None:
    """Assert shapes match and the relative error is within ``tol`` (default: :data:`DEFAULT_TOLERANCES` of
    ``dtype``, itself defaulting to ``actual.dtype``). NaN or infinity anywhere fails."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if tol is None:
        tol = DEFAULT_TOLERANCES[dtype or actual.dtype]
    err = relative_error(actual, expected)
    if not err <= tol:
        nan_count = int(torch.isnan(actual).sum())
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e} (NaNs in actual: {nan_count})")


def launch_options(num_warps: int, *, num_stages: int | None = None, max_registers: int | None = None) -> dict:
    """Triton launch options: ``num_warps``, and ``num_stages`` / a per-thread register cap (``maxnreg``) where
    given (``None``: Triton's default, the compiler's choice)."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return options


# ---------------------------------------------------------------------------------------------------------------
# Direct relaunch of compiled Triton kernels: at vision shapes eager calls are bound by host-side launch work


#: Relaunch compiled kernels directly (see :class:`DirectLaunch`). Cleared for good if this Triton's compiled-kernel
#: launcher turns out to take other arguments.
DIRECT_LAUNCH = True
_COMPILED_KERNEL: list = []  # [triton's CompiledKernel class or None], resolved on first use (Triton is lazy)
_LAUNCH_CONTEXT: list = []  # [(current device, current raw stream, Triton's runtime knobs)], resolved on first use


def _compiled_kernel_type():
    if not _COMPILED_KERNEL:
        try:
            from triton.compiler import CompiledKernel
        except ImportError:
            CompiledKernel = None  # noqa: N806
        _COMPILED_KERNEL.append(CompiledKernel)
    return _COMPILED_KERNEL[0]


def _launch_context() -> tuple | None:
    """The functions Triton's own launch path asks for the current device and its current stream (PyTorch's), and
    Triton's runtime knobs, where launch hooks are installed; ``None`` for a Triton without them."""
    if not _LAUNCH_CONTEXT:
        try:
            from triton import knobs
            from triton.runtime import driver

            active = driver.active
            _LAUNCH_CONTEXT.append((active.get_current_device, active.get_current_stream, knobs.runtime))
        except (ImportError, AttributeError):
            _LAUNCH_CONTEXT.append(None)
    return _LAUNCH_CONTEXT[0]


def launch_hooks_installed(runtime) -> bool:
    """Whether a launch enter or exit hook is installed in Triton's runtime knobs ``runtime`` (a profiler such as
    proton installs them; each is a chain of hooks in current Triton, a callable or ``None`` in older ones)."""
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(leave, "calls", leave))


def aligned16(*tensors: torch.Tensor | None) -> bool | None:
    """All data pointers (``None`` skipped) 16-byte aligned: what Triton assumes when it compiles a kernel for
    tensors from PyTorch's allocator. ``None`` for the stand-ins of ``torch.compile`` tracing, which have no data:
    :class:`DirectLaunch` then records its launch for the compiler (:func:`jit_launch`)."""
    bits = 0
    try:
        for t in tensors:
            if t is not None:
                bits |= t.data_ptr()
    except RuntimeError:  # a fake or functional tensor: raised only while tracing, so eager calls pay nothing
        return None
    return not bits & 15


def traced(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a stand-in of ``torch.compile`` / ``torch.export`` tracing (fake, or functional over
    fake): a registered op's body runs on those when the compiler takes its Triton launches in."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def jit_launch(kernel, grid: tuple, *, traced: bool):
    """``kernel[grid]``, or, while tracing, the same launch recorded for the compiler (``torch.library.wrap_triton``):
    Inductor then launches the kernel from its own generated code, with no custom-op call around it."""
    if traced:
        from torch.library import wrap_triton

        _memoize_write_analysis()
        return wrap_triton(kernel)[grid]
    return kernel[grid]


class _Unkeyed(Exception):
    pass


def _analysis_key(value):
    """What torch's write analysis reads of one launch argument: a traced tensor's dtype (it builds the kernel's IR
    from a stand-in tensor of that dtype), a symbolic size as a symbol, a plain value by type and value. Anything
    else is not memoised (a real tensor specialises the IR on its address; other objects would be kept alive)."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, FakeTensor):
        return ("tensor", value.dtype)
    if type(value).__name__ == "TensorBox" and hasattr(value, "get_dtype"):  # Inductor's IR of a tensor
        return ("tensor", value.get_dtype())
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
        return ("symbol",)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return (type(value), value)
    raise _Unkeyed


def _memoized(analyse: Callable) -> Callable:
    """``analyse`` (torch's ``identify_mutated_tensors(kernel, kwargs, tma_descriptor_metadata)``) answering once per
    JIT function and :func:`_analysis_key` of its arguments."""
    answers: dict = {}

    @functools.wraps(analyse)
    def identify_mutated_tensors(kernel, kwargs, tma_descriptor_metadata):
        # launch options wrap the JIT function in a one-config Autotuner, a new one per launch; torch analyses the
        # JIT function with the first config's arguments
        configs = getattr(kernel, "configs", None)
        jit = kernel.fn if configs is not None else kernel
        arguments = {**kwargs, **(configs[0].kwargs if configs else {})}
        try:
            key = (id(jit), tuple((name, _analysis_key(value)) for name, value in sorted(arguments.items())))
        except _Unkeyed:
            key = None
        if key is None or tma_descriptor_metadata:
            return analyse(kernel, kwargs, tma_descriptor_metadata)
        if key not in answers:  # the JIT function is kept with its answer, so its id is not reused
            answers[key] = (jit, list(analyse(kernel, kwargs, tma_descriptor_metadata)))
        return list(answers[key][1])

    return identify_mutated_tensors


@functools.cache
def _memoize_write_analysis() -> None:
    """Memoise torch's analysis of which tensors a recorded launch writes
    (``torch._higher_order_ops.triton_kernel_wrap.identify_mutated_tensors``). torch builds the kernel's Triton IR and
    walks it for every recorded launch, twice per compile, and a model repeats its launches block after block, so
    most of a compile's analyses repeat one made before. Its answer depends only on the kernel and on what
    :func:`_analysis_key` keeps of each argument, so equal keys share one analysis (:func:`_memoized`). A torch whose
    function is missing or takes other parameters is left as it is."""
    from torch._higher_order_ops import triton_kernel_wrap

    analyse = getattr(triton_kernel_wrap, "identify_mutated_tensors", None)
    parameters = ["kernel", "kwargs", "tma_descriptor_metadata"]
    if analyse is None or list(inspect.signature(analyse).parameters) != parameters:
        return
    triton_kernel_wrap.identify_mutated_tensors = _memoized(analyse)


class DirectLaunch:
    """One kernel launch with the grid, the trailing integer arguments, the constexprs and the options fixed.

    The first launch goes through Triton's JIT (``kernel[grid](...)``), which returns the compiled kernel; later
    launches call that compiled kernel's launcher ``run`` directly, with the arguments its own runner
    (``compiled[grid]``) passes it. That skips the JIT's per-call argument binding, specialization and cache-key
    work, and the runner's launch metadata and empty hook chains: most of an eager call's host time at vision shapes,
    where calls are host-bound. Where a launch hook is installed (a profiler), the runner is called instead, so that
    the hook sees every launch.

    The compiled kernel is only valid for what the JIT specialized on, so the caller must keep one object per device,
    tensor dtypes and ``None``-ness, integers, constexprs and options (Comba's launch plans are keyed so); the
    tensors' 16-byte alignment is checked per call (``aligned``), and the direct path is taken only for aligned
    tensors with a kernel compiled for aligned tensors. Constexprs must be the kernel's trailing parameters (given in
    any order); otherwise every launch goes through the JIT."""

    __slots__ = ("kernel", "grid", "dims", "kwargs", "args_tail", "runner", "direct", "run", "function", "metadata")

    def __init__(self, kernel, grid: tuple, dims: tuple, constexprs: dict, options: dict):
        names = list(getattr(kernel, "arg_names", None) or [])
        ordered = {name: constexprs[name] for name in names if name in constexprs}
        self.kernel = kernel
        self.grid = (*grid, 1, 1)[:3]  # the compiled kernel's launcher indexes all three grid axes
        self.dims = dims
        self.kwargs = {**constexprs, **options}
        self.args_tail = (*dims, *ordered.values())
        self.runner = self.run = self.function = self.metadata = None
        # the direct launcher takes every kernel argument positionally, constexprs included, in signature order
        self.direct = (_compiled_kernel_type() is not None and len(ordered) == len(constexprs)
                       and names[len(names) - len(ordered):] == list(ordered))

    def __call__(self, aligned: bool | None, *args) -> None:
        """Launch on ``args``. ``aligned``: :func:`aligned16` of tensors of this launch, never a literal: its ``None``
        (traced tensors) is what records the launch for the compiler instead of running it."""
        global DIRECT_LAUNCH
        runner = self.runner
        if runner is not None and aligned:
            try:
                context = _launch_context()
                if context is None or launch_hooks_installed(context[2]):
                    runner(*args, *self.args_tail)
                else:
                    grid = self.grid
                    self.run(grid[0], grid[1], grid[2], context[1](context[0]()), self.function, self.metadata,
                             None, None, None, *args, *self.args_tail)
                return
            except (TypeError, SystemError, IndexError):  # argument parsing: another Triton's calling convention
                if any(isinstance(a, torch.Tensor) and traced(a) for a in args):  # a caller's bug, not Triton's
                    raise TypeError(f"{self.kernel.fn.__name__}: traced tensors launched with aligned={aligned!r}; "
                                    "pass aligned16(...) of the launch's tensors (None while traced)") from None
                DIRECT_LAUNCH = False
                self.runner = None
        if aligned is None:  # tracing (see aligned16): the compiler launches the kernel from its own code
            self._record(*args)
            return
        compiled = self.kernel[self.grid](*args, *self.dims, **self.kwargs)
        if aligned and self.direct and DIRECT_LAUNCH and isinstance(compiled, _compiled_kernel_type()):
            self.runner = compiled[self.grid]  # also loads the compiled module: function and metadata exist from here
            self.run, self.function, self.metadata = compiled.run, compiled.function, compiled.packed_metadata

    def _record(self, *args) -> None:
        # the plan's never-read placeholder is a real tensor, which a trace must not capture: a traced word instead;
        # a register cap is not a launch option the compiler's Triton wrapper takes
        words = {id(word) for word in _PLACEHOLDERS.values()}
        args = [torch.empty(1, device=a.device, dtype=a.dtype) if id(a) in words else a for a in args]
        kwargs = {k: v for k, v in self.kwargs.items() if k != "maxnreg"}
        jit_launch(self.kernel, self.grid, traced=True)(*args, *self.dims, **kwargs)
