"""headkit's one training loop (recipes.loop.train_loop, on Trainer) against a plain hand-written AdamW loop."""

import copy

import pytest
import safetensors.torch
import torch
from torch import nn

from headkit.errors import HeadkitError
from headkit.models import HeadkitConfig, HeadkitForCausalLM
from headkit.recipes.loop import IndexedBatches, checkpoint_state, train_loop
from headkit.train import lm_optimization

STEPS = 12


def tiny_lm() -> HeadkitForCausalLM:
    torch.manual_seed(0)
    config = HeadkitConfig(
        vocab_size=18,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        attention="linear",
        position_embedding_type="learned",
        max_position_embeddings=20,
        bos_token_id=17,
        pad_token_id=None,
        eos_token_id=None,
    )
    return HeadkitForCausalLM(config)


def draw(index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 17, (4, 20), generator=generator)
    return {"input_ids": ids, "labels": ids}


def test_the_loop_trains_exactly_as_a_hand_written_adamw_loop_on_the_batches_it_drew():
    model, reference = tiny_lm(), tiny_lm()
    seen = []

    def loss(model, batch, step):
        seen.append(batch["input_ids"].clone())
        return model(**batch, use_cache=False).loss

    options = lm_optimization(model, 3e-3, 0.01, STEPS, 3)
    result = train_loop(
        model,
        loss,
        IndexedBatches(STEPS, draw, seed=1),
        steps=STEPS,
        dropout=True,
        max_grad_norm=0.5,
        **options,
    )
    assert result.steps == STEPS and len(result.losses) == len(result.step_seconds) == STEPS == len(seen)

    # The reference: AdamW on the same groups, the same factor per step, the same clipping, the same batches.
    plain = lm_optimization(reference, 3e-3, 0.01, STEPS, 3)
    optimizer = torch.optim.AdamW(plain["param_groups"], **plain["optimizer_options"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, plain["schedule"])
    reference.train()
    losses = []
    for ids in seen:
        value = reference(input_ids=ids, labels=ids, use_cache=False).loss
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        losses.append(value.item())
    assert result.losses == pytest.approx(losses, rel=1e-6)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7, msg=name)
    assert not model.training  # left in evaluation mode


def test_indexed_batches_are_a_pure_function_of_the_index_and_the_seed():
    first, again, other = (IndexedBatches(5, draw, seed=s) for s in (3, 3, 4))
    assert all(torch.equal(first[i]["input_ids"], again[i]["input_ids"]) for i in (4, 0, 2))
    assert not torch.equal(first[1]["input_ids"], first[2]["input_ids"])
    assert not torch.equal(first[1]["input_ids"], other[1]["input_ids"])


def test_examples_are_batched_and_gradient_accumulation_averages_the_forwards():
    model = nn.Linear(3, 1)
    start = copy.deepcopy(model)
    examples = [{"x": torch.full((3,), float(i))} for i in range(8)]
    per_forward = []

    def loss(model, batch, step):
        assert batch["x"].shape == (2, 3)  # stacked by Trainer at batch_size
        value = model(batch["x"]).pow(2).mean()
        per_forward.append(value.item())
        return value

    result = train_loop(
        model,
        loss,
        examples,
        steps=3,
        batch_size=2,
        gradient_accumulation_steps=2,
        param_groups=[{"params": list(model.parameters()), "lr": 0.01}],
    )
    assert result.steps == 3 and len(per_forward) == 6
    assert result.losses == pytest.approx([sum(per_forward[i : i + 2]) / 2 for i in (0, 2, 4)])
    assert not torch.equal(model.weight, start.weight)


def test_a_companion_is_moved_with_the_model_and_a_zero_step_run_does_nothing():
    model, companion = nn.Linear(2, 1), nn.Linear(2, 1).requires_grad_(False)

    def loss(model, batch, step):
        return (model(batch) - companion(batch)).pow(2).mean()

    groups = [{"params": list(model.parameters()), "lr": 0.1}]
    assert train_loop(model, loss, [torch.ones(2)], steps=0, param_groups=groups).steps == 0
    result = train_loop(model, loss, [torch.ones(2)], steps=4, param_groups=groups, companions=[companion])
    assert result.losses[-1] < result.losses[0]
    assert next(companion.parameters()).device == next(model.parameters()).device


@pytest.mark.parametrize(
    "options, match",
    [
        ({"steps": -1}, "steps"),
        ({"steps": 2, "batch_size": 0}, "batch_size"),
        ({"steps": 2, "lr": -1.0}, "lr"),
        ({"steps": 2, "log_every": 0}, "log_every"),
    ],
)
def test_bad_settings_are_refused(options, match):
    model = nn.Linear(2, 1)
    groups = [{"params": list(model.parameters()), "lr": 0.1}]
    with pytest.raises(HeadkitError, match=match):
        train_loop(model, lambda m, b, s: m(b).sum(), [torch.ones(2)], param_groups=groups, **options)


def test_no_data_or_nothing_trainable_is_refused():
    model = nn.Linear(2, 1)
    with pytest.raises(HeadkitError, match="no example"):
        train_loop(model, lambda m, b, s: m(b).sum(), [], steps=1, param_groups=[{"params": [model.weight]}])
    frozen = [{"params": [model.weight.detach()]}]
    with pytest.raises(HeadkitError, match="nothing to train"):
        train_loop(model, lambda m, b, s: m(b).sum(), [torch.ones(2)], steps=1, param_groups=frozen)


def test_a_checkpoint_copies_only_a_tied_weights_second_name(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(11, 4)
            self.head = nn.Linear(4, 11, bias=False)
            self.head.weight = self.embed.weight
            self.middle = nn.Linear(4, 4)
            self.register_buffer("scale", torch.arange(8.0).view(2, 4).t())  # not contiguous

    module = Tied()
    state = checkpoint_state(module)
    assert set(state) == set(module.state_dict())
    # Written from the module's own memory: no second copy of what is not tied.
    assert state["embed.weight"].data_ptr() == module.embed.weight.data_ptr()
    assert state["middle.weight"].data_ptr() == module.middle.weight.data_ptr()
    assert state["head.weight"].data_ptr() != module.embed.weight.data_ptr()
    assert state["scale"].is_contiguous()
    safetensors.torch.save_file(state, str(tmp_path / "w.safetensors"))
    loaded = safetensors.torch.load_file(str(tmp_path / "w.safetensors"))
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
