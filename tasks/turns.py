"""Multi-turn chats where every assistant turn is an answer to learn: pure functions on `[{"role", "content"}]`.

A chat task with `all_turns` trains on the whole conversation, one example per chat, with a loss on every assistant
turn (`specdistill.data.tokenize.encode_conversation`); its target answers are regenerated turn by turn, each in the
context of the target's own earlier replies (`specdistill.stages.target_answers`). The context of assistant turn i
is every message before it, with the assistant turns before it replaced by the replies given for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Message = Mapping[str, str]


def assistant_turns(messages: Sequence[Message]) -> int:
    """How many assistant turns `messages` has."""
    return sum(m["role"] == "assistant" for m in messages)


def with_replies(messages: Sequence[Message], replies: Sequence[str]) -> list[dict[str, str]]:
    """`messages` up to (not including) assistant turn `len(replies)`, its assistant turns' contents replaced by
    `replies` in order; all of `messages` when there are as many replies as turns.

    Raises:
        ValueError: more replies than assistant turns.
    """
    if len(replies) > assistant_turns(messages):
        raise ValueError(f"{len(replies)} replies for a chat of {assistant_turns(messages)} assistant turns")
    out: list[dict[str, str]] = []
    turn = 0
    for message in messages:
        if message["role"] == "assistant":
            if turn == len(replies):
                break
            message = {**message, "content": replies[turn]}
            turn += 1
        out.append(dict(message))
    return out


def replies_in_context(messages: Sequence[Message], answers: Mapping[str, str], key) -> list[str] | None:
    """Each assistant turn's answer from `answers` (`{key(context): answer}`), every context holding the earlier
    answers found: the chain a turn-by-turn regeneration wrote. None when a turn has no answer."""
    replies: list[str] = []
    for _ in range(assistant_turns(messages)):
        answer = answers.get(key(with_replies(messages, replies)))
        if answer is None:
            return None
        replies.append(answer)
    return replies
