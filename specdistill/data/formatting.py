"""Turning a task's prompt (text or chat messages) into the exact text the model reads."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from specdistill.tasks.base import Record, Task


def render_prompt(task: Task, record: Record, tokenizer: PreTrainedTokenizerBase) -> str:
    """The prompt text of `record`: the tokenizer's chat template when `task.chat_template`, else the plain text.

    With a chat template, a text prompt becomes one user message, and the template's generation prompt (e.g.
    "<|im_start|>assistant\\n") is appended so that the answer follows it directly.

    Raises:
        ValueError: the task wants a chat template but the tokenizer has none, or the task gives chat messages
            while `task.chat_template` is false.
    """
    prompt = task.prompt(record)
    if not task.chat_template:
        if not isinstance(prompt, str):
            raise ValueError(
                f"Task {task.name!r} gives chat messages but task.chat_template is false; set "
                "task.chat_template=true and use a tokenizer with a chat template."
            )
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"Task {task.name!r} renders prompts with a chat template but the tokenizer "
            f"({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')!r}) has none; use a chat "
            "model's tokenizer or set task.chat_template=false (single-turn tasks only)."
        )
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
