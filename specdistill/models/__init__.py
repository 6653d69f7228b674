from specdistill.models.frozen import Frozen
from specdistill.models.loading import ModelSpec, freeze, load_model
from specdistill.models.vocab import (
    VocabularyMismatchError,
    check_model_covers_vocab,
    check_same_tokenizer,
    real_vocab_size,
)

__all__ = [
    "Frozen",
    "ModelSpec",
    "VocabularyMismatchError",
    "check_model_covers_vocab",
    "check_same_tokenizer",
    "freeze",
    "load_model",
    "real_vocab_size",
]
