"""The engine as the worker service sees it: add requests, step, read outputs, move state.

EngineCore is synchronous and single-threaded: each `step` schedules one batch (decode tokens and
prefill chunks), runs one forward, samples, and returns the outputs of the requests that got a
token or finished. Between steps callers may add, abort, snapshot, restore, export blocks.

E/P/D roles on top of that:
- prefill worker: `admit` = `import_prefix` (pages from the KV store + the window/tails at the hit
  boundary from the SWA registry holder) + `add_request(..., prefill_only=True)`: the first token comes out
  with `prefilled=True` and the request is held until `snapshot` + `release`.
- decode worker: `restore` (snapshot + the first token as generated_ids) continues the request;
  its full blocks enter the prefix cache; `export_boundary_state` serves saved windows to peers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.admission import Admitted, PrefixImport, admit
from engine.kv.manager import KVCache
from engine.kv.snapshot import make_boundary_snapshot, make_snapshot, parse_boundary_snapshot, parse_snapshot
from engine.loading import check_built_model, load_model
from engine.models.common.dtypes import DTYPES
from engine.models.spec import ModelSpec, check_model
from engine.runner import ModelRunner
from engine.sampling import make_generator, validate_sampling_params
from engine.scheduler import Scheduler, Sequence, SequenceStatus
from messages.common import FinishReason, SamplingParams
from messages.handoff import KVSnapshot
from messages.prefix import BLOCK_TOKENS, model_identity

if TYPE_CHECKING:
    from engine.grammar import GrammarState


WEIGHT_FORMATS = ("model", "released")


@dataclass(slots=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str | None = None  # None: the model config's dtype
    num_pages: int = 512  # block-KV pages of 128 tokens, preallocated
    max_num_seqs: int = 64
    max_batched_tokens: int = 2048
    enable_prefix_cache: bool = True
    batch_invariant: bool = False
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped by the pool)
    swa_cache_bytes: int = 1 << 30  # host memory for window + tail states saved at cached block boundaries
    bounded_replay: bool = True  # V4.1: a prefix hit without a saved window replays its last block (kv/manager.py)
    replay_trim: bool = True  # V4.1: a replay runs the layers above the last KV source on its last 128 rows only
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (CUDA devices only; eager otherwise)
    # "released": hold MXFP4 routed experts and FP8 linears (engine/quant/pack_model.py), read directly by
    # the fused kernels on a GPU; "model": every weight in the model dtype
    weights: str = "model"
    # CPU threads of this process's torch ops; 0 leaves torch's default (one per core). Engines that
    # share a machine (a prefill and a decode worker) each want their share: oversubscribed OpenMP
    # threads spin against each other and a step can take 10x longer.
    torch_threads: int = 0

    def __post_init__(self):
        if not self.model_dir:
            raise ValueError("model_dir is required")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from None
        if self.dtype is not None and self.dtype.removeprefix("torch.") not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {self.dtype!r}")
        for name in ("num_pages", "max_num_seqs", "max_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len!r}")
        if not isinstance(self.torch_threads, int) or self.torch_threads < 0:
            raise ValueError(f"torch_threads must be an int >= 0, got {self.torch_threads!r}")
        if self.swa_cache_bytes < 0:
            raise ValueError(f"swa_cache_bytes must be >= 0, got {self.swa_cache_bytes}")
        if self.batch_invariant and self.max_batched_tokens < BLOCK_TOKENS + self.max_num_seqs:
            raise ValueError(f"batch_invariant needs max_batched_tokens >= {BLOCK_TOKENS} + max_num_seqs "
                             f"(one {BLOCK_TOKENS}-token prefill chunk next to a full decode batch)")


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    exact_prefix: bool = False  # take no approximate (bounded replay) prefix hit: a resumed request must
                                # continue exactly as the uninterrupted one would have
    # Structured output: the request's matcher, built by the caller with every token the request has
    # already produced (restore's generated_ids) replayed into it; the engine feeds it what it samples.
    grammar: GrammarState | None = None
    # Images (V4.1 vision): the prompt's images (messages.images.ImageInput, spans in prompt order)
    # and, per image, its span embeddings [tokens, hidden] from a vision worker, or None for an image
    # the caller knows the prefix cache covers. A step that would compute an image token without its
    # embeddings fails that request (ERROR), never feeds the placeholder id's own embedding.
    images: list = field(default_factory=list)
    image_embeds: list = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    num_prompt_tokens: int
    num_cached_tokens: int
    prefilled: bool = False  # prefill-only request: first token out, state held for snapshot + release


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    pages_total: int
    pages_free: int  # neither referenced nor holding a cached block
    kv_usage: float  # share of pages referenced by requests (0..1); cached pages count as reclaimable
    num_preemptions: int
    prefix_hit_tokens_total: int
    pages_cached: int = 0  # unreferenced pages holding cached prefix blocks (evictable)
    swa_states_cached: int = 0  # saved boundary states (window + tails) in host memory
    num_held: int = 0  # prefill-only requests holding their state until snapshot + release


class EngineCore:
    """`model`: a model already built (any family satisfying `engine.models.spec.ModelSpec`) on
    `config.device`, in `config.dtype` when that is set; None loads `config.model_dir`. The model
    directory names the model either way: its identity keys the prefix cache."""

    def __init__(self, config: EngineConfig, model: ModelSpec | None = None):
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)   # process-wide: an engine owns its process
        if model is None:
            model = load_model(config.model_dir, config.device, config.dtype)
        else:
            check_built_model(check_model(model), config.device, config.dtype)
        self.model = model
        if config.weights == "released":
            from engine.quant.pack_model import pack_model_
            pack_model_(self.model)
        if self.model.decode_graphs is not None:  # V4's CUDA-graph decode; V4.1 runs eager for now
            self.model.decode_graphs.enabled = config.cuda_graphs
        model_config = self.model.config
        # packed weights compute other numbers: their KV must not mix with a plain engine's
        numerics = str(self.model.dtype) + ("" if config.weights == "model" else f"+{config.weights}")
        self.model_id = model_identity(config.model_dir, numerics)
        limit = config.max_model_len or model_config.max_position_embeddings
        self.max_len = min(limit, model_config.max_position_embeddings, config.num_pages * BLOCK_TOKENS)
        self.kv = KVCache(model_config, config.num_pages, config.max_num_seqs, self.model.device, self.model.dtype,
                          config.enable_prefix_cache, config.swa_cache_bytes, BLOCK_TOKENS, config.bounded_replay,
                          config.replay_trim)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_batched_tokens, self.max_len,
                                   model_config.eos_token_ids, config.batch_invariant)
        self.runner = ModelRunner(self.model, self.kv, config.batch_invariant)
        self.requests: dict[str, Sequence] = {}
        self._finished_hashes: OrderedDict[str, list[bytes]] = OrderedDict()  # for completed_blocks

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: EngineRequest, prefill_only: bool = False) -> None:
        """Queue a request. `prefill_only`: prefill the prompt (chunked as usual), sample the first
        token and emit it (finish_reason None, prefilled=True), then hold the state, unscheduled,
        until `snapshot` and `release` (or `abort`). A first token that finishes the request (EOS,
        a stop token, max_tokens=1) finishes it as usual: nothing is held."""
        seq = self._new_sequence(request, ())
        seq.prefill_only = bool(prefill_only)
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq

    def admit(self, request: EngineRequest, prefix: PrefixImport | None = None, prefill_only: bool = False,
              ready: Callable[[int], bool] | None = None) -> Admitted:
        """`import_prefix` then `add_request` in one call (a cache hit's admission: admission.py)."""
        return admit(self, request, prefix, prefill_only, ready)

    def abort(self, request_id: str) -> bool:
        """Stop a request (held ones too) and free its pages; False if it is not (or no longer) here."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        seq.finish_reason = FinishReason.ABORT
        return True

    def release(self, request_id: str) -> bool:
        """Free a held prefill-only request after its hand-off: window slot and page references
        (its full blocks stay in the prefix cache). False if it is not here; ValueError if it is
        here but not held (still prefilling: use abort)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        if seq.status != SequenceStatus.HELD:
            raise ValueError(f"request {request_id!r} is not held (prefill not done, or not prefill-only)")
        del self.requests[request_id]
        self.scheduler.remove(seq)
        self._remember_finished(seq)
        return True

    def has_unfinished(self) -> bool:
        """Whether `step` has work; held requests wait for the caller, not for a step."""
        return not self.scheduler.is_finished()

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        failed, self.scheduler.failed = self.scheduler.failed, []
        if not scheduled:
            return [self._output(seq) for seq in failed]
        seqs, result = self.runner.run(scheduled)
        token_ids = result.token_ids.tolist() if seqs else []
        for row, seq in enumerate(seqs):
            params = seq.sampling
            logprob = result.logprobs[row] if params.logprobs and result.logprobs is not None else None
            top = result.top_logprobs[row] if params.top_logprobs and result.top_logprobs is not None else None
            self.scheduler.postprocess(seq, token_ids[row], logprob, top)
        return [self._output(seq) for seq in [*seqs, *failed]]

    def stats(self) -> EngineStats:
        blocks = self.kv.blocks
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            pages_total=blocks.num_pages, pages_free=blocks.num_free, kv_usage=blocks.num_used / blocks.num_pages,
            num_preemptions=self.scheduler.num_preemptions, prefix_hit_tokens_total=self.scheduler.prefix_hit_tokens,
            pages_cached=blocks.num_cached, swa_states_cached=len(self.kv.boundaries),
            num_held=len(self.scheduler.held))

    # ---- state movement ---------------------------------------------------------------------
    def snapshot(self, request_id: str) -> tuple[KVSnapshot, list[torch.Tensor]]:
        """The running (or held) request's state as it stands (header + contiguous CPU buffers). At a
        128-token boundary the tails hold only the CSA overlaps; elsewhere the last page is partial.
        A held prefill-only request's snapshot covers its prompt; restore it with the first token
        as generated_ids."""
        return make_snapshot(self.kv, self._running(request_id))

    def restore(self, request: EngineRequest, snapshot: KVSnapshot, buffers: Seq[torch.Tensor],
                generated_ids: Seq[int] = ()) -> None:
        """Continue a request from another engine's snapshot; `generated_ids` are the tokens it had
        already produced (StateHandoff.generated_ids). The snapshot must leave at least one token
        to feed (normally the last generated one). `request.grammar` is taken as given: the caller
        built it with generated_ids replayed, so they are not fed to it again here."""
        seq = self._new_sequence(request, generated_ids)
        seq.restored = parse_snapshot(self.kv, self.model_id, snapshot, list(buffers), seq.block_hashes)
        if snapshot.num_tokens >= len(seq.token_ids):
            raise ValueError(f"snapshot covers {snapshot.num_tokens} of {len(seq.token_ids)} tokens: nothing left "
                             "to feed; snapshot before the last sampled token is fed or pass generated_ids")
        seq.num_cached_tokens = snapshot.num_cached_tokens
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq

    def import_prefix(self, block_hashes: Seq[bytes], pages: Seq[Seq[torch.Tensor]],
                      boundary_state: tuple[KVSnapshot, Seq[torch.Tensor]] | None = None) -> int:
        """Put a prefix computed elsewhere into the prefix cache: `pages[i]` is block i's page as
        `completed_blocks` exports it ([one flat tensor of page_numel], this engine's dtype), for the
        chain `block_hashes`. The pages go in unreferenced (cached, evictable; blocks already here
        are kept). `boundary_state` (header + [window, tails], as `export_boundary_state` gives it)
        is the window + tails at one of the chain's block boundaries, normally the last block's end;
        pages alone are no usable hit, so without it a request hits only up to a boundary whose
        state this engine already has (0 in a fresh engine).
        Returns the prefix tokens now usable as a hit by a request extending the chain (the cached
        leading blocks, cut back to the last boundary with a saved state); 0 when the prefix cache
        is off. All inputs are checked before anything changes."""
        hashes = list(block_hashes)
        if len(pages) != len(hashes):
            raise ValueError(f"{len(hashes)} block hashes but {len(pages)} pages")
        if any(not isinstance(h, bytes) or not h for h in hashes):
            raise ValueError("block hashes must be non-empty bytes")
        numel, dtype = self.kv.layout.page_numel, self.kv.pool.pages.dtype
        flat = []
        for i, block in enumerate(pages):
            tensors = [block] if isinstance(block, torch.Tensor) else list(block)
            if len(tensors) != 1:
                raise ValueError(f"block {i}: expected one page tensor, got {len(tensors)}")
            page = torch.as_tensor(tensors[0])
            if page.numel() != numel or page.dtype != dtype:
                raise ValueError(f"block {i}: page is {page.dtype}{list(page.shape)}, expected {dtype}[{numel}]")
            flat.append(page)
        boundary = None
        if boundary_state is not None:
            header, buffers = boundary_state
            boundary = parse_boundary_snapshot(self.kv, self.model_id, header, buffers, hashes)
        if not self.config.enable_prefix_cache:
            return 0
        self.kv.import_blocks(hashes, flat)
        if boundary is not None:
            self.kv.save_boundary(hashes[boundary.num_tokens // BLOCK_TOKENS - 1], boundary)
        return self.kv.usable_prefix(hashes)

    def export_boundary_state(self, block_hash: bytes) -> tuple[KVSnapshot, list[torch.Tensor]] | None:
        """The window + tails saved at the end of block `block_hash` (header + contiguous CPU copies,
        for a peer's `import_prefix`), or None if this engine holds no such state."""
        state = self.kv.boundaries.get(block_hash)
        if state is None:
            return None
        return make_boundary_snapshot(self.kv, self.model_id, block_hash, state)

    def completed_blocks(self, request_id: str, first_block: int = 0) -> list[tuple[bytes, list[torch.Tensor]]]:
        """(chain hash, [page as a flat CPU tensor]) for each full computed block from `first_block`
        on, prompt and generated. A recently finished request's blocks come from the prefix cache
        while they stay cached."""
        seq = self.requests.get(request_id)
        if seq is not None and seq.state is not None:
            hashes = seq.block_hashes[first_block : seq.num_computed // BLOCK_TOKENS]
            pages = seq.state.page_table[first_block : first_block + len(hashes)]
        elif request_id in self._finished_hashes:
            hashes = self._finished_hashes[request_id][first_block:]
            pages = self.kv.blocks.lookup(hashes)
        else:
            raise ValueError(f"request {request_id!r} has no computed state here")
        data = self.kv.pool.read_pages(pages).cpu() if pages else []
        return [(h, [data[j]]) for j, h in enumerate(hashes[: len(pages)])]

    # ---- helpers ------------------------------------------------------------------------------
    def _new_sequence(self, request: EngineRequest, generated_ids: Seq[int]) -> Sequence:
        rid, prompt, params = request.request_id, request.prompt_ids, request.sampling
        if not isinstance(rid, str) or not rid:
            raise ValueError("request_id must be a non-empty string")
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already in the engine")
        if not prompt:
            raise ValueError(f"request {rid!r}: empty prompt")
        tokens = list(prompt) + list(generated_ids)
        vocab = self.model.config.vocab_size
        bad = next((t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"request {rid!r}: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.max_len:
            raise ValueError(f"request {rid!r}: {len(tokens)} tokens leave no room to generate within the "
                             f"engine's max length {self.max_len}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {rid!r}: sampling must be messages.common.SamplingParams")
        validate_sampling_params(params, f"request {rid!r} sampling")
        if params.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {params.max_tokens}")
        if params.thinking_budget >= 0 and not 0 <= params.think_end_id < vocab:
            raise ValueError(f"request {rid!r}: think_end_id {params.think_end_id} is outside the vocabulary")
        if len(generated_ids) >= params.max_tokens:
            raise ValueError(f"request {rid!r}: already generated {len(generated_ids)} tokens, "
                             f"max_tokens is {params.max_tokens}")
        self._check_images(rid, prompt, request.images, request.image_embeds)
        generator = make_generator(params.seed, rid, self.model.device)
        return Sequence(rid, tokens, len(prompt), params, self.model_id, request.arrival_time, generator,
                        exact_prefix=request.exact_prefix, grammar=request.grammar, images=list(request.images),
                        image_embeds=list(request.image_embeds))

    def _check_images(self, rid: str, prompt: Seq[int], images: Seq, embeds: Seq) -> None:
        """Image spans must lie in the prompt on the image token, each with [tokens, hidden] rows or None."""
        image_token = self.model.config.image_token_id
        if embeds and len(embeds) != len(images):
            raise ValueError(f"request {rid!r}: {len(embeds)} image embeddings for {len(images)} images")
        end = 0
        for i, image in enumerate(images):
            if image_token is None:
                raise ValueError(f"request {rid!r}: this model has no vision input")
            if image.start < end or image.end > len(prompt) or any(
                    t != image_token for t in prompt[image.start : image.end]):
                raise ValueError(f"request {rid!r}: image {i} span [{image.start}, {image.end}) is not a run "
                                 f"of image tokens inside the prompt after the previous image")
            end = image.end
            rows = embeds[i] if embeds else None
            if rows is not None and tuple(rows.shape) != (image.grid.tokens, self.model.config.hidden_size):
                raise ValueError(f"request {rid!r}: image {i} embeddings have shape {tuple(rows.shape)}, expected "
                                 f"({image.grid.tokens}, {self.model.config.hidden_size})")

    def _running(self, request_id: str) -> Sequence:
        seq = self.requests.get(request_id)
        if seq is None:
            raise ValueError(f"unknown request {request_id!r}")
        if seq.status not in (SequenceStatus.RUNNING, SequenceStatus.HELD) or seq.state is None:
            raise ValueError(f"request {request_id!r} is waiting (not admitted, or preempted): no state to snapshot")
        return seq

    def _output(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(seq.request_id, seq.new_token_ids, seq.finish_reason, seq.new_logprobs,
                            seq.new_top_logprobs, seq.num_prompt_tokens, seq.num_cached_tokens,
                            seq.status == SequenceStatus.HELD)
        seq.new_token_ids, seq.new_logprobs, seq.new_top_logprobs = [], [], []
        if seq.finish_reason is not None:
            del self.requests[seq.request_id]
            self._remember_finished(seq)
        return out

    def _remember_finished(self, seq: Sequence) -> None:
        """Keep a gone request's hash chain so `completed_blocks` can still serve its cached blocks."""
        self._finished_hashes[seq.request_id] = seq.block_hashes
        while len(self._finished_hashes) > 4 * self.config.max_num_seqs:
            self._finished_hashes.popitem(last=False)

