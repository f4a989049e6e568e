"""The registered ops traced through as ``torch.compile`` traces them on a GPU, checked without one.

Under ``torch.compile`` a registered op called on CUDA tensors with static shapes is traced through
(``library._decompose_static``): AOTAutograd runs its body on traced tensors and every Triton launch is recorded with
``torch.library.wrap_triton``. This script does the same on CPU with fake CUDA tensors: tiny models of each family
traced whole in eval mode, and each registered op their training step calls traced forward (keeping what its backward
reads) and backward. For every graph it reports a launch that ran instead of being recorded (the trace fails on a
traced tensor's data pointer, as it does on a GPU), an op left whole, and a recorded launch whose analysed writes name
an argument its kernel does not store to (its kernel module's ``WRITES``; Inductor clones those on every call) or
one tensor twice (each clone replaces the tensor in turn, so the last one wins)::

    python -m tools.traced_check echo_vision_T comba_vision_T

Run it with the torch and Triton of the GPU machine (``PYTHONPATH`` to a side install works) to see what they record.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
import types

os.environ.pop("TRITON_INTERPRET", None)  # the launches must be JIT functions, which wrap_triton records
os.environ.pop("VISIONSSM_KERNELS", None)  # CUDA tensors take the kernels

import torch  # noqa: E402
import triton  # noqa: E402

from tools import inductor_check  # noqa: E402


class _Driver(inductor_check._Driver):
    # what a launch that is not recorded asks for before it reads its tensors' data pointers
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _problems(graph) -> list[str]:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from visionssm.kernels import library

    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    found = []
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if getattr(node.target, "namespace", None) == library.NAMESPACE:
            found.append(f"{node.target} kept whole")
        if node.target is not wrapper:
            continue
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        jit = getattr(kernel, "fn", kernel)  # num_warps etc. wrap the JIT function in an Autotuner
        arguments, cloned = node.kwargs["kwargs"], node.kwargs["tensors_to_clone"]
        name, extra = jit.fn.__name__, set(cloned) - (inductor_check.declared_writes(jit) or set())
        if extra:
            found.append(f"{name}: {sorted(extra)} taken as written")
        if len({arguments[n] for n in cloned}) < len(cloned):
            found.append(f"{name}: one tensor passed to two written arguments of {sorted(cloned)}")
    return found


def _launches(graph) -> int:
    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    return sum(node.target is wrapper for node in graph.graph.nodes)


def _spec(value):
    """A tensor as (shape, stride, dtype) to rebuild it from, lists searched; other values as they are."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)) and any(torch.is_tensor(t) for t in value):
        return [_spec(t) for t in value]
    return value


def _is_tensor_spec(spec) -> bool:
    return isinstance(spec, tuple) and len(spec) == 4 and spec[0] == "tensor"


def _tensor_specs(specs) -> list:
    return [s for spec in specs for s in (_tensor_specs(spec) if isinstance(spec, list) else [spec])
            if _is_tensor_spec(s)]


def _op_step(op, specs):
    """A function of the call's tensors running ``op`` and its backward as its autograd formula does."""
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(op)

    def step(*tensors):
        fresh = iter(tensors)

        def fill(spec):
            if isinstance(spec, list):
                return [fill(s) for s in spec]
            return next(fresh) if _is_tensor_spec(spec) else spec

        args = [fill(spec) for spec in specs]
        output = op(*args)
        ctx = types.SimpleNamespace()
        ctx.save_for_backward = lambda *saved: setattr(ctx, "saved_tensors", saved)
        opdef._setup_context_fn(ctx, tuple(args), output)
        grads = [torch.randn_like(t) for t in output[:-1]]  # the saved list, the last output, takes no gradient
        return [g for g in opdef._backward_fn(ctx, *grads, None) if torch.is_tensor(g)]

    return step


class _Calls(torch.overrides.TorchFunctionMode):
    """The distinct calls of the registered forward ops, by op and argument layout."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from visionssm.kernels import library

        if getattr(func, "namespace", None) == library.NAMESPACE and func in library.REGISTERED.values():
            self.calls.setdefault((func._name, repr([_spec(a) for a in args])), (func, [_spec(a) for a in args]))
        return func(*args, **(kwargs or {}))


def check(presets: dict) -> dict:
    """{"<model> eval" / "<model> train": {"problems": [...], "launches": {graph: recorded launches}}} for
    ``presets`` ({name: (timm.create_model keyword arguments, input side)})."""
    import timm
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode

    import visionssm  # noqa: F401
    from visionssm.kernels import utils

    triton.runtime.driver.set_active(_Driver())
    torch.cuda.device_count = lambda: 1  # device_guard: no device switch
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=132)
    # the models and public functions take what they take under torch.compile (the registered ops among them)
    torch.compiler.is_compiling = lambda: True
    mode = FakeTensorMode()
    with mode:  # the plans' never-read word: a real tensor on a GPU, which every recorded launch replaces
        utils._PLACEHOLDERS[torch.device("cuda", 0)] = torch.empty(1, device="cuda")
    graphs = []

    def keep(graph, _):
        graphs.append(graph)
        return graph

    report = {}
    for name, (kwargs, side) in presets.items():
        model = timm.create_model(name, num_classes=10, **kwargs)
        with mode:
            state = {key: mode.from_tensor(t).cuda().requires_grad_(t.requires_grad)
                     for key, t in [*model.named_parameters(), *model.named_buffers()]}
            x = torch.randn(2, 3, side, side, device="cuda")

        def run(state, x, model=model):
            return torch.func.functional_call(model, state, (x,))

        entry = report[f"{name} eval"] = {"problems": [], "launches": {}}
        graphs.clear()
        try:
            with mode, torch.no_grad():
                aot_function(run, fw_compiler=keep)(state, x)
        except Exception:  # noqa: BLE001 - reported per model
            entry["problems"].append("trace failed: " + traceback.format_exc(limit=-4))
        entry["problems"] += [p for graph in graphs for p in _problems(graph)]
        entry["launches"]["forward"] = sum(_launches(graph) for graph in graphs)

        # each op of the training step, traced with what its backward reads kept and its backward (autograd on fake
        # CUDA tensors needs a GPU, so the backward ops are called as the op's autograd formula calls them)
        entry = report[f"{name} train"] = {"problems": [], "launches": {}}
        calls = _Calls()
        with mode, calls:
            model.train()
            run(state, x)
        for (op_name, layout), (op, specs) in calls.calls.items():
            graphs.clear()
            try:
                with mode:
                    tensors = [torch.empty_strided(s[1], s[2], dtype=s[3], device="cuda").normal_()
                               for s in _tensor_specs(specs)]
                    aot_function(_op_step(op, specs), fw_compiler=keep)(*tensors)
            except Exception:  # noqa: BLE001 - reported per op call
                entry["problems"].append(f"{op_name} trace failed: " + traceback.format_exc(limit=-4))
            entry["problems"] += [f"{op_name}: {p}" for graph in graphs for p in _problems(graph)]
            entry["launches"][f"{op_name} {layout}"] = sum(_launches(graph) for graph in graphs)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="timm model names (default: the T model of every family)")
    parser.add_argument("--presets", help="JSON {name: [create_model keyword arguments, input side]}")
    args = parser.parse_args(argv)
    presets = json.loads(args.presets) if args.presets else {
        name: inductor_check.default_preset(name) for name in args.models or inductor_check.default_models()}
    report = check(presets)
    print(f"torch {torch.__version__}, Triton {triton.__version__}")
    for key, entry in report.items():
        print(f"{key}: {sum(entry['launches'].values())} launches recorded, {len(entry['problems'])} problems")
        for problem in entry["problems"]:
            print("    " + problem.strip().replace("\n", "\n    "))
    return int(any(entry["problems"] for entry in report.values()))


if __name__ == "__main__":
    raise SystemExit(main())
