"""The rewrite/copy workload (``bench --prompts rewrite``): chat requests whose answer mostly copies
the prompt, where prompt-lookup drafting has something to find.

Two conversations, each rendered with the served model's own chat template (generation prompt
added): a short Python file with a rename asked for (the answer is the whole file again, one name
changed), and a short document to summarise quoting its key sentences (the answer repeats them).
"""

from __future__ import annotations

from typing import Any

from scheduler.bench.output import BenchError

#: The code file of the rename request.
CODE_FILE = '''\
import json
from pathlib import Path


def load_scores(path):
    """Read a JSON file of {name: score} and return it as a dict."""
    with open(path) as f:
        return json.load(f)


def best_player(scores):
    """The name with the highest score, or None for no scores."""
    if not scores:
        return None
    return max(scores, key=scores.get)


def main():
    scores = load_scores(Path("scores.json"))
    print("best:", best_player(scores))


if __name__ == "__main__":
    main()
'''

#: The document of the summary request.
DOCUMENT = """\
The city council met on Tuesday to discuss the new bicycle lanes on Harbour Street. \
The mayor said that the lanes had cut traffic accidents by a third in their first year. \
Shop owners complained that the loss of parking spaces had reduced the number of customers. \
A cyclists' group presented a survey in which most riders said they now felt safe on the street. \
The council voted to keep the lanes and to add forty parking spaces on the side streets by next spring."""

#: The workload's conversations, one list of chat messages each.
REWRITE_CHATS: list[list[dict[str, str]]] = [
    [
        {
            "role": "user",
            "content": "Rename the function best_player to top_scorer everywhere in this file and return "
            f"the whole file, unchanged otherwise:\n\n```python\n{CODE_FILE}```",
        }
    ],
    [
        {
            "role": "user",
            "content": "Summarise this report in three sentences, quoting its key sentences word for word:\n\n"
            f"{DOCUMENT}",
        }
    ],
]


def rewrite_prompts(tokenizer: Any, b: int, seed: int) -> list[list[int]]:
    """``b`` prompts (token ids) from ``REWRITE_CHATS`` rendered with the tokenizer's chat template,
    starting at conversation ``seed`` and cycling, as ``text_prompts`` does for plain texts. A model
    without a chat template is refused with a one-line ``BenchError``."""
    if not getattr(tokenizer, "has_chat_template", False) and not getattr(tokenizer, "chat_template", None):
        raise BenchError("--prompts rewrite needs a model with a chat template (this one has none)")
    encoded = [
        [int(t) for t in tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)]
        for chat in REWRITE_CHATS
    ]
    return [encoded[(seed + i) % len(encoded)] for i in range(b)]
