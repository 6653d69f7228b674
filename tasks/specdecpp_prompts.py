"""SpecDec++'s prompts (Kaffaljidhmah2/SpecDec_pp, data/gen_dataset.py): per-task templates wrapped in Llama-2-chat's
`[INST] ... [/INST]`. Picked with `task.prompt_style=specdecpp` (the `specdecpp` experiment sets it).

- Alpaca: the instruction, then "\\nInput: " and the input when there is one;
- GSM8K: MetaMath's evaluation template, ending "### Response: Let's think step by step.";
- HumanEval: WizardCoder's template ("Create a Python script for this problem:").
"""

from __future__ import annotations

B_INST, E_INST = "[INST]", "[/INST]"
GSM8K_METAMATH = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response: Let's think step by step."
)
HUMANEVAL_WIZARDCODER = """Below is an instruction that describes a task. Write a response that appropriately completes the request.


### Instruction:
Create a Python script for this problem:
{prompt}

### Response:"""


def llama2_inst(prompt: str) -> str:
    """`[INST] <prompt, stripped> [/INST]`, as the public code wraps every prompt (no system prompt)."""
    return f"{B_INST} {prompt.strip()} {E_INST}"


def alpaca_prompt(instruction: str, input_text: str | None) -> str:
    if input_text is None or not input_text.strip():
        return llama2_inst(instruction)
    return llama2_inst(instruction + "\nInput: " + input_text)


def gsm8k_prompt(question: str) -> str:
    return llama2_inst(GSM8K_METAMATH.format(instruction=question))


def humaneval_prompt(prompt: str) -> str:
    return llama2_inst(HUMANEVAL_WIZARDCODER.format(prompt=prompt))
