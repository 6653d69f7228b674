"""A byte-level BPE tokenizer trained on the arith corpus, cached on disk (the tokenizer of the tiny model pair).

Numbers are split digit by digit before BPE (a leading space stays with the first digit), so the arithmetic
stays learnable and no multi-digit number becomes a single rare token.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdistill.data.arith import DEFAULT_SIZES, GENERATOR_VERSION, generate_split
from specdistill.tasks.gsm8k import gsm8k_answer, gsm8k_prompt

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# bumped whenever the tokenizer recipe changes (part of the cache key)
TOKENIZER_VERSION = 1


def cache_root() -> Path:
    """`$SPECDISTILL_CACHE` or `~/.cache/specdistill`."""
    return Path(os.environ.get("SPECDISTILL_CACHE") or Path.home() / ".cache" / "specdistill").expanduser()


def _settings(vocab_size: int, seed: int, train_size: int) -> dict[str, int]:
    return {
        "vocab_size": vocab_size,
        "seed": seed,
        "train_size": train_size,
        "generator_version": GENERATOR_VERSION,
        "tokenizer_version": TOKENIZER_VERSION,
    }


def _corpus(seed: int, train_size: int) -> Iterator[str]:
    """The texts the model will see: formatted prompt + answer of every arith train problem."""
    for record in generate_split("train", train_size, seed):
        yield gsm8k_prompt(record["question"]) + gsm8k_answer(record["answer"])


def train_arith_tokenizer(vocab_size: int = 512, seed: int = 0, train_size: int | None = None) -> Tokenizer:
    """Train the raw `tokenizers.Tokenizer` (deterministic for given settings)."""
    n_special = 2
    if vocab_size < 256 + n_special:
        raise ValueError(
            f"vocab_size={vocab_size} is below the 256 bytes + {n_special} special tokens it must hold."
        )
    tokenizer = Tokenizer(models.BPE())
    # one digit per piece, a leading space stays with its digit (" 74" -> " 7", "4")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed, train_size or DEFAULT_SIZES["train"]), trainer=trainer)
    return tokenizer


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )


def arith_tokenizer(
    vocab_size: int = 512,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    train_size: int | None = None,
) -> PreTrainedTokenizerFast:
    """The arith tokenizer: loaded from its cache directory, or trained on the arith train split and cached there.

    Args:
        vocab_size: total vocabulary including the special tokens `<|endoftext|>` (BOS and EOS) and `<|pad|>`.
        seed: the arith generator seed of the training corpus.
        cache_dir: directory holding `arith-<hash of settings>/`; default `<cache_root()>/tokenizers`, where
            `cache_root()` is `$SPECDISTILL_CACHE` or `~/.cache/specdistill`.
        train_size: number of arith train problems to train on (default: the arith task's default train size).
    """
    settings = _settings(vocab_size, seed, train_size or DEFAULT_SIZES["train"])
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "tokenizers"
    target = root / f"arith-{key}"
    if (target / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(target))
    wrapped = _wrap(train_arith_tokenizer(vocab_size, seed, train_size))
    root.mkdir(parents=True, exist_ok=True)
    # write to a private directory and rename it into place, so concurrent processes never read half a tokenizer
    tmp = Path(tempfile.mkdtemp(prefix=f".arith-{key}-", dir=root))
    wrapped.save_pretrained(str(tmp))
    (tmp / "specdistill_settings.json").write_text(json.dumps(settings, indent=2))
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race: use its copy
        _remove_tree(tmp)
    return PreTrainedTokenizerFast.from_pretrained(str(target))


def _remove_tree(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
