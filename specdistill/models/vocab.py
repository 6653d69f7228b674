"""Vocabulary checks: draft, reference and target must share the tokenizer, not just the embedding size."""

from __future__ import annotations

from collections.abc import Mapping

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill.errors import ConfigError


class VocabularyMismatchError(ConfigError):
    """Raised when models that must share a vocabulary do not: the chosen models (settings) do not fit together, so
    train.py reports it in one line and exits with EX_USAGE (64). Still a ValueError."""


def real_vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's real vocabulary size (special tokens included), not the padded embedding size."""
    return len(tokenizer)


def check_same_tokenizer(tokenizers: Mapping[str, PreTrainedTokenizerBase]) -> int:
    """Check that every tokenizer maps the same strings to the same ids; return the shared real vocab size.

    Padded embedding rows (e.g. 151936 vs 152064 in Qwen) are ignored: the comparison uses the tokenizers'
    vocabularies, which is what decides whether token ids mean the same thing.
    """
    items = list(tokenizers.items())
    if not items:
        raise ValueError("check_same_tokenizer needs at least one tokenizer.")
    first_name, first = items[0]
    first_vocab = first.get_vocab()
    for name, tok in items[1:]:
        vocab = tok.get_vocab()
        if vocab == first_vocab:
            continue
        only_first = len(first_vocab.keys() - vocab.keys())
        only_other = len(vocab.keys() - first_vocab.keys())
        moved = sum(1 for k, v in vocab.items() if k in first_vocab and first_vocab[k] != v)
        raise VocabularyMismatchError(
            f"The {name} tokenizer ({len(vocab)} tokens) does not match the {first_name} tokenizer "
            f"({len(first_vocab)} tokens): {only_first} tokens only in {first_name}, {only_other} only in {name}, "
            f"{moved} with different ids. Speculative decoding needs one vocabulary: pick a {name} from the same "
            f"model family as the {first_name} (see conf/models/ for pairs that share a tokenizer)."
        )
    return real_vocab_size(first)


def check_model_covers_vocab(name: str, model: PreTrainedModel, vocab_size: int) -> None:
    """A model's output layer must have at least one row per real token id."""
    rows = model.get_output_embeddings().weight.shape[0]
    if rows < vocab_size:
        raise VocabularyMismatchError(
            f"The {name} model has {rows} output rows but the tokenizer has {vocab_size} tokens: this checkpoint "
            f"was trained with another tokenizer. Use a {name} whose tokenizer matches the others (or, for a model "
            f"built from a config, leave its vocab_size unset so it takes the tokenizer's)."
        )
