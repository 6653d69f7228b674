"""Token-level diagnostics of a draft against its target (AdaSPEC's margin and case-study analyses).

Pure functions on logits and token strings; nothing here trains or loads a model.

- `margins`: `top2_margin`, `signed_margins` (`SignedMargins`) and `margin_summary`.
- `kl`: `per_token_kl`, forward KL(target || draft) per position.
- `summary`: `summarise`, plain-number statistics for result.json.
- `token_classes`: `token_class` and `kept_dropped_by_class`, which tokens a selector kept, by kind.

Functions taking both models' logits take `(draft_logits, target_logits)`, both `(N, V)` over the same positions and
vocabulary; note that `specdistill.losses` orders them the other way, `(target_logits, draft_logits)`.
"""

from specdistill.diagnostics.kl import per_token_kl
from specdistill.diagnostics.margins import SignedMargins, margin_summary, signed_margins, top2_margin
from specdistill.diagnostics.summary import summarise
from specdistill.diagnostics.token_classes import TOKEN_CLASSES, kept_dropped_by_class, token_class

__all__ = [
    "TOKEN_CLASSES",
    "SignedMargins",
    "kept_dropped_by_class",
    "margin_summary",
    "per_token_kl",
    "signed_margins",
    "summarise",
    "token_class",
    "top2_margin",
]
