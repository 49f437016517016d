"""Writes the synthetic running-sum task as a verl-format parquet file.

    python tools/make_synthetic_data.py --num-prompts 1024 --seed 0 --out train.parquet
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexfloor.data import make_synthetic_prompts, write_examples  # noqa: E402
from flexfloor.outputs import path_arg, writable  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", required=True, type=path_arg,
                        help="FILE.parquet (its folder must exist)")
    parser.add_argument("--split", default="train", help="extra_info.split (default: train)")
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    try:
        out = writable(args.out, "--out", ext=(".parquet", "Parquet"))
    except ValueError as e:
        parser.error(str(e))
    examples = make_synthetic_prompts(args.num_prompts, args.seed)
    write_examples(examples, out, split=args.split)  # whole or not at all
    lengths = [len(e.ground_truth) for e in examples]
    print(f"wrote {len(examples)} prompts ({examples[0].data_source}, seed {args.seed}, split "
          f"{args.split}) to {args.out}; list length median {statistics.median(lengths):g}, "
          f"max {max(lengths)}; e.g. {examples[0].prompt} -> {examples[0].ground_truth}")


if __name__ == "__main__":
    main()
