"""Tokenising prompt + answer pairs with prompt masking and a documented truncation policy.

An example is `prompt ids + answer ids + [eos]`; `labels` copy the ids on the answer (EOS included, so models learn
to stop) and hold -100 on the prompt (HF convention, unshifted: position t's label is token t). Prompt and answer
are tokenised separately and concatenated, so the boundary between them is exact and the prompt ids are what
generation starts from.

Truncation policies (`truncation=`) for examples longer than `max_length`:

* `"prompt_left"` (default): drop tokens from the *start of the prompt* first, keeping at least the last prompt
  token (so the first answer token is still predicted); if the answer alone is still too long, drop the *end of
  the answer* (EOS goes first: a cut answer does not end with EOS).
* `"drop"`: drop any example longer than `max_length`.

An example left with no answer token to predict (no label after the shift) is dropped; the caller counts them.

A chat trained on every assistant turn (`Task.training_conversation`) is one example with a loss on each assistant
turn (`encode_conversation`): the masks come from the chat template itself. The template renders the chat up to
each assistant turn with its generation prompt, then with that turn; the text between the two is the turn as the
template writes it (its content and end-of-turn markup, e.g. ChatML's `<|im_end|>`), and is labelled; everything
else (system, user turns, each turn's header) is -100. The pieces are tokenised one by one, so every boundary is
exact, and the example's prompt (what generation starts from) is everything before the last assistant turn. A chat
longer than `max_length` keeps its first `max_length` tokens under `prompt_left` (its later turns go), and is
dropped under `drop`. A template that rewrites earlier turns when a later one is added (one that strips reasoning
from past replies, say) cannot be masked this way: that is an error naming `task.all_turns=false`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from specdistill.data.formatting import render_prompt
from specdistill.errors import DataError
from specdistill.tasks.base import Record, Task

log = logging.getLogger(__name__)

IGNORE_INDEX = -100

# (prompt_ids, answer_ids incl. EOS, max_length) -> the kept (prompt_ids, answer_ids), or None to drop the example
TruncationPolicy = Callable[[list[int], list[int], int], tuple[list[int], list[int]] | None]


def truncate_prompt_left(
    prompt: list[int], answer: list[int], max_length: int
) -> tuple[list[int], list[int]]:
    """Cut the start of the prompt first (keeping >= 1 prompt token), then the end of the answer."""
    if len(prompt) + len(answer) <= max_length:
        return prompt, answer
    keep_prompt = max(max_length - len(answer), min(len(prompt), 1))
    keep_prompt = min(keep_prompt, len(prompt))
    kept_prompt = prompt[len(prompt) - keep_prompt :]
    return kept_prompt, answer[: max(max_length - keep_prompt, 0)]


def drop_long(prompt: list[int], answer: list[int], max_length: int) -> tuple[list[int], list[int]] | None:
    """Keep the example whole or not at all."""
    return (prompt, answer) if len(prompt) + len(answer) <= max_length else None


TRUNCATION_POLICIES: dict[str, TruncationPolicy] = {"prompt_left": truncate_prompt_left, "drop": drop_long}


def truncation_policy(name: str) -> TruncationPolicy:
    if name not in TRUNCATION_POLICIES:
        raise ValueError(f"truncation={name!r} is not a policy; use one of {sorted(TRUNCATION_POLICIES)}.")
    return TRUNCATION_POLICIES[name]


@dataclass(frozen=True)
class Encoded:
    """One tokenised example: `input_ids` and `labels` of equal length, the first `prompt_length` labels -100."""

    input_ids: list[int]
    labels: list[int]
    prompt_length: int

    @property
    def answer_tokens(self) -> int:
        """Answer tokens that are predicted (labels[1:] != -100)."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


def encode_pair(
    prompt_ids: Sequence[int],
    answer_ids: Sequence[int],
    eos_token_id: int,
    max_length: int,
    policy: TruncationPolicy,
) -> Encoded | None:
    """Concatenate `prompt_ids + answer_ids + [eos]`, truncate by `policy`, mask the prompt; None if no answer left."""
    kept = policy(list(prompt_ids), [*answer_ids, eos_token_id], max_length)
    if kept is None:
        return None
    prompt, answer = kept
    encoded = Encoded(prompt + answer, [IGNORE_INDEX] * len(prompt) + answer, len(prompt))
    return encoded if encoded.answer_tokens > 0 else None


def conversation_pieces(
    messages: Sequence[Mapping[str, str]], tokenizer: PreTrainedTokenizerBase
) -> list[tuple[str, bool]]:
    """The chat as rendered by the tokenizer's chat template, cut into `(text, is_assistant_turn)` pieces whose
    concatenation is the whole rendering (module docstring).

    Raises:
        DataError: the template renders a shorter chat as something other than a prefix of a longer one.
    """
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = tokenizer.apply_chat_template(
            list(messages[:i]), tokenize=False, add_generation_prompt=True
        )
        turn = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False)
        if not (context.startswith(done) and turn.startswith(context)):
            raise DataError(
                f"The chat template of {getattr(tokenizer, 'name_or_path', '?')!r} renders assistant turn {i} "
                "so that the chat before it is not a prefix of the chat with it (it rewrites earlier turns), so "
                "its turns cannot be masked one by one; set task.all_turns=false to train on the last turn only."
            )
        pieces += [(context[len(done) :], False), (turn[len(context) :], True)]
        done = turn
    return [(text, answer) for text, answer in pieces if text]


def encode_conversation(
    messages: Sequence[Mapping[str, str]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncation: str,
) -> Encoded | None:
    """One example of a whole chat with every assistant turn labelled (module docstring); None when `drop` drops
    it or no assistant token is left to predict. `prompt_length` is where its last kept assistant turn starts."""
    ids: list[int] = []
    labels: list[int] = []
    for text, answer in conversation_pieces(messages, tokenizer):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if answer else [IGNORE_INDEX] * len(piece)
    if len(ids) > max_length:
        if truncation == "drop":
            return None
        ids, labels = ids[:max_length], labels[:max_length]
    encoded = Encoded(ids, labels, last_answer_start(labels))
    return encoded if encoded.prompt_length > 0 and encoded.answer_tokens > 0 else None


def last_answer_start(labels: Sequence[int]) -> int:
    """Where the last run of labelled positions starts (0: none after position 0)."""
    starts = [t for t in range(1, len(labels)) if labels[t] != IGNORE_INDEX and labels[t - 1] == IGNORE_INDEX]
    return starts[-1] if starts else 0


def special_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids a tokenizer puts *before* the text with `add_special_tokens=True` (e.g. Llama's BOS), else []."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def tokenize_records(
    task: Task,
    records: Sequence[Record],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncation: str = "prompt_left",
) -> tuple[list[Encoded], list[int]]:
    """Tokenise `records` of `task`; returns `(encoded examples, their indices in records)`; dropped ones are absent.

    Plain-text prompts get the tokenizer's leading special tokens (e.g. BOS) but never trailing ones; chat-template
    prompts already hold their special tokens as text. Answers get no special tokens; EOS is appended.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has no EOS token; answers end with EOS, so set tokenizer.eos_token.")
    policy = truncation_policy(truncation)
    chats = [task.training_conversation(record) for record in records]
    if any(chat is not None for chat in chats):  # a chat task trained on every assistant turn
        return encode_conversations(task, chats, tokenizer, max_length, truncation)
    prompts = [render_prompt(task, record, tokenizer) for record in records]
    answers = [task.training_answer(record) for record in records]
    prefix = [] if task.chat_template else special_prefix(tokenizer)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    answer_ids = tokenizer(answers, add_special_tokens=False)["input_ids"] if answers else []
    encoded, kept = [], []
    pairs = zip(prompt_ids, answer_ids, strict=True)
    truncated = sum(len(prefix) + len(p) + len(a) + 1 > max_length for p, a in pairs)
    if truncated:
        log.warning(
            "%s: %d of %d examples are longer than max_length=%d and are truncated (truncation=%r)%s",
            task.name, truncated, len(records), max_length, truncation,
            "; every one of them: raise max_length" if truncated == len(records) else "",
        )  # fmt: skip
    for i, (p, a) in enumerate(zip(prompt_ids, answer_ids, strict=True)):
        example = encode_pair(prefix + list(p), a, tokenizer.eos_token_id, max_length, policy)
        if example is not None:
            encoded.append(example)
            kept.append(i)
    return encoded, kept


def encode_conversations(
    task: Task,
    chats: Sequence[Sequence[Mapping[str, str]] | None],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    truncation: str,
) -> tuple[list[Encoded], list[int]]:
    """`tokenize_records` for chats trained on every assistant turn (`encode_conversation`)."""
    if getattr(tokenizer, "chat_template", None) is None or not task.chat_template:
        raise DataError(
            f"Task {task.name!r} trains on every assistant turn of its chats, which needs the tokenizer's chat "
            "template (task.chat_template=true and a chat model's tokenizer); or set task.all_turns=false."
        )
    encoded, kept = [], []
    for i, chat in enumerate(chats):
        if chat is None:
            raise DataError(f"Task {task.name!r} gave a record that is not a chat among chats (record {i}).")
        example = encode_conversation(chat, tokenizer, max_length, truncation)
        if example is not None:
            encoded.append(example)
            kept.append(i)
    return encoded, kept
