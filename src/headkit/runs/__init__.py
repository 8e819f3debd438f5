"""headkit.runs: what every run stands on — the recipes, the measurements (:mod:`headkit.evaluation`), decoding
(:mod:`headkit.runtime`), the export (:mod:`headkit.export`), the benchmarks and the command line alike.

- :mod:`headkit.runs.models`: loading the model a run works on (a folder or a GGUF file), its dtype, and the
  output folder's checks.
- :mod:`headkit.runs.text`: the text a run reads (the user's ``--data`` or the standard library): chunks, token
  windows, batches.
- :mod:`headkit.runs.objectives`: the teacher → student losses recovery trains on, and what the measurements share
  with them (next-token KL, mean pooling).
- :mod:`headkit.runs.processes`: one run in several processes (``torchrun`` / ``accelerate launch``): which one is
  the main process, what only it prints and does, and its outcome given to every process.
- :mod:`headkit.runs.command_line`: a command line run as the program (``headkit``, ``python -m
  headkit.bench.<module>``): its errors as one line and an exit status, printed by the main process.

Nothing here imports the packages that stand on it; the package itself imports none of its modules, so that
importing one (e.g. the processes helpers every command calls first) loads no more than it needs.
"""
