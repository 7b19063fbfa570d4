"""Small models built offline for plumbing tests (random weights, real file formats)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def scrfd_shaped_onnx(path: Path, size: int = 640, seed: int = 0) -> Path:
    """An ONNX graph with SCRFD's interface: one 1x3xHxW input and nine outputs
    (scores, boxes, keypoints at strides 8, 16, 32; two anchors per position), so that
    insightface's model zoo routes it to its SCRFD detector. Weights are random."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, outputs = [], [], []
    groups = {"score": 1, "bbox": 4, "kps": 10}
    names = {k: [] for k in groups}
    for stride in (8, 16, 32):
        for kind, width in groups.items():
            base = f"{kind}_{stride}"
            w = rng.normal(0, 0.01, size=(2 * width, 3, stride, stride)).astype(np.float32)
            inits.append(numpy_helper.from_array(w, base + "_w"))
            inits.append(numpy_helper.from_array(np.array([-1, width], dtype=np.int64), base + "_shape"))
            nodes.append(helper.make_node("Conv", ["input.1", base + "_w"], [base + "_conv"], strides=[stride, stride]))
            nodes.append(helper.make_node("Transpose", [base + "_conv"], [base + "_t"], perm=[0, 2, 3, 1]))
            out = base if kind != "score" else base + "_logits"
            nodes.append(helper.make_node("Reshape", [base + "_t", base + "_shape"], [out]))
            if kind == "score":
                nodes.append(helper.make_node("Sigmoid", [out], [base]))
            names[kind].append(base)
    for kind in ("score", "bbox", "kps"):  # insightface expects this output order
        for base in names[kind]:
            outputs.append(helper.make_tensor_value_info(base, TensorProto.FLOAT, [None, groups[kind]]))
    graph = helper.make_graph(nodes, "scrfd_shaped",
                              [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 3, size, size])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path
