"""Multi-turn chats read from local files, in ShareGPT's schema (`{"id", "conversations": [{"from": "human"|"gpt",
"value"}]}`) or UltraChat's and the OpenAI messages layout (`{"messages": [{"role": "user"|"assistant", "content"}]}`).

Each conversation gives one example, rendered with the tokenizer's chat template (`chat_template: true`):

* `all_turns: true` (the default): the whole chat, with a loss on every assistant turn (masks from the chat
  template, `specdistill.data.tokenize.encode_conversation`); the `target_answers` step regenerates every
  assistant turn, each in the context of the target's own earlier replies (`specdistill.tasks.turns`);
* `all_turns: false`: the prompt is the chat up to its last assistant turn, the answer that turn.

Generation and scoring read the last turn either way: the prompt is the chat before it, and the metric is ROUGE-L
against the recorded reply (a cheap proxy: for speculative decoding the output is the target's anyway).
"""

from __future__ import annotations

from specdistill.tasks.base import Record
from specdistill.tasks.rouge_task import RougeTask

# speaker names found in ShareGPT dumps -> chat-template roles
ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def chat_messages(record: Record) -> list[dict[str, str]]:
    """`[{"role", "content"}]` of a record in ShareGPT's schema (`conversations`) or UltraChat's (`messages`).

    Raises:
        ValueError: neither column, or a speaker or role that is not a chat role.
    """
    if record.get("conversations") is not None:
        turns = [(turn["from"], turn["value"]) for turn in record["conversations"]]
    elif record.get("messages") is not None:
        turns = [(turn["role"], turn["content"]) for turn in record["messages"]]
    else:
        raise ValueError(f"chat record {record.get('id')!r} has neither `conversations` nor `messages`")
    messages = []
    for speaker, text in turns:
        if str(speaker).lower() not in ROLES:
            raise ValueError(
                f"chat record {record.get('id')!r}: unknown speaker {speaker!r}; use {sorted(ROLES)}."
            )
        messages.append({"role": ROLES[str(speaker).lower()], "content": text})
    return messages


def answered_chat(record: Record) -> list[dict[str, str]]:
    """The chat up to and including its last assistant turn (a final question nobody answered is dropped).

    Raises:
        ValueError: as `chat_messages`, or no assistant reply that follows a user turn.
    """
    messages = chat_messages(record)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    if not messages or not any(m["role"] == "user" for m in messages[:-1]):
        raise ValueError(f"chat record {record.get('id')!r} has no assistant reply to a user turn.")
    return messages


def split_conversation(record: Record) -> tuple[list[dict[str, str]], str]:
    """`(messages before the answer, answer)`: trailing user turns are dropped; the answer is the last reply."""
    messages = answered_chat(record)
    return messages[:-1], messages[-1]["content"]


class ShareGPT(RougeTask):
    """Multi-turn chat data; no hub default: give `task.data_files` (JSON list or JSONL of conversations).

    A single file is the train split; validation and test are held out from its end (200 each by default).
    Records with no usable reply are skipped on load (and counted in a warning).

    Args:
        all_turns: train on every assistant turn of a chat (default), or only on its last one.
        **kwargs: `Task`'s.
    """

    name = "sharegpt"
    required_columns = ()  # `conversations` or `messages`: `record_problem`
    default_path = None
    default_splits = {"train": "train", "validation": None, "test": None}
    default_holdout = {"validation": 200, "test": 200}
    default_chat_template = True

    def __init__(self, all_turns: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.all_turns = bool(all_turns)

    def record_problem(self, record: Record) -> str | None:
        if record.get("conversations") is None and record.get("messages") is None:
            return "no `conversations` (ShareGPT) or `messages` (UltraChat) list"
        return None

    def valid_record(self, record: Record) -> bool:
        try:
            answered_chat(record)
        except (ValueError, KeyError, TypeError):
            return False
        return True

    def prompt(self, record: Record) -> list[dict[str, str]]:
        return split_conversation(record)[0]

    def answer(self, record: Record) -> str:
        return split_conversation(record)[1]

    def conversation(self, record: Record) -> list[dict[str, str]] | None:
        return answered_chat(record) if self.all_turns else None
