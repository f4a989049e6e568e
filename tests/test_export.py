"""ONNX export of the hierarchical backbones on the reference path, checked with onnxruntime.

The official MambaVision cannot be exported (its scan is a custom CUDA op); here the kernels' PyTorch path is taken
while exporting (visionssm.kernels.dispatch), so ``torch.onnx.export`` (the torch.export-based exporter, which needs
``onnxscript``) gives a graph that onnxruntime runs on CPU with PyTorch's outputs.
"""

from __future__ import annotations

import pytest
import timm
import torch

# `import visionssm` does not register the models yet (wired at integration): import the model modules explicitly.
import visionssm.models.gka_vision  # noqa: F401
import visionssm.models.mamba_vision  # noqa: F401

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")


# Each family on the T preset with depths (1, 1, 2, 2): every block type (conv blocks, then per token stage a mixer
# block and an attention block); the exported graph grows with every further block. The exact ridge solve's loops over
# chunks and key columns unroll into the graph (each GKA chunk lengthens the export): gka_vision's 9x9
# windows pad stage 3's 14x14 map to 18x18, windows of 81 tokens, two chunks with an odd tail (the state carried from
# chunk to chunk); stage 4 keeps its 7x7 window, one chunk of 49.
_EXPORTED = {"depths": (1, 1, 2, 2)}


@pytest.mark.parametrize("model_name,kwargs", [
    ("mamba_vision_T", _EXPORTED),
    pytest.param("gka_vision_T", {**_EXPORTED, "window_size": (8, 8, 9, 7)}, marks=pytest.mark.slow),
])
def test_onnx_export_matches_pytorch(model_name, kwargs, tmp_path, reference_path):
    model = timm.create_model(model_name, **kwargs).eval()
    x = torch.randn(2, 3, 224, 224)
    path = tmp_path / f"{model_name}.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True, input_names=["images"], output_names=["logits"])
    onnx.checker.check_model(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"images": x.numpy()})
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-4, atol=1e-4)
