"""`epd bench gateway`: what the gateway's protocol adapter costs on top of deepseek-recipe, in one run.

  prepare  a chat body at 1k, 8k and 64k prompt tokens (an agentic coding conversation: system prompt,
           three tools, read_file calls returning Python source, a follow-up; sized with the tokenizer).
           ours = `Adapter.prepare`; bare = the library calls alone, `ChatCompletionRequest(body)
           .convert(options)` then `encoding.encode(conversation)` (which renders), with the adapter's
           conversion options and a tokenizer of the same file. Target: ours/bare <= 1.2x in CPU ms per
           request (wall time is shown beside it, but on a shared machine it mostly says whether the
           library's encode pool found a free core).
  stream   a realistic answer (reasoning, `</think>`, prose, code, CJK, emoji), one token id per push,
           per protocol. ours = `ResponseStream.push`; bare = `StreamProcessor.push(InferenceChunk.tokens
           ([id]))` + `to_json()` + SSE framing. Both must show the same text. Reported, no target.
  loop     lateness of a 1 ms ticker on uvloop while two clients per thread prepare the largest prompt
           the gateway's way (`run_in_executor` on a pool of its tokenize_threads), the same with the bare
           calls, and with prepare run on the loop itself; an idle loop beside. Target: p99 < 10 ms.

CPU time is `time.process_time` (all threads, the library's encode pool included); ours and bare
alternate in blocks so drift and neighbours hit both alike; medians are per call (per stream).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version

from bench.gateway.workload import (ANSWER, MODEL, REASONING, SourceLines, chat_body, kind_of, library_classes,
                                    stream_body, visible_text)
from bench.common.table import machine, print_table, write_json

SIZES = {"1k": 1 << 10, "8k": 8 << 10, "64k": 64 << 10}
QUICK_SIZES = {"1k": 1 << 10, "4k": 4 << 10}
ANSWER_TOKENS, QUICK_ANSWER_TOKENS = 512, 64
PREPARE_TARGET = 1.2          # ours / bare
LAG_TARGET_MS = 10.0          # p99 with the largest prompts prepared in the executor
TICK_S = 0.001
LAG_MODES = (("idle", ""), ("executor", "ours"), ("executor", "bare"), ("direct", "ours"))
BLOCKS = 10                   # alternating ours/bare blocks per measurement
TOKEN_TOLERANCE = 0.02        # built prompts land within 2% of their size
def register(subparsers) -> None:
    parser = subparsers.add_parser("gateway", help="gateway adapter vs bare deepseek-recipe: prepare, stream, loop lag")
    parser.add_argument("--seconds", type=float, help="duration of each measurement (default 2; 0.1 with --quick)")
    parser.add_argument("--json", metavar="FILE", help="also write every number to FILE")
    parser.add_argument("--quick", action="store_true", help="smaller prompts and answers, short measurements")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    seconds = args.seconds if args.seconds is not None else (0.1 if args.quick else 2.0)
    if seconds <= 0:
        print("epd bench gateway: --seconds must be > 0", file=sys.stderr)
        return 2
    from services.gateway.adapter import Protocol
    from services.gateway.service import GatewaySettings
    sizes, threads = QUICK_SIZES if args.quick else SIZES, GatewaySettings().tokenize_threads
    load_before = os.getloadavg()
    bench = Bench.load()
    bodies = {name: bench.chat_prompt(tokens) for name, tokens in sizes.items()}
    answer = bench.answer_ids(QUICK_ANSWER_TOKENS if args.quick else ANSWER_TOKENS)
    prepare, stream = [], []
    for name, body in bodies.items():
        _progress(f"prepare {name}")
        prepare += bench.measure_prepare(name, sizes[name], body, seconds)
    for protocol in Protocol:
        _progress(f"stream {kind_of(protocol)}")
        stream += bench.measure_stream(protocol, answer, seconds)
    _progress("loop lag")
    largest = max(sizes, key=sizes.get)
    lag = bench.measure_lag(largest, bodies[largest], seconds, threads)
    results = {"quick": args.quick, "seconds_per_measurement": seconds, "model": MODEL,
               "deepseek_recipe": version("deepseek-recipe"), "tokenize_threads": threads,
               "load_avg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
               "answer_tokens": len(answer), "prepare": prepare, "stream": stream, "loop_lag": lag,
               "verdicts": compare(prepare, stream, lag)}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.json:
        date = write_json(args.json, "gateway", results)["date"]
    report(results, seconds, date)
    return 0


def _progress(what: str) -> None:
    print(f"epd bench gateway: {what}", file=sys.stderr, flush=True)


# ---- the two paths under test --------------------------------------------------------------
@dataclass(slots=True)
class Bench:
    adapter: object               # services.gateway.adapter.Adapter: ours
    options: object               # bare: ConversionOptions, built as the adapter builds them
    encoding: object              # bare: DeepseekV4Encoding with its own Tokenizer of the same file
    tokenizer: object
    think_end: str

    @classmethod
    def load(cls) -> "Bench":
        from deepseek_recipe import (ConversionOptions, DeepseekV4Encoding, ModelVersion, SpecialToken,
                                     SpecialTokens, Tokenizer)
        from services.gateway.adapter import Adapter, AdapterConfig, ServedModel
        served = ServedModel(MODEL, context_length=1 << 20)
        config = AdapterConfig(models=(served,))
        tokenizer = Tokenizer.from_file(served.tokenizer_file)
        options = (ConversionOptions(default_thinking_mode=config.default_thinking)
                   .with_model_versions_by_name({MODEL: ModelVersion.DeepseekV4Pro})
                   .with_thinking_max_tokens_upper_bound(served.output_limit)
                   .with_non_thinking_max_tokens_upper_bound(served.output_limit))
        return cls(Adapter(config), options, DeepseekV4Encoding().with_tokenizer(tokenizer), tokenizer,
                   SpecialTokens().token(SpecialToken.ThinkingEnd))

    def ours_prepare(self, body: bytes):
        from services.gateway.adapter import Protocol
        return self.adapter.prepare(Protocol.CHAT, body)

    def bare_prepare(self, body: bytes) -> list[int]:
        from deepseek_recipe import ChatCompletionRequest
        return self.encoding.encode(ChatCompletionRequest(body).convert(self.options).conversation)

    @staticmethod
    def ours_stream(prepared, ids: list[int]) -> list[bytes]:
        from messages.common import FinishReason
        stream, frames = prepared.open_stream("bench"), []
        for token_id in ids:
            frames += stream.push([token_id])
        return frames + stream.push([], FinishReason.STOP)

    def bare_stream(self, protocol, converted, prompt_tokens: int, ids: list[int]) -> list[bytes]:
        from deepseek_recipe import InferenceChunk, InferenceFinishReason, PromptUsage, StreamProcessor
        request_class, response_class = library_classes(protocol)
        processor = StreamProcessor(request_class.chunk_generator(converted, "bench", MODEL),
                                    converted.parsing_options, self.tokenizer)
        frames: list[bytes] = []

        def emit(events) -> None:
            for event in events:
                name, data = response_class.sse_event_name(event), event.to_json()
                frames.append((f"event: {name}\ndata: {data}\n\n" if name else f"data: {data}\n\n").encode())

        emit(processor.push(InferenceChunk.ready(prompt_usage=PromptUsage(
            prompt_tokens=prompt_tokens, prompt_cache_hit_tokens=0))))
        for token_id in ids:
            emit(processor.push(InferenceChunk.tokens([token_id])))
        emit(processor.push(InferenceChunk.finish(InferenceFinishReason.Stop)))
        done = response_class.sse_done_data()
        return frames + ([f"data: {done}\n\n".encode()] if done is not None else [])

    # ---- workloads ------------------------------------------------------------------------
    def chat_prompt(self, target: int) -> bytes:
        """A chat body whose encoded prompt is `target` tokens (within TOKEN_TOLERANCE)."""
        files, source = max(1, min(8, target // 4096)), SourceLines(self.tokenizer)
        share = (target - len(self.bare_prepare(chat_body([("", "")] * files)))) // files
        contents, start = [], 0
        for _ in range(files):
            path, text, end = source.read(start, share)
            contents.append((path, text))
            last, start = start, end
        for _ in range(4):   # per-line counts miss merges across lines: correct the last file
            body = chat_body(contents)
            missing = target - len(self.bare_prepare(body))
            if abs(missing) <= TOKEN_TOLERANCE * target:
                return body
            path, text, _ = source.read(last, max(1, len(self.tokenizer.encode(contents[-1][1])) + missing))
            contents[-1] = (path, text)
        raise RuntimeError(f"could not build a {target}-token prompt (off by {missing} tokens)")

    def answer_ids(self, target: int) -> list[int]:
        """Reasoning (40%), the end of thinking, then prose with a code block and non-ASCII text."""
        reasoning = self.tokenizer.encode(REASONING * (1 + target // 100))[:target * 2 // 5]
        code = SourceLines(self.tokenizer, ("textwrap",)).read(0, target)[1]
        answer = self.tokenizer.encode(ANSWER + code)[:target - len(reasoning) - 1]
        return reasoning + self.tokenizer.encode(self.think_end) + answer

    # ---- measurements ---------------------------------------------------------------------
    def measure_prepare(self, name: str, target: int, body: bytes, seconds: float) -> list[dict]:
        tokens = self.bare_prepare(body)
        if self.ours_prepare(body).prompt_ids != tokens:
            raise RuntimeError(f"{name}: the adapter and the bare library encode different prompts")
        samples = alternate({"ours": lambda: self.ours_prepare(body), "bare": lambda: self.bare_prepare(body)}, seconds)
        return [{"prompt": name, "target_tokens": target, "prompt_tokens": len(tokens), "body_bytes": len(body),
                 "path": path, "calls": len(wall), "wall_ms_p50": _ms(pick(wall, 0.5)),
                 "cpu_ms_p50": _ms(pick(cpu, 0.5)), "cpu_ms_mean": _ms(sum(cpu) / len(cpu)),
                 "req_per_s": round(1e9 / pick(wall, 0.5), 1)} for path, (wall, cpu) in samples.items()]

    def measure_stream(self, protocol, ids: list[int], seconds: float) -> list[dict]:
        body = stream_body(protocol)
        prepared = self.adapter.prepare(protocol, body)
        converted = library_classes(protocol)[0](body).convert(self.options)
        calls = {"ours": lambda: self.ours_stream(prepared, ids),
                 "bare": lambda: self.bare_stream(protocol, converted, len(prepared.prompt_ids), ids)}
        frames = {path: call() for path, call in calls.items()}
        if visible_text(frames["ours"]) != visible_text(frames["bare"]) or not visible_text(frames["ours"])[1]:
            raise RuntimeError(f"{kind_of(protocol)}: ours and bare stream different text")
        return [{"protocol": kind_of(protocol), "path": path, "tokens": len(ids), "streams": len(wall),
                 "frames": len(frames[path]), "wall_us_per_token": round(pick(wall, 0.5) / len(ids) / 1e3, 2),
                 "cpu_us_per_token": round(pick(cpu, 0.5) / len(ids) / 1e3, 2)}
                for path, (wall, cpu) in alternate(calls, seconds).items()]

    def measure_lag(self, name: str, body: bytes, seconds: float, threads: int) -> list[dict]:
        import uvloop
        prepare = {"ours": lambda: self.ours_prepare(body), "bare": lambda: self.bare_prepare(body)}
        rows = []
        for mode, path in LAG_MODES:
            lags, prompts, elapsed = uvloop.run(_lag(mode, prepare.get(path), seconds, threads))
            rows.append({"mode": mode, "path": path, "prompt": name, "clients": 0 if mode == "idle" else 2 * threads,
                         "threads": threads if mode == "executor" else 0, "prompts": prompts,
                         "wakeups": len(lags), "p50_ms": _ms(pick(lags, 0.5)), "p99_ms": _ms(pick(lags, 0.99)),
                         "max_ms": _ms(max(lags)), "prompts_per_s": round(prompts / elapsed, 1)})
        return rows


def alternate(calls: dict, seconds: float) -> dict[str, tuple[list[int], list[int]]]:
    """Each callable for `seconds` in all, in alternating blocks; per-call (wall ns, CPU ns)."""
    for call in calls.values():   # warm caches (the tokenizer's word cache, allocators)
        call()
    samples = {name: ([], []) for name in calls}
    wall_clock, cpu_clock = time.perf_counter_ns, time.process_time_ns
    for block in range(BLOCKS):
        for name in (list(calls) if block % 2 else list(calls)[::-1]):
            call, (wall, cpu) = calls[name], samples[name]
            end = wall_clock() + int(seconds * 1e9 / BLOCKS)
            while True:
                w0, c0 = wall_clock(), cpu_clock()
                call()
                c1, w1 = cpu_clock(), wall_clock()
                wall.append(w1 - w0)
                cpu.append(c1 - c0)
                if w1 >= end:
                    break
    return samples


async def _lag(mode: str, prepare, seconds: float, threads: int) -> tuple[list[int], int, float]:
    """Lateness (ns) of every 1 ms ticker wake-up while `mode` runs for `seconds`."""
    loop, clock = asyncio.get_running_loop(), time.perf_counter_ns
    lags: list[int] = []
    state = {"running": True, "prompts": 0}

    async def ticker() -> None:
        while state["running"]:
            t0 = clock()
            await asyncio.sleep(TICK_S)
            lags.append(max(0, clock() - t0 - int(TICK_S * 1e9)))

    async def client(pool) -> None:   # the same clients either way: only where prepare runs differs
        while True:
            if mode == "executor":
                await loop.run_in_executor(pool, prepare)
            else:
                prepare()
                await asyncio.sleep(0)
            state["prompts"] += 1
            if clock() >= end:
                return

    task = loop.create_task(ticker())
    await asyncio.sleep(0.02)
    lags.clear()
    start = clock()
    end = start + int(seconds * 1e9)
    if mode == "idle":
        await asyncio.sleep(seconds)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="tokenize") as pool:
            await asyncio.gather(*(client(pool) for _ in range(2 * threads)))
    elapsed = (clock() - start) / 1e9
    state["running"] = False
    await task
    return lags, state["prompts"], elapsed


# ---- verdicts and output -------------------------------------------------------------------
def compare(prepare: list[dict], stream: list[dict], lag: list[dict]) -> list[dict]:
    out = []
    for what, rows, key, cpu, wall, target in (
            ("prepare", prepare, "prompt", "cpu_ms_p50", "wall_ms_p50", PREPARE_TARGET),
            ("stream", stream, "protocol", "cpu_us_per_token", "wall_us_per_token", None)):
        by = {(r[key], r["path"]): r for r in rows}
        for name in dict.fromkeys(r[key] for r in rows):
            ours, bare = by[name, "ours"], by[name, "bare"]
            cpu_x, wall_x = ours[cpu] / bare[cpu], ours[wall] / bare[wall]
            out.append({"check": f"{what} {name}", "cpu_ratio": round(cpu_x, 3), "wall_ratio": round(wall_x, 3),
                        "target": f"<= {target}x" if target else "none (reported)",
                        "ok": cpu_x <= target if target else None})
    executor = next(r for r in lag if (r["mode"], r["path"]) == ("executor", "ours"))
    out.append({"check": f"loop lag p99, {executor['prompt']} prompts in the executor", "p99_ms": executor["p99_ms"],
                "target": f"< {LAG_TARGET_MS:g} ms", "ok": executor["p99_ms"] < LAG_TARGET_MS})
    return out


def report(results: dict, seconds: float, date: str) -> None:
    m = machine()
    print_table(["prompt", "tokens", "body KB", "path", "req/s", "wall ms p50", "CPU ms p50", "calls"],
                [[r["prompt"], r["prompt_tokens"], round(r["body_bytes"] / 1024, 1), r["path"], r["req_per_s"],
                  r["wall_ms_p50"], r["cpu_ms_p50"], r["calls"]] for r in results["prepare"]],
                title=f"\nepd bench gateway: {seconds:g} s per measurement; prepare = convert + render + encode "
                      "of a chat body (ours: Adapter.prepare; bare: deepseek-recipe convert + encode)")
    print_table(["protocol", "path", "wall us/token", "CPU us/token", "tokens", "frames", "streams"],
                [[r["protocol"], r["path"], r["wall_us_per_token"], r["cpu_us_per_token"], r["tokens"],
                  r["frames"], r["streams"]] for r in results["stream"]],
                title="\nstream: one token id per push (ours: ResponseStream; bare: StreamProcessor + to_json + SSE)")
    print_table(["loop", "path", "prompt", "clients", "threads", "p50 ms", "p99 ms", "max ms", "wake-ups",
                 "prompts", "prompts/s"],
                [[r["mode"], r["path"], r["prompt"], r["clients"] or "", r["threads"] or "", r["p50_ms"], r["p99_ms"],
                  r["max_ms"], r["wakeups"], r["prompts"], r["prompts_per_s"]] for r in results["loop_lag"]],
                title="\nevent loop lag (uvloop, 1 ms ticker): idle / prepare in the gateway's executor / on the loop")
    print_table(["check", "CPU x", "wall x", "p99 ms", "target", "verdict"],
                [[v["check"], _x(v.get("cpu_ratio")), _x(v.get("wall_ratio")), v.get("p99_ms"), v["target"],
                  {True: "ok", False: "MISS", None: ""}[v["ok"]]] for v in results["verdicts"]],
                title=f"\nours / bare: {date}, {m['cpu_model']}, {m['cores_usable']}/{m['cores']} cores, "
                      f"load {results['load_avg_1m'][0]:g}->{results['load_avg_1m'][1]:g}, Python {m['python']}, "
                      f"deepseek-recipe {results['deepseek_recipe']}; verdicts on CPU x")


def _x(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def pick(samples: list[int], q: float) -> int:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def _ms(ns: float) -> float:
    return round(ns / 1e6, 3)
