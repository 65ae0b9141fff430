"""Write a math dataset as the ``{"prompt": ..., "answer": ...}`` jsonl the GPU recipes read.

    python tools/prepare_math_data.py gsm8k --split train --out data/gsm8k_train.jsonl
    python tools/prepare_math_data.py math --split test --out data/math_test.jsonl
    python tools/prepare_math_data.py gsm8k --source /data/gsm8k_saved --split test --out ...  # save_to_disk copy

Sources (``datasets.load_dataset`` ids, or ``--source``: a local ``save_to_disk`` directory or file):
  gsm8k  openai/gsm8k (config "main"): ``question``; the answer is what follows ``####`` in ``answer``
  math   DigitalLearningGmbH/MATH-lighteval: ``problem``; the answer is the last ``\\boxed{...}`` of ``solution``

Each prompt gets the instruction to put the final answer in ``\\boxed{}``, which the math reward
(math-verify) extracts. The chat template is applied at training time (``data.apply_chat_template``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Iterable, Optional

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SOURCES = {"gsm8k": ("openai/gsm8k", "main"), "math": ("DigitalLearningGmbH/MATH-lighteval", None)}


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def convert(kind: str, row: Dict) -> Optional[Dict[str, str]]:
    if kind == "gsm8k":
        question, answer = row["question"], row["answer"].split("####")[-1].strip().replace(",", "")
    else:
        question, answer = row["problem"], last_boxed(row["solution"])
    if not answer:
        return None
    return {"prompt": f"{question.strip()}\n{INSTRUCTION}", "answer": answer}


def _rows(kind: str, source: Optional[str], split: str) -> Iterable[Dict]:
    import datasets

    if source is None:
        name, config = SOURCES[kind]
        return datasets.load_dataset(name, config, split=split)
    if os.path.isdir(source):
        loaded = datasets.load_from_disk(source)
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    builder = "parquet" if source.endswith(".parquet") else "json"
    return datasets.load_dataset(builder, data_files=source, split="train")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=sorted(SOURCES))
    p.add_argument("--split", default="train")
    p.add_argument("--source", help="a local copy instead of the hub (save_to_disk directory, jsonl or parquet)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    where = args.source or f"the Hugging Face hub ({SOURCES[args.kind][0]})"
    try:
        rows = _rows(args.kind, args.source, args.split)
    except Exception as e:  # noqa: BLE001 - offline, a wrong path or split: one line, nothing written
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"prepare_math_data: cannot read {args.kind} split {args.split!r} from {where}: {type(e).__name__}: "
              f"{first}. Offline? Pass --source a local copy (save_to_disk directory, jsonl or parquet); "
              f"nothing was written to {args.out}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    kept = skipped = 0
    part = args.out + ".part"  # renamed when complete: a failure never leaves a short or empty --out
    try:
        with open(part, "w", encoding="utf-8") as f:
            for row in rows:
                item = convert(args.kind, row)
                if item is None:
                    skipped += 1
                    continue
                f.write(json.dumps(item) + "\n")
                kept += 1
    except BaseException:
        os.remove(part)
        raise
    if kept == 0:
        os.remove(part)
        print(f"prepare_math_data: no row of {where} split {args.split!r} has an extractable answer "
              f"({skipped} skipped); nothing was written to {args.out}", file=sys.stderr)
        return 2
    os.replace(part, args.out)
    print(f"wrote {kept} rows to {args.out} ({skipped} without an extractable answer skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
