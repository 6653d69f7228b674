"""Tokenizer loading for hub ids and local exports, or from the tokenizer a GGUF file carries."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from specdistill.models.loading import gguf_path


def load_tokenizer(
    pretrained_model_name_or_path: str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer; causal LMs without a pad token (Pythia, Llama) get their EOS token as pad token.

    Args:
        pretrained_model_name_or_path: hub id or local directory.
        revision: hub revision (branch, tag or commit).
        trust_remote_code: run the repository's own tokenizer code; off unless the user turns it on.
        gguf_file: a GGUF file inside `pretrained_model_name_or_path` whose vocabulary, merges and special tokens
            give the tokenizer (checked like the model's: `specdistill.models.loading.gguf_path`); None: the
            directory's tokenizer files.
    """
    if gguf_file is not None:
        file = gguf_path(pretrained_model_name_or_path, gguf_file, revision)
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        return ensure_pad_token(tokenizer)
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
