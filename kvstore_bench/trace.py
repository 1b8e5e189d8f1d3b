"""Agentic coding workload traces: generator, presets, JSONL file format.

A trace is a list of requests. Each request's input is a concatenation of
*segments*: named runs of tokens (a shared system prompt, a task's code
context, one agent's tool output of turn 3...). Two requests that start with
the same segments share that prefix token for token, which is what prefix
caching feeds on. The token ids of a segment are a deterministic function of
(trace seed, segment name, position) — see ``segment_token_ids`` — so a trace
file stays small (no token ids in it) yet every replay computes exactly the
same tokens and block hashes. A request may instead carry explicit
``token_ids`` so users can replay traces of their own.

Shape of the generated workload (presets fill in the numbers):

- ``tasks`` tasks, each with a code context shared by the ``agents`` agents
  assigned to it round-robin (benchmarks run several attempts per task);
- every request starts with one system prompt shared by all agents;
- an agent runs ``turns`` turns; turn k+1 appends turn k's output and a tool
  result to turn k's input, so it reuses all of it (the published figure:
  96% of requests reuse >= 90% of an earlier request's input — ``stats``
  measures it on the generated trace);
- with probability ``burst_prob`` a turn fans out a subagent burst: N children
  start at once from the parent's full input plus a short instruction, run a
  few turns each, and the parent's next turn waits for all of them and
  appends their summaries.

Requests are closed-loop: a request lists the requests it waits for
(``after``) and a think/tool delay (``delay_s``) after the last of them
finishes; first turns wait ``delay_s`` from the start. The replay's modelled
clock decides when that is.

File format (JSONL): line 1 is a header ``{"format": "kvstore-trace/1",
"seed": ..., "preset": ..., "params": {...}}``; then one request per line:
``{"id": "a3.t2", "agent": "a3", "after": ["a3.t1"], "delay_s": 2.1,
"segments": [["sys", 6144], ["task7", 61000], ...], "output_tokens": 317}``
or the same with ``"token_ids": [...]`` instead of ``"segments"``.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import xxhash

from kvstore.errors import InvalidRequest

FORMAT = "kvstore-trace/1"
VOCAB_SIZE = 151_936  # Qwen-family vocabulary; any value works, it only shapes token ids


class TraceParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    agents: int = 128
    """Concurrent top-level agents."""
    tasks: int = 32
    """Distinct tasks; agents share their task's code context."""
    turns: int = 10
    """Turns per top-level agent."""
    system_tokens: int = 6_000
    """System prompt + tool definitions, shared by every request."""
    task_tokens: int = 60_000
    """Median code context of a task (shared by its agents)."""
    agent_tokens: int = 600
    """Median agent-specific first message."""
    final_tokens: int = 94_000
    """Median input of an agent's last turn: the turns grow linearly up to it."""
    output_tokens: int = 317
    """Median output tokens per request."""
    size_sigma: float = 0.25
    """Log-normal spread of the segment sizes around their medians."""
    think_s: float = 3.0
    """Median tool/think time between a response and the next request."""
    ramp_s: float = 60.0
    """First turns start uniformly over this window."""
    burst_prob: float = 0.08
    """Chance that a turn fans out a subagent burst."""
    burst_children_max: int = 6
    """A burst starts 2..this many children."""
    child_turns: int = 3
    """Turns of each subagent."""
    child_summary_tokens: int = 400
    """Median summary a child returns to its parent."""


PRESETS: dict[str, TraceParams] = {
    # CyberGym-like: 400 agents, 10 turns, ~376k-character contexts (~94k tokens
    # at ~4 characters a token), 4 attempts per task.
    "cybergym": TraceParams(
        agents=400,
        tasks=100,
        turns=10,
        system_tokens=6_000,
        task_tokens=60_000,
        agent_tokens=600,
        final_tokens=94_000,
        output_tokens=317,
    ),
    # AgentX-like: 128 agents, ~195k-token median requests.
    "agentx": TraceParams(
        agents=128,
        tasks=32,
        turns=12,
        system_tokens=8_000,
        task_tokens=140_000,
        agent_tokens=800,
        final_tokens=245_000,
        output_tokens=317,
    ),
}
# --quick: same shapes, fewer agents and turns (CI smoke tests).
QUICK: dict[str, dict[str, int]] = {
    "cybergym": {"agents": 24, "tasks": 6, "turns": 4},
    "agentx": {"agents": 12, "tasks": 3, "turns": 4},
}


class Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    id: str
    agent: str
    after: list[str] = []
    delay_s: float = 0.0
    segments: list[tuple[str, int]] = []
    token_ids: list[int] | None = None
    output_tokens: int = 0
    output_segment: str = ""
    """Name of the segment holding this request's output tokens (a later turn
    appends it), so a replay can hash input + output as the engine caches them."""

    @property
    def input_tokens(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        return sum(n for _, n in self.segments)


class TraceHeader(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: str
    seed: int
    preset: str = ""
    params: TraceParams | None = None


class Trace(msgspec.Struct, kw_only=True):
    seed: int
    preset: str
    params: TraceParams | None
    requests: list[Request]


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(median * math.exp(rng.gauss(0.0, sigma))))


def generate(params: TraceParams, seed: int = 0, preset: str = "") -> Trace:
    """Build a trace; the same (params, seed) always gives the same trace."""
    if params.agents < 1 or params.tasks < 1 or params.turns < 1:
        raise InvalidRequest("agents, tasks and turns must be >= 1")
    rng = random.Random(seed)
    sig = params.size_sigma
    task_sizes = [_lognormal(rng, params.task_tokens, sig) for _ in range(params.tasks)]
    requests: list[Request] = []

    def run_agent(
        name: str,
        base: list[tuple[str, int]],
        turns: int,
        after: list[str],
        delay_s: float,
        growth_tokens: int,
        depth: int,
    ) -> str:
        """Emit an agent's turns; return the id of its last request."""
        context = list(base)
        prev_after, prev_delay = after, delay_s
        last_id = ""
        for turn in range(turns):
            rid = f"{name}.t{turn}"
            out = _lognormal(rng, params.output_tokens, sig)
            requests.append(
                Request(
                    id=rid,
                    agent=name,
                    after=prev_after,
                    delay_s=round(prev_delay, 3),
                    segments=list(context),
                    output_tokens=out,
                    output_segment=f"{name}.out{turn}",
                )
            )
            last_id = rid
            wait_for = [rid]
            context.append((f"{name}.out{turn}", out))
            if depth == 0 and turn < turns - 1 and rng.random() < params.burst_prob:
                n_children = rng.randint(2, max(2, params.burst_children_max))
                for c in range(n_children):
                    child = f"{name}.t{turn}.c{c}"
                    child_base = [*context, (f"{child}.ask", _lognormal(rng, 300, sig))]
                    child_last = run_agent(
                        child,
                        child_base,
                        params.child_turns,
                        [rid],
                        0.05,
                        max(1, growth_tokens // 2),
                        depth + 1,
                    )
                    wait_for.append(child_last)
                    context.append(
                        (f"{child}.summary", _lognormal(rng, params.child_summary_tokens, sig))
                    )
            context.append((f"{name}.tool{turn}", _lognormal(rng, growth_tokens, sig)))
            prev_after = wait_for
            prev_delay = _lognormal(rng, params.think_s * 1000, sig) / 1000
        return last_id

    for a in range(params.agents):
        task = a % params.tasks
        base = [
            ("sys", params.system_tokens),
            (f"task{task}", task_sizes[task]),
            (f"a{a}.intro", _lognormal(rng, params.agent_tokens, sig)),
        ]
        start_tokens = sum(n for _, n in base)
        per_turn = (params.final_tokens - start_tokens) / max(1, params.turns - 1)
        growth = max(1, int(per_turn - params.output_tokens))
        run_agent(f"a{a}", base, params.turns, [], rng.uniform(0.0, params.ramp_s), growth, 0)
    return Trace(seed=seed, preset=preset, params=params, requests=requests)


def preset_params(name: str, quick: bool = False, **overrides: int | float) -> TraceParams:
    if name not in PRESETS:
        raise InvalidRequest(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    changes: dict[str, int | float] = dict(QUICK[name]) if quick else {}
    changes.update({k: v for k, v in overrides.items() if v is not None})
    return msgspec.structs.replace(PRESETS[name], **changes)


# -- file format -------------------------------------------------------------

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(Request)
_header_decoder = msgspec.json.Decoder(TraceHeader)


def write(trace: Trace, path: str | os.PathLike[str]) -> None:
    header = TraceHeader(format=FORMAT, seed=trace.seed, preset=trace.preset, params=trace.params)
    tmp = Path(f"{path}.tmp")
    with tmp.open("wb") as f:
        f.write(_encoder.encode(header) + b"\n")
        for req in trace.requests:
            f.write(_encoder.encode(req) + b"\n")
    tmp.replace(path)


def read(path: str | os.PathLike[str]) -> Trace:
    """Parse a JSONL trace; errors name the line. Checks ids and dependencies."""
    requests: list[Request] = []
    header: TraceHeader | None = None
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                if header is None:
                    header = _header_decoder.decode(line)
                    if header.format != FORMAT:
                        raise InvalidRequest(
                            f"{path}:1: format {header.format!r}, expected {FORMAT!r}"
                        )
                    continue
                req = _request_decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise InvalidRequest(f"{path}:{lineno}: {exc}") from None
            if (req.token_ids is None) == (not req.segments):
                raise InvalidRequest(f"{path}:{lineno}: give exactly one of segments, token_ids")
            requests.append(req)
    if header is None:
        raise InvalidRequest(f"{path}: empty trace (no header line)")
    validate(requests)
    return Trace(seed=header.seed, preset=header.preset, params=header.params, requests=requests)


def validate(requests: Sequence[Request]) -> None:
    seen: set[str] = set()
    for req in requests:
        if req.id in seen:
            raise InvalidRequest(f"duplicate request id {req.id!r}")
        for dep in req.after:
            if dep not in seen:
                raise InvalidRequest(
                    f"request {req.id!r} waits for {dep!r}, not earlier in the trace"
                )
        if any(n <= 0 for _, n in req.segments):
            raise InvalidRequest(f"request {req.id!r}: segment lengths must be > 0")
        if req.output_tokens < 0 or req.delay_s < 0:
            raise InvalidRequest(f"request {req.id!r}: negative output_tokens or delay_s")
        seen.add(req.id)


# -- tokens and block hashes -------------------------------------------------


class TokenSource:
    """Token ids of segments, generated on demand; an LRU bounds the memory."""

    def __init__(self, seed: int, max_cached_tokens: int = 16_000_000) -> None:
        self._seed = seed
        self._cache: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self._max_cached_tokens = max_cached_tokens

    def segment_token_ids(self, name: str, n: int) -> np.ndarray:
        key = (name, n)
        arr = self._cache.get(key)
        if arr is not None:
            self._cache.move_to_end(key)
            return arr
        rng = np.random.default_rng(xxhash.xxh64_intdigest(f"{self._seed}:{name}".encode()))
        arr = rng.integers(0, VOCAB_SIZE, n, dtype=np.int32)
        self._cache[key] = arr
        self._cached_tokens += n
        while self._cached_tokens > self._max_cached_tokens and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= len(old)
        return arr

    def token_ids(self, req: Request) -> np.ndarray:
        if req.token_ids is not None:
            return np.asarray(req.token_ids, dtype=np.int32)
        parts = [self.segment_token_ids(name, n) for name, n in req.segments]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def block_hashes(token_ids: np.ndarray, block_tokens: int, seed: int = 0) -> np.ndarray:
    """Chained prefix hashes of the full blocks, as uint64.

    hash_i = xxh3_64(hash_{i-1} (8 bytes LE) + tokens of block i (int32 LE)),
    hash_{-1} = xxh3_64 of the seed. The chain makes a block's hash name its
    whole prefix, as vLLM's does; xxh3 rather than vLLM's sha256 because the
    replay hashes ~10^6 blocks per run (the cost is measured in
    environment.md: 14 ms vs ~2 ms per 195k tokens).
    """
    n_blocks = len(token_ids) // block_tokens
    out = np.empty(n_blocks, dtype=np.uint64)
    data = np.ascontiguousarray(token_ids[: n_blocks * block_tokens], dtype="<i4").tobytes()
    step = block_tokens * 4
    parent = xxhash.xxh3_64_intdigest(f"kvstore-bench:{seed}".encode())
    for i in range(n_blocks):
        parent = xxhash.xxh3_64_intdigest(
            parent.to_bytes(8, "little") + data[i * step : (i + 1) * step]
        )
        out[i] = parent
    return out


# -- statistics --------------------------------------------------------------


class TraceStats(msgspec.Struct, kw_only=True):
    requests: int
    agents: int
    input_tokens_median: float
    input_tokens_p90: float
    output_tokens_median: float
    total_input_tokens: int
    reuse_ge_90_share: float
    """Share of requests whose input starts with >= 90% of an earlier request's input."""
    prefix_reuse_bound: float
    """Input tokens in a prefix shared with an earlier request's input or output / all
    input tokens: the most any prefix cache could serve (the rest is new tool output
    and first sight of a task)."""
    burst_children: int


def stats(trace: Trace) -> TraceStats:
    """Figures to check a trace against the published ones (segment traces only
    are measured for reuse: prefixes are compared segment by segment)."""
    reqs = trace.requests
    inputs = np.array([r.input_tokens for r in reqs], dtype=np.float64)
    outputs = np.array([r.output_tokens for r in reqs], dtype=np.float64)
    # Longest shared prefix with any earlier request, found through a trie of
    # segment names: shared = sum of the lengths along the deepest common path.
    trie: dict = {}
    reuse_hits = 0
    shared_total = 0
    for r in reqs:
        node, shared = trie, 0
        for seg in r.segments:
            child = node.get(seg)
            if child is None:
                break
            shared += seg[1]
            node = child
        shared_total += shared
        if r.input_tokens and shared >= 0.9 * r.input_tokens:
            reuse_hits += 1
        node = trie
        # The engine caches the output too (the next turn starts with it).
        tail = [(r.output_segment, r.output_tokens)] if r.output_segment and r.output_tokens else []
        for seg in [*r.segments, *tail]:
            node = node.setdefault(seg, {})
    return TraceStats(
        requests=len(reqs),
        agents=len({r.agent for r in reqs}),
        input_tokens_median=float(np.median(inputs)) if len(inputs) else 0.0,
        input_tokens_p90=float(np.percentile(inputs, 90)) if len(inputs) else 0.0,
        output_tokens_median=float(np.median(outputs)) if len(outputs) else 0.0,
        total_input_tokens=int(inputs.sum()),
        reuse_ge_90_share=reuse_hits / len(reqs) if reqs else 0.0,
        prefix_reuse_bound=float(shared_total / inputs.sum()) if inputs.sum() else 0.0,
        burst_children=len({r.agent for r in reqs if ".c" in r.agent}),
    )


def iter_dependents(requests: Iterable[Request]) -> dict[str, list[str]]:
    """request id -> ids of the requests that wait for it."""
    out: dict[str, list[str]] = {}
    for r in requests:
        for dep in r.after:
            out.setdefault(dep, []).append(r.id)
    return out


def to_json(obj: msgspec.Struct) -> str:
    return json.dumps(msgspec.to_builtins(obj), indent=2)
