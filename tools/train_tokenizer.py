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

import sentencepiece

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexfloor.data.synthetic import make_synthetic_prompts, sft_response  # noqa: E402
from flexfloor.outputs import path_arg, writable, write_whole  # noqa: E402
from flexfloor.tokenizer import BUNDLED_TOKENIZER  # noqa: E402

MAX_VOCAB_SIZE = 128  # the tiny model's vocab_size
CORPUS_PROMPTS, CORPUS_SEED = 4096, 0
SPECIAL_IDS = dict(pad_id=0, unk_id=1, bos_id=2, eos_id=3)
USER_SYMBOLS = ["\n", "\t"]


def corpus() -> list[str]:
    examples = make_synthetic_prompts(CORPUS_PROMPTS, CORPUS_SEED)
    lines = [e.prompt + sft_response(e) for e in examples]
    # Training reads one sentence per line, so newline and tab come in as user-defined symbols.
    lines.append("".join(c for c in string.printable if c not in string.whitespace or c == " "))
    return lines


def min_vocab_size(lines: list[str]) -> int:
    """The smallest vocabulary with a piece for every character of `lines` and each special."""
    return len(set("".join(lines)) | set(USER_SYMBOLS)) + len(SPECIAL_IDS)


def train(max_vocab_size: int) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=model, model_type="char",
        # A char model takes exactly the characters it saw; vocab_size is only an upper bound.
        vocab_size=max_vocab_size, hard_vocab_limit=False, character_coverage=1.0,
        # Exact round trips: no normalization, no dummy leading space, spaces kept as written.
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        **SPECIAL_IDS, user_defined_symbols=USER_SYMBOLS,
        num_threads=1, minloglevel=2)
    return model.getvalue()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(BUNDLED_TOKENIZER), type=path_arg,
                        help="FILE.model (its folder must exist)")
    parser.add_argument("--max-vocab-size", type=int, default=MAX_VOCAB_SIZE)
    args = parser.parse_args(argv)
    least = min_vocab_size(corpus())
    if args.max_vocab_size < least:
        parser.error(f"--max-vocab-size {args.max_vocab_size}: too small for the corpus's "
                     f"characters and special tokens; give at least {least}")
    try:
        out = writable(args.out, "--out", ext=(".model", "a SentencePiece model"))
    except ValueError as e:
        parser.error(str(e))
    model = train(args.max_vocab_size)
    write_whole(out, lambda tmp: Path(tmp).write_bytes(model))
    sp = sentencepiece.SentencePieceProcessor(model_proto=model)
    print(f"wrote {args.out} ({len(model)} bytes): vocab_size {sp.get_piece_size()}, "
          f"pad {sp.pad_id()}, bos {sp.bos_id()}, eos {sp.eos_id()}")


if __name__ == "__main__":
    main()
