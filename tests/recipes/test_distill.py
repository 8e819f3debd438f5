import copy
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from headkit.errors import HeadkitError
from headkit.recipes.distill import distill, lora_target_modules, split_batches
from headkit.runs.objectives import CausalLMObjective

transformers.logging.set_verbosity_error()


def _pair(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
    )
    teacher = transformers.LlamaForCausalLM(config).eval()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return teacher, student


def _examples(count=16, length=8):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (count, length), generator=generator)
    return split_batches([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}])


def _kl(student, teacher, examples):
    batch = {key: torch.stack([e[key] for e in examples]) for key in examples[0]}
    with torch.no_grad():
        return float(CausalLMObjective()(student, teacher, batch))


def test_distillation_brings_the_student_to_the_teacher():
    teacher, student = _pair()
    examples = _examples()
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    before = _kl(student, teacher, examples)
    result = distill(
        student, teacher, examples, objective=CausalLMObjective(), steps=20, lr=3e-3, batch_size=4
    )
    assert result.steps == 20 and len(result.losses) == 20
    assert _kl(result.model, teacher, examples) < 0.5 * before
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in teacher_state.items())  # never trained
    assert result.model.config.use_cache  # restored for generation


def test_lora_recovery_is_merged_and_trains_only_the_adapted_layers():
    teacher, student = _pair()
    examples = _examples()
    embedding = student.model.embed_tokens.weight.clone()
    q_proj = student.model.layers[0].self_attn.q_proj.weight.clone()
    targets = lora_target_modules(student)
    assert "model.layers.0.self_attn.q_proj" in targets and "lm_head" not in targets
    before = _kl(student, teacher, examples)
    result = distill(
        student, teacher, examples, objective=CausalLMObjective(), steps=15, lr=1e-2, lora_rank=2
    )
    model = result.model
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_proj)
    assert _kl(model, teacher, examples) < before


def test_training_is_seeded():
    losses = []
    for _ in range(2):
        teacher, student = _pair()
        losses.append(
            distill(student, teacher, _examples(), objective=CausalLMObjective(), steps=4, lr=1e-3).losses
        )
    assert losses[0] == losses[1]


def _with_and_without_checkpointing(prepare, **options):
    """The same distillation of the same pair (`prepare`d first) without and with gradient checkpointing: the same
    losses and weights."""
    results = []
    for checkpointing in (False, True):
        teacher, student = _pair()
        prepare(student)
        results.append(
            distill(
                student,
                teacher,
                _examples(),
                objective=CausalLMObjective(),
                lr=1e-2,
                batch_size=4,
                gradient_checkpointing=checkpointing,
                **options,
            )
        )
    assert results[0].losses == pytest.approx(results[1].losses, rel=1e-5)
    for (name, a), (_, b) in zip(
        results[0].model.state_dict().items(), results[1].model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    return results


@pytest.mark.parametrize("lora_rank", [None, 2])
def test_gradient_checkpointing_recomputes_the_layers_and_trains_the_same_model(lora_rank):
    layer_runs = []

    def count_layer_runs(student):  # the MLP's forward itself: hooks skip a recompute
        runs, mlp = [], student.model.layers[0].mlp
        mlp.forward = lambda x, forward=mlp.forward: runs.append(1) or forward(x)
        layer_runs.append(runs)

    results = _with_and_without_checkpointing(count_layer_runs, steps=3, lora_rank=lora_rank)
    # each of the 3 steps' forwards runs the layer once more in its backward when checkpointed
    assert len(layer_runs[1]) == len(layer_runs[0]) + 3
    for result in results:  # turned off again, and the model back in evaluation mode, for the measurement
        assert not any(getattr(m, "gradient_checkpointing", False) for m in result.model.modules())
        assert not any(m.training for m in result.model.modules())


def test_gradient_checkpointing_of_a_linearized_student_trains_the_same_model():
    """Two recomputations nested: the decoder layer's, and inside it the window attention's own."""
    import headkit
    from headkit.surgery import LinearizeConfig

    results = _with_and_without_checkpointing(
        lambda student: headkit.apply_(student, LinearizeConfig(window=3, chunk_size=2)), steps=2
    )
    pickle.dumps(
        results[1].model
    )  # nothing of the checkpointing is left on it (a recipe's snapshot pickles it)


def test_gradient_checkpointing_is_refused_on_a_model_without_it():
    from headkit.recipes.distill import _checkpointed_model

    assert _checkpointed_model(torch.nn.Linear(2, 2), required=False) is None  # the default trains without
    teacher, _ = _pair()
    with pytest.raises(HeadkitError, match="gradient_checkpointing: Linear does not support"):
        distill(
            torch.nn.Linear(2, 2), teacher, _examples(), objective=CausalLMObjective(), steps=1,
            gradient_checkpointing=True,
        )  # fmt: skip


def test_gradient_checkpointing_by_default_is_on_where_the_model_supports_it():
    """None: a 🤗 decoder recomputes its layers; a model without support trains without (True refuses it)."""
    teacher, student = _pair()
    examples = _examples()
    result = distill(
        student, teacher, examples, objective=CausalLMObjective(), steps=1, gradient_checkpointing=None
    )
    assert result.gradient_checkpointing and result.to_dict()["gradient_checkpointing"]
    plain = distill(_pair()[1], teacher, examples, objective=CausalLMObjective(), steps=1)
    assert not plain.gradient_checkpointing
    with pytest.raises(HeadkitError, match="gradient_checkpointing must be True, False or None, got 'yes'"):
        distill(
            student, teacher, examples, objective=CausalLMObjective(), steps=1, gradient_checkpointing="yes"
        )


def test_a_run_resumes_from_its_checkpoint(tmp_path):
    teacher, student = _pair()
    first = distill(
        copy.deepcopy(student),
        teacher,
        _examples(),
        objective=CausalLMObjective(),
        steps=50,
        lr=1e-3,
        output_dir=tmp_path,
    )
    assert (tmp_path / "checkpoint-50").is_dir()
    again = distill(
        copy.deepcopy(student),
        teacher,
        _examples(),
        objective=CausalLMObjective(),
        steps=50,
        lr=1e-3,
        output_dir=tmp_path,
        resume=True,
    )
    # Nothing left to do (resumed at step 50): no step more, and the first run's logged losses reported again.
    assert again.steps == 50 and again.losses == first.losses
    for (name, a), (_, b) in zip(
        first.model.state_dict().items(), again.model.state_dict().items(), strict=True
    ):
        assert torch.allclose(a, b), name


@pytest.mark.parametrize(
    "options, match",
    [
        ({"steps": -1}, "steps"),
        ({"batch_size": 0}, "batch_size"),
        ({"lora_rank": 0}, "lora_rank"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_bad_settings_are_refused(options, match):
    teacher, student = _pair()
    settings = {"objective": CausalLMObjective(), "steps": 2} | options
    with pytest.raises(HeadkitError, match=match):
        distill(student, teacher, _examples(), **settings)


@pytest.mark.slow
def test_two_process_gloo_run_keeps_the_replicas_equal(tmp_path):
    worker = Path(__file__).with_name("ddp_distill_worker.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    env |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result = subprocess.run(
        [*command, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert all(r["world"] == 2 and r["steps"] == 3 for r in ranks)
    teacher, _ = _pair()
    for name, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][name]), name  # DDP kept the replicas identical


def test_an_encoders_recovery_takes_gradient_checkpointing_and_trains_the_same_model():
    from headkit.recipes.distill import encoder_finetune

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32
    )
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    batches = [
        {"input_ids": ids[i : i + 4], "attention_mask": torch.ones(4, 12, dtype=torch.long)} for i in (0, 4)
    ]
    models, layer_runs = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        teacher = transformers.BertModel(config).eval()
        student = copy.deepcopy(teacher)
        with torch.no_grad():
            for parameter in student.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        runs, output = [], student.encoder.layer[0].output
        output.forward = lambda *a, forward=output.forward, runs=runs: runs.append(1) or forward(*a)
        result = encoder_finetune(
            student, teacher, batches, steps=2, lr=1e-2, gradient_checkpointing=checkpointing
        )
        models.append(result.model)
        layer_runs.append(len(runs))
    assert layer_runs[1] == layer_runs[0] + 2  # recomputed once per step's forward
    for (name, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
