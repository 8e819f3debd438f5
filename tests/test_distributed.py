"""Data-parallel training: two CPU processes (torch.distributed, gloo) run train_causal_lm under DDP and end with
identical parameters, although each rank trained on its own batches."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
STEPS = 4
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_on_rank(rank: int, port: int, corpus_dir: str, out_dir: str) -> None:
    """One process: join the group, train a tiny hybrid model with DDP, save its parameters and losses."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        from headkit.train import train_causal_lm

        initial_seed = 100 + rank  # different initialisations: DDP must broadcast rank 0's weights
        result = train_causal_lm(
            {**TINY, "layer_types": ["linear", "softmax"]},
            corpus_dir,
            steps=STEPS,
            batch_size=2,
            seq_len=16,
            lr=1e-2,
            eval_tokens=0,
            seed=initial_seed,
            show_progress=False,
        )
        parameters = {name: p.detach().clone() for name, p in result.model.named_parameters()}
        torch.save({"parameters": parameters, "losses": result.losses}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)
def test_two_ddp_ranks_end_with_identical_parameters(tmp_path):
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for index in range(6):
        (corpus_dir / f"doc{index}.txt").write_text(f"document {index}: " + "some text to learn. " * 40)
    mp.spawn(train_on_rank, args=(free_port(), str(corpus_dir), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    first, second = (run["parameters"] for run in ranks)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # Each rank drew its own batches (different losses), so equality comes from averaged gradients.
    assert ranks[0]["losses"] != ranks[1]["losses"]
    assert len(ranks[0]["losses"]) == STEPS

    # And the parameters moved from rank 0's initialisation (the one DDP broadcast).
    from headkit.data import ByteTokenizer
    from headkit.models import HeadkitForCausalLM
    from headkit.train import default_config

    torch.manual_seed(100)
    initial = HeadkitForCausalLM(default_config(ByteTokenizer(), **TINY, layer_types=["linear", "softmax"]))
    moved = [not torch.equal(p.detach(), first[name]) for name, p in initial.named_parameters()]
    assert all(moved)
