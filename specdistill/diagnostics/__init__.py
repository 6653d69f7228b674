"""Token-level diagnostics of a draft against its target (AdaSPEC's margin analyses).

Pure functions on logits; nothing here trains or loads a model.

- `margins`: `top2_margin`, `signed_margins` (`SignedMargins`) and `margin_summary`.
- `kl`: `per_token_kl`, forward KL(target || draft) per position.
- `summary`: `summarise`, plain-number statistics for result.json.

Functions taking both models' logits take `(draft_logits, target_logits)`, both `(N, V)` over the same positions and
vocabulary; note that `specdistill.losses` orders them the other way, `(target_logits, draft_logits)`.
"""

from specdistill.diagnostics.kl import per_token_kl
from specdistill.diagnostics.margins import SignedMargins, margin_summary, signed_margins, top2_margin
from specdistill.diagnostics.summary import summarise

__all__ = [
    "SignedMargins",
    "margin_summary",
    "per_token_kl",
    "signed_margins",
    "summarise",
    "top2_margin",
]
