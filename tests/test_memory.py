"""What a training forward keeps for the backward (visionssm.benchmark.memory), and per-block gradient checkpointing
lowering it for every family."""

from __future__ import annotations

import json

import pytest
import timm
import torch

from visionssm.benchmark import memory
from visionssm.models import FAMILIES  # importing the package registers every family

_HIERARCHICAL = {"depths": (1, 1, 2, 2), "dims": 8, "stem_dim": 8, "num_heads": (1, 1, 2, 2),
                 "window_size": (8, 8, 4, 2), "drop_path_rate": 0.0, "num_classes": 5}
#: family -> (a registered model of it, kwargs of a small network, input side)
SMALL = {
    "mamba_vision": ("mamba_vision_T", _HIERARCHICAL, 64),
    "gka_vision": ("gka_vision_T", _HIERARCHICAL, 64),
    "echo_vision": ("echo_vision_T", _HIERARCHICAL, 64),
    "comba_vision": ("test_comba_vision", {"img_size": 64, "depth": 4, "num_classes": 5}, 64),
}


class _Twice(torch.nn.Module):
    """Saves two views of one storage (x·x saves x twice) and a parameter (the linear layer's weight)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)

    def forward(self, x):
        h = self.proj(x)
        return (h[:, :2] * h[:, 2:]).sum(-1)


def test_saved_tensors_dedups_storages_and_names_the_saver():
    model = _Twice()
    x = torch.randn(3, 6, requires_grad=True)  # its gradient needs the weight saved
    records = memory.saved_tensors(model, x)
    activations = [r for r in records if not r.parameter]
    # x (by the linear layer) and h (both halves share one storage): two storages, h's counted once, whole
    assert sorted(r.nbytes for r in activations) == [3 * 4 * 4, 3 * 6 * 4]
    h = next(r for r in activations if r.nbytes == 3 * 4 * 4)
    assert h.saves == 2 and h.module == "" and h.module_type == "_Twice" and "test_memory.py" in h.site
    x_saved = next(r for r in activations if r.nbytes == 3 * 6 * 4)
    assert x_saved.module == "proj" and x_saved.module_type == "Linear" and x_saved.shape == (3, 6)
    assert any(r.parameter for r in records)  # the weight, apart from the activations
    assert memory.summarize(records)["activation_bytes"] == 3 * 6 * 4 + 3 * 4 * 4
    assert model.training  # restored


def test_groups_collapse_block_indices_largest_first():
    record = lambda module, nbytes: memory.SavedTensor(module, "Linear", "f.py:1 (g)", (2, 3), "float32", nbytes)
    records = [record("blocks.0.fc", 10), record("blocks.1.fc", 10), record("head", 15),
               memory.SavedTensor("head", "Linear", "f.py:2 (g)", (3,), "float32", 99, parameter=True)]
    groups = memory.group_savers(records)
    assert [(g["module"], g["count"], g["bytes"]) for g in groups] == [("blocks.*.fc", 2, 20), ("head", 1, 15)]


def test_every_family_has_a_small_network():
    assert set(SMALL) == set(FAMILIES)


def _activation_bytes(model, side: int, checkpointing: bool) -> int:
    model.set_grad_checkpointing(checkpointing)
    return memory.summarize(memory.saved_tensors(model, torch.randn(2, 3, side, side)))["activation_bytes"]


@pytest.mark.parametrize("family", sorted(SMALL))
def test_grad_checkpointing_keeps_far_less_for_the_backward(family, reference_path):
    name, kwargs, side = SMALL[family]
    model = timm.create_model(name, **kwargs)
    plain = _activation_bytes(model, side, False)
    checkpointed = _activation_bytes(model, side, True)
    assert checkpointed < 0.4 * plain, f"{name}: {checkpointed} bytes checkpointed against {plain}"


def test_grad_checkpointing_with_global_mixer_same_gradients(reference_path):
    model = timm.create_model("gka_vision_T", global_mixer=True, **_HIERARCHICAL)
    x = torch.randn(2, 3, 80, 80)  # stride-16 map 5x5: the attention block pads it to 8x8 windows
    model(x).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)
    assert _activation_bytes(model, 80, True) < 0.4 * _activation_bytes(model, 80, False)


def test_command_prints_top_savers_and_writes_json(tmp_path, capsys):
    path = tmp_path / "saved.json"
    status = memory.main(["test_comba_vision", "--img-size", "64", "--batch-size", "2", "--kernels", "torch",
                          "--top", "3", "--json", str(path), "--model-kwargs", '{"depth": 1}'])
    assert status == 0
    out = capsys.readouterr().out
    assert "# test_comba_vision 64px batch 2 float32 kernels=torch" in out and "per image and" in out
    assert len([line for line in out.splitlines() if line.startswith("  ")]) == 3
    report = json.loads(path.read_text())["models"]["test_comba_vision"]
    assert report["bytes_per_image"] > 0 and report["fixed_bytes"] >= 0  # fp32: no weight copies, but padded ones
    assert report["activation_bytes"] == 2 * report["bytes_per_image"] + report["fixed_bytes"]
    assert sum(g["bytes"] for g in report["groups"]) == report["activation_bytes"]


def test_command_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        memory.main(["test_comba_vision", "--img-size", "0"])
    assert exit_info.value.code == 2 and "img_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory.main(["test_comba_vision", "--dtype", "int8"])
    assert "dtype" in capsys.readouterr().err


def test_comba_vision_recompute_state_keeps_less(reference_path):
    name, kwargs, side = SMALL["comba_vision"]
    model = timm.create_model(name, **kwargs)
    lean = timm.create_model(name, recompute_state=True, **kwargs)
    assert all(block.mixer.recompute_state for block in lean.blocks)
    lean.load_state_dict(model.state_dict())
    assert _activation_bytes(lean, side, False) < 0.8 * _activation_bytes(model, side, False)
