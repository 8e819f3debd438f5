"""HeadkitForCausalLM trains with the tools people already use: transformers.Trainer and PEFT LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from headkit.models import HeadkitForCausalLM

VOCAB = 97


def patterned_sequences(count: int, length: int, seed: int = 0) -> torch.Tensor:
    """Arithmetic progressions mod the vocabulary: learnable in a few dozen steps."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(1, VOCAB, (count, 1), generator=generator)
    steps = torch.randint(1, 4, (count, 1), generator=generator)
    return (starts + steps * torch.arange(length)) % (VOCAB - 1) + 1


def mean_loss(model: HeadkitForCausalLM, ids: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


def test_trainer_runs_unchanged_and_the_loss_decreases(make_config, tmp_path):
    torch.manual_seed(0)
    model = HeadkitForCausalLM(make_config(num_key_value_heads=2, hidden_dropout=0.1, label_smoothing=0.1))
    ids = patterned_sequences(32, 12)
    dataset = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]
    before = mean_loss(model, ids)

    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=25,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=5,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=model, args=arguments, train_dataset=dataset).train()

    after = mean_loss(model, ids)
    assert after < 0.7 * before, (before, after)


def test_peft_lora_on_q_and_v_trains_and_merges_to_the_same_logits(make_config):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = HeadkitForCausalLM(make_config(num_key_value_heads=2))
    base_weights = {name: p.detach().clone() for name, p in base.named_parameters()}
    lora = peft.LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, lora)

    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable} == {"q_proj", "v_proj"}

    ids = patterned_sequences(16, 10)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    model.train()
    losses = []
    for _ in range(30):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.15, losses

    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        generated = model.generate(input_ids=ids[:2, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, 7)
    merged = model.merge_and_unload()
    assert type(merged) is HeadkitForCausalLM
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-5, rtol=1e-5)
    # Only the LoRA-targeted projections changed.
    for name, parameter in merged.named_parameters():
        changed = not torch.equal(parameter.detach(), base_weights[name])
        assert changed == (name.endswith("q_proj.weight") or name.endswith("v_proj.weight")), name
