"""Reading weights from a file: the one reader the models, the ImageNet trainer and the tracker share.

It is timm's ``load_state_dict`` (safetensors or torch files; the state dict bare or under ``state_dict`` /
``model``; ``module.`` and ``_orig_mod.`` prefixes removed) with torch's ``weights_only`` safety kept on.
"""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path

import torch
from timm.models import load_state_dict as _timm_load_state_dict

from visionssm.utils.cli import UserError, UserFileError

__all__ = ["UnreadableCheckpointError", "read_state_dict"]


class UnreadableCheckpointError(UserError, RuntimeError):
    """A weights file that exists but cannot be read as one (not a checkpoint, truncated, or holding code)."""



def read_state_dict(path: str | os.PathLike, *, use_ema: bool = False) -> dict[str, torch.Tensor]:
    """The state dict stored in ``path`` (``.safetensors``, ``.pth``, ``.pth.tar``, ``.pkl``), on the CPU.

    Args:
        path: The weights file.
        use_ema: Prefer the EMA copy (``state_dict_ema`` / ``model_ema``) when the file holds one; by default the
            weights the file's own training evaluated (``state_dict`` / ``model``) are taken.
    """
    path = Path(path)
    if not path.is_file():
        raise UserFileError(f"checkpoint {path} not found")
    # NVIDIA's MambaVision files carry their training arguments as an argparse.Namespace next to the weights:
    # that one class is allowed, nothing else, so loading never runs code from the file.
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return _timm_load_state_dict(str(path), use_ema=use_ema, device="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnreadableCheckpointError(
            f"{path} holds objects other than tensors and training args, so it is not loaded with "
            "weights_only=True. If you trust the file, allow the listed classes with "
            "torch.serialization.add_safe_globals([...]) and retry.") from exc
    except Exception as exc:  # unpickling arbitrary bytes can fail with almost any exception type
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise UnreadableCheckpointError(f"checkpoint {path} cannot be read as a weights file "
                                        f"({first_line[:200]})") from exc
