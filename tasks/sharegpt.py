"""ShareGPT conversations (`{"id", "conversations": [{"from": "human"|"gpt", "value"}]}`), read from local files.

Each conversation gives one example: the prompt is the chat up to its last assistant turn, the answer that turn.
Prompts are rendered with the tokenizer's chat template (`chat_template: true`); metric: ROUGE-L against the
recorded reply (a cheap proxy: for speculative decoding the output is the target's anyway).
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


def split_conversation(record: Record) -> tuple[list[dict[str, str]], str]:
    """`(messages before the answer, answer)`: trailing user turns are dropped; the answer is the last reply.

    Raises:
        ValueError: unknown speaker, or no assistant reply that follows a user turn.
    """
    messages = []
    for turn in record["conversations"]:
        speaker = str(turn["from"]).lower()
        if speaker not in ROLES:
            raise ValueError(
                f"ShareGPT record {record.get('id')!r}: unknown speaker {turn['from']!r}; use {sorted(ROLES)}."
            )
        messages.append({"role": ROLES[speaker], "content": turn["value"]})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()  # a final question nobody answered
    if not messages or not any(m["role"] == "user" for m in messages[:-1]):
        raise ValueError(f"ShareGPT record {record.get('id')!r} has no assistant reply to a user turn.")
    return messages[:-1], messages[-1]["content"]


class ShareGPT(RougeTask):
    """Multi-turn chat data; no hub default: give `task.data_files` (JSON list or JSONL of conversations).

    A single file is the train split; validation and test are held out from its end (200 each by default).
    Records with no usable reply are skipped on load (and counted in a warning).
    """

    name = "sharegpt"
    required_columns = ("conversations",)
    default_path = None
    default_splits = {"train": "train", "validation": None, "test": None}
    default_holdout = {"validation": 200, "test": 200}
    default_chat_template = True

    def valid_record(self, record: Record) -> bool:
        try:
            split_conversation(record)
        except (ValueError, KeyError, TypeError):
            return False
        return True

    def prompt(self, record: Record) -> list[dict[str, str]]:
        return split_conversation(record)[0]

    def answer(self, record: Record) -> str:
        return split_conversation(record)[1]
