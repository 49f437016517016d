"""Trains the bundled SentencePiece model of the synthetic task (flexfloor/data/assets/).

Character-level: every digit, label and bracket of the task is one token, and every printable
ASCII character plus newline and tab has a piece, so chat-templated text round-trips too. The
corpus is the synthetic task itself (fixed seed) plus one line of the ASCII alphabet. Training from
an iterator into memory keeps file names out of the model: the same command writes the same bytes.

    python tools/train_tokenizer.py [--out flexfloor/data/assets/synthetic_char.model]
"""

from __future__ import annotations

import argparse
import io
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexfloor.data.synthetic import make_synthetic_prompts, sft_response  # noqa: E402
from flexfloor.tokenizer import BUNDLED_TOKENIZER, load_tokenizer  # noqa: E402

MAX_VOCAB_SIZE = 128  # the tiny model's vocab_size
CORPUS_PROMPTS, CORPUS_SEED = 4096, 0


def corpus() -> list[str]:
    examples = make_synthetic_prompts(CORPUS_PROMPTS, CORPUS_SEED)
    lines = [e.prompt + sft_response(e) for e in examples]
    # Training reads one sentence per line, so newline and tab come in as user-defined symbols.
    lines.append("".join(c for c in string.printable if c not in string.whitespace or c == " "))
    return lines


def train(max_vocab_size: int) -> bytes:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="char",
        # A char model takes exactly the characters it saw; vocab_size is only an upper bound.
        vocab_size=max_vocab_size, hard_vocab_limit=False, character_coverage=1.0,
        # Exact round trips: no normalization, no dummy leading space, spaces kept as written.
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, user_defined_symbols=["\n", "\t"],
        num_threads=1, minloglevel=2)
    return model.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUNDLED_TOKENIZER)
    parser.add_argument("--max-vocab-size", type=int, default=MAX_VOCAB_SIZE)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(train(args.max_vocab_size))
    tokenizer = load_tokenizer(str(args.out))
    if tokenizer.vocab_size > args.max_vocab_size:
        raise SystemExit(f"trained vocab_size {tokenizer.vocab_size} > --max-vocab-size "
                         f"{args.max_vocab_size}")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): vocab_size {tokenizer.vocab_size}, "
          f"pad {tokenizer.pad_id}, bos {tokenizer.bos_id}, eos {tokenizer.eos_id}")


if __name__ == "__main__":
    main()
