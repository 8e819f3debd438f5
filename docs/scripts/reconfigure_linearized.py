"""Save a linearized model with another exact set: sinks, question-chosen keys, retrieval heads.

None of these has parameters, so a trained model takes them as it is (``headkit.surgery.reconfigure``); the saved
folder records them and ``headkit.from_pretrained`` rebuilds the same model.

    python docs/scripts/reconfigure_linearized.py LINEARIZED OUT --sinks 4 --budget 128 \
        --retrieval-heads 7:2,14:1,17:0,17:1,18:2,20:1,21:2,23:0

The retrieval heads (layer:key/value head) are the best ones ``headkit bench retrieval`` prints.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers import AutoTokenizer

from headkit import from_pretrained
from headkit.surgery import reconfigure


def heads(text: str) -> list[tuple[int, int]]:
    try:
        return [
            (int(layer), int(head)) for layer, head in (item.split(":") for item in text.split(",") if item)
        ]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer:head,layer:head,…, got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("linearized", type=Path, help="a headkit linearize output folder")
    parser.add_argument("out", type=Path, help="a new folder for the reconfigured model")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--selection", choices=("question", "recall"), default="question")
    parser.add_argument("--retrieval-heads", type=heads, default=[])
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"out: {args.out} exists; give a new folder (the input is never overwritten)")
    model = from_pretrained(args.linearized)
    config = reconfigure(
        model,
        sinks=args.sinks,
        budget=args.budget,
        selection=args.selection,
        retrieval_heads=args.retrieval_heads,
    )
    model.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.linearized).save_pretrained(args.out)  # a folder headkit generate runs
    print(f"saved {args.out}: {config}")


if __name__ == "__main__":
    main()
