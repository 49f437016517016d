"""SentencePiece and HF `tokenizers` models behind one interface.

`load_tokenizer(None)` gives the bundled character-level SentencePiece model of the synthetic task
(`flexfloor/data/assets/synthetic_char.model`, trained by `tools/train_tokenizer.py`): every
printable ASCII character and the newline is one token, so encode/decode round-trips any ASCII
text exactly, and encode(a) + encode(b) == encode(a + b).

Ids never include special tokens implicitly: `encode` adds no BOS/EOS (the engine adds them), and
`decode` drops special tokens.

Chat template: one deterministic plain-text format for both backends (see `render_chat`). Model
families that ship their own template (Jinja in tokenizer_config.json) are rendered the same way
here, so prompts are identical whichever tokenizer serves them.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path

BUNDLED_TOKENIZER = Path(__file__).parent / "data" / "assets" / "synthetic_char.model"

# Special-token names tried, in order, when a tokenizer.json has no tokenizer_config.json beside it.
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<eos>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


def render_chat(messages: list[dict]) -> str:
    """Formats chat messages into one prompt string.

    A single user message renders as its content unchanged: the raw-completion case of base models
    and of the synthetic task. Anything else renders each message as "<role>: <content>\\n" and
    ends with "assistant:" so the model writes the reply. Rendering is idempotent in the sense
    that render_chat([{"role": "user", "content": render_chat(m)}]) == render_chat(m).
    """
    if not messages:
        raise ValueError("a chat needs at least one message, got an empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"chat message {i} must be a dict with str 'role' and 'content', "
                             f"got {message!r}")
    if len(messages) == 1 and messages[0]["role"] == "user":
        return messages[0]["content"]
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class Tokenizer(abc.ABC):
    """Text <-> token ids. `bos_id` is None for models trained without one (Qwen)."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without special tokens."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens dropped."""

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_chat(messages)


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path):
        import sentencepiece

        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        if self._sp.eos_id() < 0:
            raise ValueError(f"SentencePiece model {path} has no EOS token; retrain it with "
                             "eos_id >= 0")
        self.eos_id = self._sp.eos_id()
        # Models trained without a pad piece pad with EOS; padded positions are masked anyway.
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    """A `tokenizers` tokenizer.json; special tokens from a tokenizer_config.json beside it if any,
    else from the usual token names."""

    def __init__(self, path: Path):
        try:
            import tokenizers
        except ImportError:
            raise ImportError(f"loading {path} needs the HF `tokenizers` package, which is not "
                              "installed: pip install tokenizers") from None
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _special_tokens_from_config(path.parent / "tokenizer_config.json")
        self.bos_id = self._special_id(config, "bos_token", _BOS_NAMES)
        eos_id = self._special_id(config, "eos_token", _EOS_NAMES)
        if eos_id is None:
            raise ValueError(f"cannot find the EOS token of {path}: put a tokenizer_config.json "
                             f"with \"eos_token\" beside it, or name it one of {list(_EOS_NAMES)}")
        self.eos_id = eos_id
        pad_id = self._special_id(config, "pad_token", _PAD_NAMES)
        self.pad_id = eos_id if pad_id is None else pad_id

    def _special_id(self, config: dict[str, str | None], key: str,
                    names: tuple[str, ...]) -> int | None:
        """The id of the token that tokenizer_config.json names for `key` (None when it says
        null), else of the first of `names` in the vocabulary."""
        if key in config:
            if config[key] is None:
                return None
            token_id = self._tok.token_to_id(config[key])
            if token_id is None:
                raise ValueError(f"{key} {config[key]!r} of the tokenizer_config.json beside "
                                 f"{self.path} is not in its vocabulary")
            return token_id
        return next((self._tok.token_to_id(n) for n in names
                     if self._tok.token_to_id(n) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _special_tokens_from_config(path: Path) -> dict[str, str | None]:
    """The special tokens a tokenizer_config.json sets; a key it leaves out is absent."""
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    tokens = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        if key in config:
            value = config[key]
            # Newer configs write {"content": "<s>", ...} instead of "<s>".
            tokens[key] = value.get("content") if isinstance(value, dict) else value
    return tokens


def load_tokenizer(path: str | None) -> Tokenizer:
    """None: the bundled synthetic-task model. A `.model` file: SentencePiece. A `.json` file:
    HF tokenizers. A directory (an HF model folder): its tokenizer.json, else tokenizer.model."""
    resolved = BUNDLED_TOKENIZER if path is None else Path(path)
    if not resolved.exists():
        raise FileNotFoundError(f"tokenizer file not found: {resolved}")
    if resolved.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (resolved / name).is_file():
                return load_tokenizer(str(resolved / name))
        raise FileNotFoundError(f"tokenizer directory {resolved} has neither tokenizer.json nor "
                                "tokenizer.model")
    if resolved.suffix == ".json":
        return HFTokenizer(resolved)
    if resolved.suffix == ".model":
        return SentencePieceTokenizer(resolved)
    raise ValueError(f"cannot tell the tokenizer type of {resolved}: expected a SentencePiece "
                     "'.model' file, an HF tokenizers '.json' file, or a folder holding one")


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raises when token ids of `tokenizer` can fall outside the model's embedding table."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(
            f"tokenizer vocab_size {tokenizer.vocab_size} does not fit the model's vocab_size "
            f"{model_vocab_size}: set the model config's vocab_size to at least "
            f"{tokenizer.vocab_size}, or use a tokenizer with at most {model_vocab_size} tokens")
