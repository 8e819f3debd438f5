"""Every ``headkit bench`` command and option of before the benchmark registry still exists, under its name."""

from __future__ import annotations

import typer.main

from headkit.app import app

# The commands and their parameters as cli.py declared them by hand (issue 13); "--x/--no-x" is one flag.
BENCH_COMMANDS = {
    "compress": "--contexts --decode-batches --dims --distill-steps --kv-ranks --model --out --quick/--no-quick "
    "--rope-dims --seed --students --threads "
    # issue 26: MHA2MLA's rotary-pair ranking beside the fitted one
    "--rope-selections",
    "decode": "--batch-size --compile/--no-compile --device --mechanisms --new-tokens --out --prompts "
    "--quick/--no-quick --repeats "
    "--threads "
    # issue 24: SmolLM2 side by side in llama.cpp and headkit's fast path
    "--smollm2/--no-smollm2 --engines --contexts --engine-batches --max-batch-tokens --engine-tokens "
    "--engine-repeats --engine-compile/--no-engine-compile --linearized --pruned --perplexity-windows",
    "decompose": "MODEL --dims --max-iter --out --quick/--no-quick --seed --tensorly/--no-tensorly --threads",
    "digits": "--batch-size --hidden-size --images --layers --out --quick/--no-quick --sample/--no-sample --seed "
    "--steps --threads",
    "extrapolate": "--batch-size --corpus --hidden-size --layers --lengths --out --passkey-trials "
    "--quick/--no-quick --seed --steps --threads",
    "linearize": "--data --decode-contexts --eval-lengths --layers --lora-rank --lora-steps --model --out "
    "--quick/--no-quick --seed --sinks --budget --threads --transfer-steps --window",
    "lm": "--additive-window --batch-size --collaborative-dim --corpus --corpus-bytes --eval-every --eval-tokens "
    "--heads --hidden-size --layers --lr --out --quick/--no-quick --seed --seq-len --steps --threads --variants",
    "lora": "--finetune-epochs --out --pretrain-epochs --quick/--no-quick --ranks --seed --threads",
    "prune": "--decoder/--no-decoder --distill-steps --fractions --gate-steps --heads-kept --model --out "
    "--quick/--no-quick --recovery/--no-recovery --recovery-cases --recovery-lora-rank --recovery-steps --seed "
    "--threads",
    "speed": "--device --lengths --mechanisms --out --quick/--no-quick --repeats --threads",
}


def _parameters(command) -> set[str]:
    names = set()
    for parameter in command.params:
        if parameter.param_type_name == "argument":
            names.add(parameter.name.upper())
        else:
            names.add("/".join(sorted(parameter.opts) + sorted(parameter.secondary_opts)))
    return names


def test_every_bench_command_and_option_of_before_still_exists():
    bench = typer.main.get_command(app).commands["bench"]
    assert set(BENCH_COMMANDS) <= set(bench.commands)
    for name, parameters in BENCH_COMMANDS.items():
        missing = set(parameters.split()) - _parameters(bench.commands[name])
        assert not missing, f"headkit bench {name} lost {sorted(missing)}"


# Top-level commands whose options are snapshotted exactly: a change here is a change of the CLI, made on purpose.
COMMANDS = {
    # --tasks and lm-eval's own flags (--include-path, --num-fewshot, --limit, --batch-size): issue 37
    "eval": "MODEL --batch-size --data --decode-contexts --depths --dtype --eval-tokens --include-path --lengths "
    "--limit --num-fewshot --out --passkey-lengths --reference --seed --tasks --threads --trials",
}


def test_snapshotted_commands_have_exactly_their_options():
    commands = typer.main.get_command(app).commands
    for name, parameters in COMMANDS.items():
        assert _parameters(commands[name]) == set(parameters.split()), f"headkit {name} changed its options"
