"""Small models built offline for plumbing tests (random weights, real file formats)."""

from __future__ import annotations

import fcntl
import os
import shutil
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


def tiny_sd_img2img(path: Path, seed: int = 0) -> Path:
    """A randomly initialised, tiny Stable Diffusion img2img pipeline saved with
    save_pretrained: every file a real model directory has, built offline."""
    import json

    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionImg2ImgPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tokdir = path.parent / (path.name + "-tokenizer-src")
    tokdir.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in range(33, 127):
        vocab.setdefault(chr(c), len(vocab))
        vocab.setdefault(chr(c) + "</w>", len(vocab))
    (tokdir / "vocab.json").write_text(json.dumps(vocab))
    (tokdir / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(tokdir / "vocab.json"), str(tokdir / "merges.txt"), model_max_length=77)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, attention_head_dim=2, norm_num_groups=4)
    vae = AutoencoderKL(
        block_out_channels=(8, 16), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, sample_size=32)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=16, intermediate_size=32, layer_norm_eps=1e-5,
        num_attention_heads=2, num_hidden_layers=2, vocab_size=len(vocab), max_position_embeddings=77))
    pipe = StableDiffusionImg2ImgPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                          scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None,
                                          requires_safety_checker=False)
    pipe.save_pretrained(str(path))
    return path


def shared_tiny_sd(tmp_path_factory, seed: int = 0) -> Path:
    """tiny_sd_img2img built once per test session and shared, read only, by every module and
    pytest-xdist worker that asks: each build imports torch, diffusers and transformers in the
    test process (5 s of CPU alone, several times that on a loaded machine), and eight modules
    built their own. Built aside and renamed into place under a lock, so that no reader sees
    half a model."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # workers' temp dirs share a parent
    path = root / f"tiny-sd-{seed}"
    with open(root / f"tiny-sd-{seed}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_dir():
            aside = root / f"tiny-sd-{seed}.building-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            tiny_sd_img2img(aside / "tiny-sd", seed)
            os.rename(aside / "tiny-sd", path)
            shutil.rmtree(aside, ignore_errors=True)
    return path
