"""Tokenizer loading for hub ids and local exports."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(
    pretrained_model_name_or_path: str, revision: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer; causal LMs without a pad token (Pythia, Llama) get their EOS token as pad token."""
    tokenizer = AutoTokenizer.from_pretrained(
        pretrained_model_name_or_path, revision=revision, trust_remote_code=trust_remote_code
    )
    return ensure_pad_token(tokenizer)


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "The tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token before training."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
