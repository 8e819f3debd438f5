"""Run by test_distill.py under `torch.distributed.run --nproc_per_node 2`: the same distill() call as on one
process, data-parallel over gloo; each rank writes its student's parameters for the test to compare."""

import sys

import torch
import transformers

from headkit.recipes.distill import distill
from headkit.runs.objectives import CausalLMObjective


def main(out: str) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
    )
    teacher = transformers.LlamaForCausalLM(config).eval()
    student = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    examples = [
        {
            "input_ids": torch.randint(0, 64, (8,), generator=generator),
            "attention_mask": torch.ones(8, dtype=torch.long),
        }
        for _ in range(16)
    ]
    result = distill(
        student,
        teacher,
        examples,
        objective=CausalLMObjective(),
        steps=3,
        lr=1e-2,
        batch_size=2,
        ddp_backend="gloo",
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    torch.save(
        {"state": result.model.state_dict(), "world": world, "steps": result.steps}, f"{out}/rank{rank}.pt"
    )


if __name__ == "__main__":
    main(sys.argv[1])
