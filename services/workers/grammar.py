"""A constrained request's matcher on a worker: the compiled grammar, fetched or handed over.

The prefill and unified workers ask the compiler replica the gateway named (GrammarRef.compiler)
for the constraint's artifact while the request's prefix loads; the gateway asked it first, so
the answer comes from its cache or joins the compile under way. The decode worker gets the
artifact inside the StateHandoff. The matcher is built off the event loop and the engine thread
(the tokenizer's ~1 s table is built once, at start), then replays what the request already
produced: a resume's streamed tokens, the prefill's first token.

Building a matcher costs about what the compile did (llguidance has no compiled form): milliseconds
usually, seconds for a schema near the compiler's limit. Agents send the same tools again and
again, so a pristine matcher per constraint key is kept (`template_cache` of them, LRU) and each
request gets a copy, which takes microseconds.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path

from messages.errors import InvalidRequest, WireError
from messages.grammar import GrammarCompile, GrammarCompiled, GrammarRef, tokenizer_id


class GrammarSource:
    template_cache = 64

    def __init__(self, worker):
        self.worker = worker
        self.tokenizer_id = ""
        self._tokenizer: asyncio.Future | None = None
        self._templates: OrderedDict[str, object] = OrderedDict()   # constraint key -> pristine matcher

    def open(self, model_dir: str, vocab_size: int, eos_ids: int | tuple[int, ...]) -> None:
        """Start building the matcher tokenizer in the background (about 1 s for the 129k vocabulary);
        `eos_ids`: every id that ends generation, so a finished grammar stops on any of them."""
        from engine.grammar import load_grammar_tokenizer
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            return
        self.tokenizer_id = tokenizer_id(str(path))
        self._tokenizer = asyncio.get_running_loop().run_in_executor(
            None, load_grammar_tokenizer, str(path), vocab_size, eos_ids)

    async def fetch(self, ref: GrammarRef, request_id: str, span) -> str:
        """The artifact for `ref` from its compiler; InvalidRequest (or the compiler's own error) when
        it cannot be had."""
        self._check(ref, request_id)
        if not ref.compiler:
            raise InvalidRequest("the request's grammar names no compiler", request_id=request_id)
        reply = await self.worker.call(ref.compiler, GrammarCompile(ref.constraint, ref.tokenizer_id, ref.key),
                                       request_id=request_id, span=span,
                                       timeout=self.worker.settings.grammar_timeout_s)
        compiled = reply.message
        if not isinstance(compiled, GrammarCompiled) or compiled.key != ref.key:
            raise InvalidRequest(f"the compiler answered {type(compiled).__name__} for another key", request_id=request_id)
        return compiled.grammar

    async def state(self, ref: GrammarRef, grammar: str, request_id: str, produced=()):
        """The request's matcher, having consumed ref.replay and then `produced`."""
        from engine.grammar import GrammarError, GrammarState, build_matcher
        self._check(ref, request_id)
        tokenizer = await self._tokenizer
        replay = list(ref.replay) + list(produced)
        loop = asyncio.get_running_loop()
        try:
            template = self._templates.get(ref.key)
            if template is None:
                template = await loop.run_in_executor(None, build_matcher, tokenizer, grammar)
                self._templates[ref.key] = template
                while len(self._templates) > self.template_cache:
                    self._templates.popitem(last=False)
            self._templates.move_to_end(ref.key)
            return await loop.run_in_executor(None, lambda: GrammarState(
                tokenizer, grammar, after_token=ref.after_token, replay=replay, template=template))
        except GrammarError as exc:
            raise InvalidRequest(f"the request's grammar: {exc}", request_id=request_id) from None

    def _check(self, ref: GrammarRef, request_id: str) -> None:
        if self._tokenizer is None:
            raise InvalidRequest("this worker has no tokenizer.json: it cannot run constrained requests",
                                 request_id=request_id)
        if ref.tokenizer_id != self.tokenizer_id:
            raise InvalidRequest(f"the constraint was compiled for tokenizer {ref.tokenizer_id}; this worker "
                                 f"serves {self.tokenizer_id}", request_id=request_id)


async def fetch_quietly(source: GrammarSource, ref: GrammarRef | None, request_id: str, span) -> str | WireError:
    """Fetch as a task running beside the prefix load: the error is returned, raised by the caller later."""
    if ref is None:
        return ""
    try:
        return await source.fetch(ref, request_id, span)
    except WireError as exc:
        return exc
