"""`judged_head_inputs`: the head's inputs at a batch's judged states, from one frozen draft pass.

Candidate heads read the draft's last hidden states there; proposer heads read those states with `q(Y_i)` appended
(`specdistill.models.acceptance_head.build_head_input`), q being the draft distribution that the decoding policies
see (`SamplingConfig.policy_probs`; docs/METHODS.md section 4).
"""

from __future__ import annotations

import torch

from specdistill.decoding.sampling import SamplingConfig
from specdistill.models.acceptance_head import build_head_input, draft_hidden_states, draft_logits


@torch.no_grad()
def judged_head_inputs(
    draft: torch.nn.Module, batch: dict[str, torch.Tensor], head_input: str, sampling: SamplingConfig
) -> torch.Tensor:
    """`(N, D)` head inputs at the batch's judged states (`loss_mask`, row-major), from one frozen draft pass.

    Args:
        draft: the frozen draft.
        batch: a rollout batch from `RolloutCollator` built for the same `head_input`.
        head_input: `"candidate"` or `"proposer"`.
        sampling: the decoding settings; a proposer head reads `sampling.policy_probs` of the draft's logits, the
            distribution the engine's policies see.
    """
    keep = batch["loss_mask"]
    hidden = draft_hidden_states(draft, batch["input_ids"], batch["attention_mask"])[keep]
    if head_input != "proposer":
        return hidden
    probs = sampling.policy_probs(draft_logits(draft, hidden))
    return build_head_input(head_input, hidden, probs, batch["draft_tokens"][keep])
