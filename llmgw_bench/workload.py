"""What to send: prompts of exact token lengths, from random words, a ShareGPT file or a prompts file.

Token counts come from a local Hugging Face tokenizer or from the server's own `/tokenize` route (TGI's
shape, which this gateway also serves, or vLLM's). A count is of the prompt text alone, without special
tokens or a chat template, as `vllm bench serve` counts it; the server's usage reports what it really saw.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

# Common English words: prompts read like text, so tokenizers split them as they split real traffic.
WORDS = """time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word business issue side kind head house
service friend father power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river mountain garden window paper music
market light voice table street green quiet simple happy early late small large open short long bright""".split()


@dataclass(frozen=True)
class Sample:
    prompt: str
    input_len: int
    output_len: int


TokenCounter = Callable[[str], int]


def local_counter(tokenizer_path: str) -> TokenCounter:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def server_counter(url: str, model: str | None, headers: dict[str, str]) -> TokenCounter:
    """The server's tokenizer: TGI's `POST /tokenize {"inputs"}` or vLLM's `POST /tokenize {"prompt"}`."""
    client = httpx.Client(base_url=url, headers=headers, timeout=30)

    def tgi(text: str) -> int:
        response = client.post("/tokenize", json={"inputs": text})
        response.raise_for_status()
        body = response.json()
        if not isinstance(body, list):
            raise ValueError("not TGI's /tokenize")
        return len(body)

    def vllm(text: str) -> int:
        response = client.post("/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        return int(response.json()["count"])

    for candidate in (tgi, vllm):
        try:
            candidate("hello world")
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            continue
        return candidate
    raise SystemExit(f"llmgw bench: {url} has no /tokenize route this tool knows; give --tokenizer PATH")


def text_of_length(counter: TokenCounter, target: int, rng: random.Random, prefix: str = "") -> str:
    """Random words whose token count (after `prefix`) is exactly `target` where the tokenizer allows.

    Binary search on the number of words, then single-token fillers to close the last gap.
    """
    words = [rng.choice(WORDS) for _ in range(2 * target + 8)]
    base = counter(prefix) if prefix else 0
    low, high = 0, len(words)
    while low < high:  # largest k with count(k words) <= target
        mid = (low + high + 1) // 2
        if counter(prefix + " ".join(words[:mid])) - base <= target:
            low = mid
        else:
            high = mid - 1
    text = " ".join(words[:low])
    for _ in range(target):
        if counter(prefix + text) - base >= target:
            break
        text = (text + " a") if text else "a"
    return text


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_samples(counter: TokenCounter, count: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0) -> list[Sample]:
    """`count` prompts; a shared prefix of `prefix_len` tokens (for prefix caching) then random words."""
    rng = random.Random(seed)
    prefix = text_of_length(counter, prefix_len, rng) + " " if prefix_len else ""
    samples = []
    for _ in range(count):
        body = text_of_length(counter, _length(rng, input_len, range_ratio), rng, prefix)
        prompt = prefix + body
        samples.append(Sample(prompt, counter(prompt), _length(rng, output_len, range_ratio)))
    return samples


def sharegpt_samples(path: Path, counter: TokenCounter, count: int, *, output_len: int | None = None,
                     seed: int = 0) -> list[Sample]:
    """First human turn as the prompt, the answer's length as the output length; vLLM's filter."""
    conversations = [c["conversations"] for c in json.loads(path.read_text())
                     if len(c.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(conversations)
    samples = []
    for turns in conversations:
        if len(samples) == count:
            break
        prompt, answer = turns[0]["value"], turns[1]["value"]
        prompt_len = counter(prompt)
        wanted = output_len if output_len is not None else counter(answer)
        if prompt_len < 4 or wanted < 4 or prompt_len > 1024 or prompt_len + wanted > 2048:
            continue
        samples.append(Sample(prompt, prompt_len, wanted))
    if not samples:
        raise SystemExit(f"llmgw bench: no usable conversations in {path}")
    return samples


def prompt_file_samples(path: Path, counter: TokenCounter, output_len: int) -> list[Sample]:
    """One prompt per line, or JSON lines `{"prompt": ..., "output_len": ...}`."""
    samples = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        wanted = output_len
        if path.suffix == ".jsonl":
            record = json.loads(line)
            line, wanted = record["prompt"], int(record.get("output_len", output_len))
        samples.append(Sample(line, counter(line), wanted))
    if not samples:
        raise SystemExit(f"llmgw bench: {path} has no prompts")
    return samples
