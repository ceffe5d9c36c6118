"""How far a token window's estimate of a call is from the tokens the provider counts:
``python scripts/bench.py tokens``. Prints figures; asserts nothing.

Admission estimates a call's input tokens as its characters / 4 plus 4 tokens of
framing per message (``agentbus.admission.tokens``). Here that estimate is set
beside what OpenAI's tokenizers count for the same call (content tokens plus 3
per message and 3 to prime the answer, OpenAI's own accounting of a chat
request), over conversations built from this repository's own text: its docs
(English prose), its source (Python), JSON (tool calls and results), and
conversations that mix them with a system prompt and tool definitions.

A window counts the estimate only until the answer reports the real figure, so
what it can admit beyond its limit is bounded by the underestimate of the calls
in flight: the figure printed last.

Needs ``tiktoken`` (``pip install -e .[bench]``) and an encoding: tiktoken fetches
it from the internet, or ``--ranks`` names a file of the npm package ``tiktoken``
(``npm pack tiktoken``; ``package/encoders/o200k_base.json``), for a machine that
can reach a package registry and nothing else.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentbus.admission import tokens
from agentbus.providers import chat

ROOT = Path(__file__).resolve().parent.parent


def encoding(name: str, ranks: str | None) -> Callable[[str], int]:
    """A function counting the tokens of a text with encoding ``name``."""
    import tiktoken

    if ranks is None:
        enc = tiktoken.get_encoding(name)
    else:  # the npm package's file: "<char> <first rank> <token in base64> ..." per line
        doc = json.loads(Path(ranks).read_text())
        mergeable: dict[bytes, int] = {}
        for line in doc["bpe_ranks"].split("\n"):
            parts = line.split(" ")
            if len(parts) < 3:
                continue
            first = int(parts[1])
            for i, token in enumerate(parts[2:]):
                mergeable[base64.b64decode(token)] = first + i
        enc = tiktoken.Encoding(
            name=name,
            pat_str=doc["pat_str"],
            mergeable_ranks=mergeable,
            special_tokens=doc["special_tokens"],
        )
    return lambda text: len(enc.encode(text, disallowed_special=()))


def pieces() -> dict[str, list[str]]:
    """The repository's text in pieces of a paragraph or a function."""
    prose = [
        p.strip()
        for path in sorted((ROOT / "docs").glob("*.md"))
        for p in path.read_text().split("\n\n")
        if len(p.strip()) > 80 and not p.lstrip().startswith(("|", "```"))
    ]
    code = [
        chunk.strip()
        for path in sorted((ROOT / "shared").rglob("*.py"))
        for chunk in path.read_text().split("\n\n\n")
        if len(chunk.strip()) > 120
    ]
    rng = random.Random(7)
    data = [
        json.dumps(
            {
                "id": f"call_{rng.randrange(10**8)}",
                "rows": [
                    {
                        "task": rng.randrange(10**6),
                        "status": rng.choice(["done", "paused"]),
                        "at": round(rng.uniform(1.7e9, 1.8e9), 3),
                        "note": rng.choice(prose)[:60],
                    }
                    for _ in range(rng.randrange(1, 12))
                ],
            }
        )
        for _ in range(300)
    ]
    return {"prose": prose, "code": code, "json": data}


def conversations(n: int, seed: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """``n`` calls (task text, payload, params) of each kind: one piece of prose, code or
    JSON alone, and mixed conversations of 2-12 turns with a system prompt and tools."""
    rng = random.Random(seed)
    found = pieces()
    calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for kind in ("prose", "code", "json"):
        calls += [(kind, {"text": rng.choice(found[kind])}, {}) for _ in range(n)]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": rng.choice(found["prose"])[:200],
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                },
            },
        }
    ]
    for _ in range(n):
        turns = []
        for i in range(rng.randrange(2, 13)):
            kind = rng.choice(["prose", "code", "json"])
            turns.append(
                {"role": "user" if i % 2 == 0 else "assistant", "content": rng.choice(found[kind])}
            )
        payload = {
            "system": rng.choice(found["prose"]),
            "messages": turns,
            "text": rng.choice(found["prose"]),
        }
        calls.append(("conversation", payload, {"tools": tools}))
    return calls


def counted(
    count: Callable[[str], int], text: str, payload: dict[str, Any], params: dict[str, Any]
) -> int:
    """What the provider counts of a chat request: every message's content and 3 tokens
    of framing, 3 to prime the answer, and the tool definitions' JSON."""
    messages = [{"role": "system", "content": payload["system"]}] if "system" in payload else []
    messages += chat.conversation(text, payload)  # the task text ends it, unless a user turn does
    total = 3 + sum(3 + count(m["content"]) for m in messages)
    if params.get("tools"):
        total += count(json.dumps(params["tools"]))
    return total


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--encoding", default="o200k_base", help="o200k_base or cl100k_base")
    parser.add_argument("--ranks", help="the npm tiktoken package's encoders/<name>.json")
    parser.add_argument("--calls", type=int, default=500, help="calls of each kind")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    count = encoding(args.encoding, args.ranks)
    by_kind: dict[str, list[float]] = {}
    for kind, payload, params in conversations(args.calls, args.seed):
        text = payload.pop("text")
        estimate = tokens.estimate(text, payload, params, 1).input
        actual = counted(count, text, payload, params)
        by_kind.setdefault(kind, []).append(estimate / actual)
    print(f"estimate / tokens counted by {args.encoding}, {args.calls} calls of each kind")
    print(f"{'kind':<14}{'mean':>7}{'p5':>7}{'p50':>7}{'p95':>7}{'min':>7}{'under':>8}")
    worst = 1.0
    for kind, ratios in [*by_kind.items(), ("all", [r for v in by_kind.values() for r in v])]:
        cuts = statistics.quantiles(ratios, n=20)
        under = sum(r < 1 for r in ratios) / len(ratios)
        worst = min(worst, min(ratios))
        print(
            f"{kind:<14}{statistics.fmean(ratios):>7.2f}{cuts[0]:>7.2f}{statistics.median(ratios):>7.2f}"
            f"{cuts[-1]:>7.2f}{min(ratios):>7.2f}{under:>8.0%}"
        )
    print(
        f"the most a window can hold beyond its limit, every call in flight at the worst "
        f"underestimate: {1 / worst - 1:.0%} of its input tokens"
    )
    return 0
