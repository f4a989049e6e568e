"""What a model keeps for its backward: every tensor autograd saves during one training forward, with its shape,
dtype, bytes and the module and source line that saved it, de-duplicated by storage.

    python -m visionssm.benchmark.memory comba_vision_S deit_small_patch16_224 --img-size 1024
    python -m visionssm.benchmark.memory gka_vision_T --img-size 512 --dtype bf16 --grad-checkpointing

The saved tensors are what a training step holds between its forward and its backward, so their bytes are the part
of the peak memory that grows with the batch (the rest is weights, gradients, optimizer state and the backward's
own temporaries). Per image is measured, not divided: a second forward with one image more, minus the first. They
are recorded through ``torch.autograd.graph.saved_tensors_hooks``: a view saves its base's storage once, and
parameters (saved by every linear layer) are counted apart. On a CPU the Triton kernels run in Triton's interpreter
with ``--kernels triton`` and ``TRITON_INTERPRET=1`` in the environment (what a GPU saves; slow at large images) and
the PyTorch reference otherwise (``--kernels torch``: the reference ops save their own intermediates, not the
kernels'). CPU autocast keeps PyTorch's LayerNorm where CUDA autocast takes visionssm's kernels, so bf16 on a CPU is
close to, not exactly, a GPU's layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["SavedTensor", "build_parser", "group_savers", "main", "saved_tensors", "summarize"]

# frames of these files are the machinery between a layer and the op that saved, not the saver
_PLUMBING = (f"torch{os.sep}autograd{os.sep}", f"torch{os.sep}utils{os.sep}checkpoint", f"torch{os.sep}_ops.py",
             f"torch{os.sep}_library{os.sep}", f"torch{os.sep}amp{os.sep}", "contextlib.py")


@dataclasses.dataclass
class SavedTensor:
    """One storage autograd keeps for the backward (the first save of it; ``saves`` counts them all)."""

    module: str  #: qualified name of the innermost module whose forward saved it ('' for the model itself)
    module_type: str
    site: str  #: file:line (function) of the innermost call that is not autograd's own machinery
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  #: bytes of the whole storage (a view of a larger tensor counts its base)
    saves: int = 1  #: how many saves share this storage
    parameter: bool = False  #: the storage of a parameter or buffer (not an activation)


def _short_path(filename: str) -> str:
    parts = Path(filename).parts
    for anchor in ("site-packages", "visionssm", "kernels", "torch", "timm"):
        if anchor in parts:
            index = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[index + (anchor == "site-packages"):])
    return "/".join(parts[-2:])


def _saver(frame, module_names: dict[int, str]) -> tuple[str, str, str]:
    """(module name, module type, site) of the innermost frames above the saved-tensor hook."""
    import torch

    site = None
    while frame is not None:
        filename = frame.f_code.co_filename
        relayed = frame.f_code.co_name == "pack" and filename.endswith(f"layers{os.sep}common.py")  # observe_saves
        if site is None and not relayed and not any(part in filename for part in _PLUMBING):
            site = f"{_short_path(filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in module_names:
            return module_names[id(owner)], type(owner).__name__, site or "?"
        frame = frame.f_back
    return "", "", site or "?"


def saved_tensors(model, images, *, autocast_dtype=None, target=None) -> list[SavedTensor]:
    """Run one training forward of ``model`` on ``images`` (and a cross-entropy loss on ``target`` when given) and
    return every storage autograd saved for the backward, in the order first saved. ``autocast_dtype``: run under
    autocast of the images' device type in that dtype. Nothing is differentiated."""
    import torch

    from visionssm.layers.common import observe_saves

    module_names = {id(m): name for name, m in model.named_modules()}
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}
    records: dict[tuple, SavedTensor] = {}
    keep = []  # the saved tensors stay alive until the end, so no storage address is reused for another

    def pack(tensor):
        if tensor.layout != torch.strided or not isinstance(tensor, torch.Tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr(), storage.nbytes())
        if key in records:
            records[key].saves += 1
        else:
            module, module_type, site = _saver(sys._getframe(1), module_names)
            records[key] = SavedTensor(module, module_type, site, tuple(tensor.shape),
                                       str(tensor.dtype).replace("torch.", ""), storage.nbytes(),
                                       parameter=storage.data_ptr() in own)
            keep.append(tensor)
        return tensor

    was_training = model.training
    model.train()
    try:
        # observe_saves: a layer's own saved-tensor hooks (recomputed kernel inputs) hide its other saves from ours
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observe_saves(pack), \
                torch.autocast(images.device.type, dtype=autocast_dtype or torch.float32,
                               enabled=autocast_dtype is not None):
            out = model(images)
            if target is not None:
                torch.nn.functional.cross_entropy(out.float(), target)
    finally:
        model.train(was_training)
    return list(records.values())


def summarize(records: Iterable[SavedTensor]) -> dict:
    """Total activation bytes (parameters apart), parameter bytes saved, and the counts."""
    records = list(records)
    acts = [r for r in records if not r.parameter]
    return {"activation_bytes": sum(r.nbytes for r in acts), "activation_tensors": len(acts),
            "parameter_bytes": sum(r.nbytes for r in records if r.parameter)}


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def group_savers(records: Iterable[SavedTensor]) -> list[dict]:
    """Activation records grouped by (module name with block indices as ``*``, module type, site, shape, dtype),
    largest total first: one line per kind of save however many blocks repeat it."""
    groups: dict[tuple, dict] = {}
    for r in records:
        if r.parameter:
            continue
        key = (_pattern(r.module), r.module_type, r.site, r.shape, r.dtype)
        entry = groups.setdefault(key, {"module": key[0], "module_type": r.module_type, "site": r.site,
                                        "shape": r.shape, "dtype": r.dtype, "count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += r.nbytes
    return sorted(groups.values(), key=lambda g: -g["bytes"])


def build_parser() -> argparse.ArgumentParser:
    from visionssm.utils.cli import ArgumentParser

    p = ArgumentParser(prog="python -m visionssm.benchmark.memory", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="timm model names (visionssm's or timm's)")
    p.add_argument("--img-size", type=int, default=224, help="square input resolution (default 224)")
    p.add_argument("--batch-size", "-b", type=int, default=1, help="images per forward (default 1); the bytes per "
                   "image come from a second forward with one more")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bf16/fp16: autocast in that dtype")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--kernels", choices=("triton", "torch"), default=None,
                   help="CPU: 'triton' runs the Triton kernels in the interpreter (what a GPU saves), 'torch' the "
                   "PyTorch reference (default: torch on CPU, triton on CUDA)")
    p.add_argument("--grad-checkpointing", action="store_true", help="model.set_grad_checkpointing(True) first")
    p.add_argument("--model-kwargs", type=json.loads, default={}, metavar="JSON",
                   help="extra timm.create_model kwargs, e.g. '{\"window_size\": null}'")
    p.add_argument("--top", type=int, default=12, help="savers listed per model (default 12)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every model's records to PATH")
    return p


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _run(args: argparse.Namespace) -> int:
    import torch

    import visionssm.models  # noqa: F401 - registers the models (a command's process skips the package's import)
    from visionssm import kernels
    from visionssm.benchmark.config import DTYPES
    from visionssm.benchmark.measure import timm_model
    from visionssm.kernels.utils import check_int

    check_int("img_size", args.img_size, 1)
    check_int("batch_size", args.batch_size, 1)
    if str(args.dtype).lower() not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {args.dtype!r}")
    dtype = DTYPES[str(args.dtype).lower()]
    device = torch.device(args.device)
    backend = args.kernels or ("torch" if device.type == "cpu" else "triton")
    report = {}
    for name in args.models:
        torch.manual_seed(0)
        model = timm_model(name, args.img_size, pretrained=False, **args.model_kwargs).to(device)
        if args.grad_checkpointing:
            model.set_grad_checkpointing(True)
        runs = []
        # a second forward with one image more: the difference is what one image adds, whatever does not grow with
        # the batch (autocast's weight copies, padded weights) stays out of it
        for batch in (args.batch_size, args.batch_size + 1):
            images = torch.randn(batch, 3, args.img_size, args.img_size, device=device)
            target = torch.randint(0, max(1, getattr(model, "num_classes", 1)), (batch,), device=device)
            with kernels.backend(backend):
                runs.append(saved_tensors(model, images, autocast_dtype=None if dtype == torch.float32 else dtype,
                                          target=target if getattr(model, "num_classes", 0) else None))
        records = runs[0]
        totals = summarize(records)
        per_image = summarize(runs[1])["activation_bytes"] - totals["activation_bytes"]
        fixed = totals["activation_bytes"] - args.batch_size * per_image
        print(f"# {name} {args.img_size}px batch {args.batch_size} {str(dtype).replace('torch.', '')}"
              f"{' autocast' if dtype != torch.float32 else ''} kernels={backend}"
              f"{' grad-checkpointing' if args.grad_checkpointing else ''}: {_mib(totals['activation_bytes'])} saved "
              f"in {totals['activation_tensors']} tensors: {_mib(per_image)} per image and {_mib(fixed)} that do "
              f"not grow with the batch; parameters saved {_mib(totals['parameter_bytes'])}")
        for g in group_savers(records)[:args.top]:
            print(f"  {_mib(g['bytes']):>13} {100 * g['bytes'] / max(1, totals['activation_bytes']):5.1f}%  "
                  f"{g['count']:3d} x {str(g['shape']):<22} {g['dtype']:<9} {g['module']} ({g['module_type']})  "
                  f"{g['site']}")
        report[name] = {**totals, "bytes_per_image": per_image, "fixed_bytes": fixed, "groups": group_savers(records)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, "models": report}, indent=2, default=str) + "\n")
        print("wrote", Path(args.json).resolve())
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: exit status 0, 2 with one error line for a bad argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
