"""`judged_head_inputs`: the head's inputs at a batch's judged states, from one frozen draft pass.

Candidate heads read the draft's last hidden states there; proposer heads read those states with `q(Y_i)` appended
(`specdistill.models.acceptance_head.build_head_input`), q being the draft distribution that the decoding policies
see (`SamplingConfig.policy_probs`; docs/METHODS.md section 4). The states and q come from the draft's kind
(`DraftKind.teacher_forced`): a causal LM's own last hidden state, or an EAGLE-3 head's layer output after its final
norm over the target's states (what its proposer hands the engine).
"""

from __future__ import annotations

import torch

from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.base import DraftKind
from specdistill.models.acceptance_head import build_head_input


@torch.no_grad()
def judged_head_inputs(
    draft: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    head_input: str,
    sampling: SamplingConfig,
    kind: DraftKind | None = None,
    target: torch.nn.Module | None = None,
) -> torch.Tensor:
    """`(N, D)` head inputs at the batch's judged states (`loss_mask`, row-major), from one frozen draft pass.

    Args:
        draft: the frozen draft.
        batch: a rollout batch from `RolloutCollator` built for the same `head_input`.
        head_input: `"candidate"` or `"proposer"`.
        sampling: the decoding settings; a proposer head reads `sampling.policy_probs` of the draft's logits, the
            distribution the engine's policies see.
        kind: the draft's kind (default `DraftKind()`, a causal LM).
        target: the frozen target, for a kind that reads its hidden states (`DraftKind.reads_target`).
    """
    keep = batch["loss_mask"]
    states = (kind or DraftKind()).teacher_forced(draft, target, batch, None)
    hidden = states.hidden[keep]
    if head_input != "proposer":
        return hidden
    probs = sampling.policy_probs(states.head(hidden))
    return build_head_input(head_input, hidden, probs, batch["draft_tokens"][keep])
