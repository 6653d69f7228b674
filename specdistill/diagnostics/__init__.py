"""Token-level diagnostics of a draft against its target (AdaSPEC's margin and case-study analyses).

Pure functions on logits and token strings, and the plots of what they return; nothing here trains or loads a model.

- `margins`: `top2_margin`, `signed_margins` (`SignedMargins`) and `margin_summary`.
- `kl`: `per_token_kl`, forward KL(target || draft) per position.
- `summary`: `summarise`, plain-number statistics for result.json.
- `token_classes`: `token_class`, `kept_dropped_by_class` and `class_counts`, which tokens a selector kept, by kind.
- `positions`: `position_diagnostics`, margins, agreement and KL of a draft at answer positions, and their summary.
- `plots`: `plot_margins`, `plot_kl`, every draft's distribution overlaid.

Functions taking both models' logits take `(draft_logits, target_logits)`, both `(N, V)` over the same positions and
vocabulary; note that `specdistill.losses` orders them the other way, `(target_logits, draft_logits)`.
"""

from specdistill.diagnostics.kl import per_token_kl
from specdistill.diagnostics.margins import SignedMargins, margin_summary, signed_margins, top2_margin
from specdistill.diagnostics.positions import (
    PositionDiagnostics,
    paper_direction,
    position_diagnostics,
    summarise_positions,
)
from specdistill.diagnostics.summary import summarise
from specdistill.diagnostics.token_classes import (
    TOKEN_CLASSES,
    class_counts,
    kept_dropped_by_class,
    token_class,
)

__all__ = [
    "TOKEN_CLASSES",
    "PositionDiagnostics",
    "SignedMargins",
    "class_counts",
    "kept_dropped_by_class",
    "margin_summary",
    "paper_direction",
    "per_token_kl",
    "position_diagnostics",
    "signed_margins",
    "summarise",
    "summarise_positions",
    "token_class",
    "top2_margin",
]
