"""torch.compile works for every registered mechanism: the graphs dynamo captures give the eager model's logits,
decoding steps (with the model's cache) and gradients.

The backend here runs each captured graph as traced (no code generation), so the test checks capture — what
compiling needs from the code — and the captured graphs' outputs, without a C++ toolchain or minutes of
compilation; inductor then only changes how each graph runs."""

from __future__ import annotations

import pytest
import torch

from headkit.layers import BUILTIN_ATTENTION_NAMES, HeadkitCache
from headkit.models import HeadkitForCausalLM


def capturing_backend(graphs: list):
    def backend(graph_module: torch.fx.GraphModule, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend


def decode(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cache = HeadkitCache(model)
    output = model(input_ids=ids, cache=cache, use_cache=True)
    logits, token = [output.logits], output.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        output = model(input_ids=token, cache=cache, use_cache=True)
        logits.append(output.logits)
        token = output.logits[:, -1:].argmax(-1)
    return torch.cat([x[:, -1] for x in logits]), logits


@pytest.mark.parametrize("attention", BUILTIN_ATTENTION_NAMES)
def test_compiled_model_matches_eager_in_forward_decoding_and_gradients(make_config, attention):
    # Past the recompile limit dynamo would quietly run the model eagerly, and the comparison would prove nothing.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        check_compiled_model(make_config, attention)


def check_compiled_model(make_config, attention: str) -> None:
    torch.manual_seed(0)
    model = HeadkitForCausalLM(make_config(attention=attention, num_hidden_layers=2)).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 12))
    torch._dynamo.reset()
    graphs: list = []
    compiled = torch.compile(model, backend=capturing_backend(graphs))
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits)
        captured_forward = len(graphs)
        eager_steps, _ = decode(model, ids, 3)
        compiled_steps, _ = decode(compiled, ids, 3)
        torch.testing.assert_close(compiled_steps, eager_steps)
    assert captured_forward > 0, "dynamo captured no graph: the model ran eagerly"
    assert len(graphs) > captured_forward, "decoding with the cache captured no graph of its own"

    model.train()
    eager_loss = model(input_ids=ids, labels=ids).loss
    eager_grads = torch.autograd.grad(eager_loss, [p for p in model.parameters() if p.requires_grad])
    compiled_loss = compiled(input_ids=ids, labels=ids).loss
    compiled_grads = torch.autograd.grad(compiled_loss, [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, expected in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", BUILTIN_ATTENTION_NAMES)
def test_model_compiles_to_one_graph_for_training_and_decoding(make_config, attention):
    # A graph break (a value read back from a tensor, e.g. `if mask.all()`) splits the model into pieces that
    # inductor compiles apart, losing the fusions across them: the training forward and a decoding step with
    # the cache are each one graph for every mechanism.
    torch.manual_seed(0)
    model = HeadkitForCausalLM(make_config(attention=attention, num_hidden_layers=2)).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 12))
    torch._dynamo.reset()
    training = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    cache = HeadkitCache(model)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
        torch._dynamo.reset()
        step = torch._dynamo.explain(model)(input_ids=ids[:, :1], cache=cache, use_cache=True)
    assert training.graph_break_count == 0, training.break_reasons
    assert step.graph_break_count == 0, step.break_reasons
