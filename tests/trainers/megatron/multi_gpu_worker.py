"""Worker for test_megatron_gpu_multi: one SFT run under a given parallel layout.

Run by torchrun; writes the losses (and rank 0's synced weights' checksum) as JSON to argv[2].
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    import transformers

    from palaestra.trainers.algorithms.config import LossConfig
    from palaestra.trainers.batching import TrainBatch
    from palaestra.trainers.megatron.backend import MegatronBackend
    from palaestra.trainers.megatron.config import MegatronBackendConfig

    layout = json.loads(sys.argv[1])
    shape = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1024,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 64, "tie_word_embeddings": True, "initializer_range": 0.05}
    if layout.pop("deepseek", False):  # MLA, sigmoid routing with expert bias, shared expert
        cfg = transformers.DeepseekV3Config(
            vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, moe_intermediate_size=256,
            n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
            n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
            initializer_range=0.05)
    elif layout.pop("moe", False):
        # no auxiliary loss: it is computed over each rank's own tokens, so with it DP/EP runs
        # would differ from one GPU by design, not by a bug
        cfg = transformers.Qwen3MoeConfig(**shape, moe_intermediate_size=256, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=True,
                                          decoder_sparse_step=1, mlp_only_layers=[],
                                          router_aux_loss_coef=0.0)
    else:
        cfg = transformers.Qwen3Config(**shape)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 8192, (n,), generator=g) for n in (300, 500, 128, 700)]
    masks = [torch.cat([torch.zeros(1), torch.ones(len(s) - 1)]) for s in seqs]
    batch = TrainBatch(token_ids=seqs, loss_mask=masks)
    backend = MegatronBackend(cfg, MegatronBackendConfig(dtype="float32", lr=1e-3, **layout),
                              hf_state_dict=hf.state_dict())
    losses = [backend.train_step(batch, LossConfig(preset="sft"))["loss"] for _ in range(3)]
    from megatron.core import parallel_state as ps

    # each pipeline stage yields its own layers: add the stages up
    total = torch.tensor(sum(float(t.double().sum()) for bucket in
                             backend.iter_engine_weight_buckets() for _, t in bucket),
                         dtype=torch.float64, device=backend.device)
    torch.distributed.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    if torch.distributed.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump({"losses": losses, "weight_sum": float(total)}, f)


if __name__ == "__main__":
    main()
