"""SpecDec++ on an EAGLE-3 head: rollouts label the head's own drafts (its teacher-forced step 0 over the target's
states, q on target ids through d2t, 0 outside the draft vocabulary) with min(1, p/q), and an acceptance head trains
on the EAGLE layer's output after the final norm."""

from __future__ import annotations

import torch

from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.eagle3 import Eagle3
from specdistill.rollout.run import run_rollouts
from tests.test_eagle3 import AUX, V, fused_states, tiny_head, tiny_target
from tests.threads import one_thread_per_module  # noqa: F401  (autouse fixture)

SAMPLING = SamplingConfig(temperature=1.0)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, V, (int(n),), generator=gen).tolist()
        for n in torch.randint(2, 6, (count,), generator=gen)
    ]


def _rollouts(tmp_path, target, head, prompts):
    return run_rollouts(
        target, head, prompts, tmp_path / "rollouts", sampling=SAMPLING, max_new_tokens=6, batch_size=3,
        shard_size=4, seed=3, vocab_size=V, eos_token_id=0, pad_token_id=0, kind=Eagle3(aux_layer_ids=list(AUX)),
    )  # fmt: skip


@torch.no_grad()
def _direct_labels(target, head, prompt: list[int], response: list[int], tokens: list[int]) -> torch.Tensor:
    """min(1, p/q) at every response position from one unbatched pass: q from the head's EAGLE position `P + i - 2`
    (reading the target's states of `P + i - 2` and token `P + i - 1`), scattered onto target ids."""
    ids = torch.tensor([prompt + response])
    out = head.unroll(fused_states(target, ids), ids, torch.ones_like(ids), 1)[0]
    p_all = torch.softmax(target(input_ids=ids).logits[0].float(), dim=-1)
    labels = []
    for i, token in enumerate(tokens):
        at = len(prompt) + i
        q = torch.zeros(V)
        q[head.target_ids] = torch.softmax(out.logits[0, at - 2].float(), dim=-1)
        assert q[token] > 0, "a drafted token must lie in the draft vocabulary"
        labels.append(min(1.0, float(p_all[at - 1, token] / q[token])))
    return torch.tensor(labels)


def test_rollouts_label_the_heads_own_drafts_with_min_one_p_over_q(tmp_path):
    target = tiny_target("llama")
    head = tiny_head(target)
    prompts = _prompts(7)
    data = _rollouts(tmp_path, target, head, prompts)
    outside = ~head.t2d
    drafted = 0
    for row in data:
        tokens, labels = row["draft_tokens"], torch.tensor(row["labels"])
        assert len(tokens) == len(row["response_ids"]) == len(labels) > 0
        assert not outside[tokens].any()  # q is 0 outside the draft vocabulary: never drafted
        expected = _direct_labels(target, head, row["prompt_ids"], row["response_ids"], tokens)
        torch.testing.assert_close(labels, expected, atol=2e-5, rtol=1e-4)
        drafted += len(tokens)
    assert drafted >= 20
