"""The requests of `epd bench stack`: a seeded set of chat bodies and the exact engine input the
gateway makes of each.

Every request is one user message of seeded random words sized to a seeded prompt length, asked
greedily (temperature 0), streaming, with thinking off and a fixed max_tokens. The gateway's own
adapter (`services.gateway.adapter.Adapter`, configured from the topology's gateway settings as the
gateway configures it) renders the chat template and tokenizes, so the in-process engine gets the
very prompt ids and SamplingParams the gateway sends to the workers.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Common English words: about one token each with their leading space, so a prompt's length is
# close to its word count; random order keeps prompts apart (no shared 128-token prefix block).
WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point number group problem fact be have do say get make go know take see come think "
         "look want give use find tell ask seem feel try leave call good new first last long great "
         "little own other old right big high different small large next early young important few "
         "public bad same able river stone light market paper music table window garden letter").split()
SIZE_PASSES = 4                 # corrections of the word count towards the target prompt length


@dataclass(frozen=True, slots=True)
class BenchRequest:
    label: str                  # "bench" | "warmup": part of the request id
    round: int
    stream: int
    body: bytes                 # the HTTP body (OpenAI Chat Completions, streaming)
    prepared: object            # services.gateway.adapter.PreparedRequest: prompt ids, sampling, stream

    @property
    def request_id(self) -> str:
        return f"{self.label}-{self.round}-{self.stream}"

    @property
    def prompt_ids(self) -> list[int]:
        return self.prepared.prompt_ids

    def text_of(self, token_ids: list[int], finish_reason: int) -> str:
        """What a client sees for these output tokens: the gateway's own response stream, parsed."""
        from bench.gateway.command import visible_text
        stream = self.prepared.open_stream(self.request_id)
        reasoning, answer = visible_text(stream.push(token_ids, finish_reason))
        return reasoning + answer


class Workload:
    """Builds the bench requests with the gateway's adapter, as the topology's gateway would."""

    def __init__(self, gateway_settings: dict, workdir: Path) -> None:
        from services.gateway.adapter import Adapter, AdapterConfig, ServedModel
        from services.gateway.model_dir import context_length, served_encoding
        settings = dict(gateway_settings)
        model_dir = workdir / settings["model_dir"]
        context = settings.get("context_length") or context_length(str(model_dir))
        self.model = settings.get("served_model", "deepseek-v41-tiny")
        served = ServedModel(self.model, context_length=context, tokenizer_path=str(model_dir / "tokenizer.json"),
                             encoding=served_encoding(str(model_dir), settings.get("encoding", "")),
                             max_output_tokens=settings.get("max_output_tokens", 0))
        self.adapter = Adapter(AdapterConfig(models=(served,)))

    def requests(self, rounds: int, streams: int, prompt_range: tuple[int, int], max_tokens: int,
                 seed: int, label: str = "bench") -> list[list[BenchRequest]]:
        """rounds x streams requests; prompt lengths drawn uniformly from prompt_range (tokens)."""
        rng = random.Random(seed)
        return [[self.request(label, r, s, rng.randint(*prompt_range), max_tokens, rng) for s in range(streams)]
                for r in range(rounds)]

    def request(self, label: str, round_: int, stream: int, prompt_tokens: int, max_tokens: int,
                rng: random.Random) -> BenchRequest:
        words = [rng.choice(WORDS) for _ in range(2 * prompt_tokens + 16)]
        count = prompt_tokens
        for _ in range(SIZE_PASSES):
            body = self.body(" ".join(words[:max(1, count)]), max_tokens)
            prepared = self._prepare(body)
            missing = prompt_tokens - len(prepared.prompt_ids)
            if missing == 0:
                break
            count = min(len(words), max(1, count + missing))
        return BenchRequest(label, round_, stream, body, prepared)

    def body(self, text: str, max_tokens: int) -> bytes:
        return json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "max_tokens": max_tokens, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True},
                           "thinking": {"type": "disabled"}}).encode()

    def _prepare(self, body: bytes):
        from services.gateway.adapter import Protocol
        return self.adapter.prepare(Protocol.CHAT, body)
