"""A small local lm-eval task for `headkit eval --tasks` (docs/evaluate.md): 50 multiple-choice questions from
Python's standard library — a function's signature, and four first lines of docstrings, its own and three of
other functions', to choose from (seeded; the functions are those of this Python's standard library).

    python docs/tasks/make_stdlib_docstrings.py runs/tasks
    headkit eval MODEL --tasks stdlib_docstrings --include-path runs/tasks

Writes FOLDER/stdlib_docstrings.jsonl and FOLDER/stdlib_docstrings.yaml (its data_files path absolute: 🤗
datasets reads a relative one from the current folder, not the YAML's)."""

import importlib
import inspect
import json
import random
import re
import sys
from pathlib import Path

out = Path(sys.argv[1]).resolve()
out.mkdir(parents=True, exist_ok=True)
pool = []
MODULES = (
    "json os.path shutil textwrap string statistics fractions heapq bisect glob fnmatch difflib base64 random"
)
MODULES += " calendar"
for module_name in MODULES.split():
    module = importlib.import_module(module_name)
    for name, function in sorted(vars(module).items()):
        if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module.__name__:
            continue
        doc = (inspect.getdoc(function) or "").strip().splitlines()
        try:
            # A default that is a function prints with its address: the name alone keeps the file reproducible.
            signature = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", str(inspect.signature(function)))
        except (TypeError, ValueError):
            continue
        if doc and 20 <= len(doc[0]) <= 100:
            pool.append({"module": module_name, "name": name, "signature": signature, "doc": doc[0]})
rng = random.Random(0)
picked = rng.sample(pool, 50)
rows = []
for i, item in enumerate(picked):
    others = rng.sample([p["doc"] for p in pool if p["doc"] != item["doc"]], 3)
    label = i % 4
    choices = others[:label] + [item["doc"]] + others[label:]
    context = f'# {item["module"]}\ndef {item["name"]}{item["signature"]}:\n    """'
    rows.append({"context": context, "choices": choices, "label": label})
(out / "stdlib_docstrings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(out / "stdlib_docstrings.yaml").write_text(f"""task: stdlib_docstrings
dataset_path: json
dataset_kwargs:
  data_files:
    test: {out / "stdlib_docstrings.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
print(len(pool), "functions;", len(rows), "questions in", out)
