"""busctl's text views: the status document and the routing history as tables."""

from __future__ import annotations

from typing import Any

from agentbus import cli
from agentbus.clock import CLOCK_WARN_SEC
from agentbus.config import Settings
from agentbus.queue.states import TaskStatus


def status(doc: dict[str, Any], settings: Settings) -> str:
    """The status document as ``busctl status`` prints it."""
    out: list[str] = []
    statuses = [state.value for state in TaskStatus]
    agents = sorted(doc["queue"])
    rows = [[a, *(doc["queue"][a].get(st, 0) for st in statuses)] for a in agents]
    rows.append(["(all)", *(doc["totals"].get(st, 0) for st in statuses)])
    out.append(cli.table(["agent", *statuses], rows))
    for h in doc.get("holds", []):  # before anything else: why an agent's tasks wait
        why = f": {h['reason']}" if h["reason"] else ""
        out.append(
            f"agent {h['agent']} on hold since {cli.fmt_time(h['held_at'])} by {h['held_by']}{why}"
        )
    ended = doc.get("deadlines", {})
    if ended.get("expired") or ended.get("next") is not None:
        soon = f"; next deadline {cli.fmt_time(ended['next'])}" if ended.get("next") else ""
        out.append(f"deadlines: {ended['expired']:,} tasks ended unstarted{soon}")
    for agent, g in sorted(doc.get("groups", {}).items()):
        out.append(
            f"groups of {agent}: {g['groups']:,} with unfinished tasks; {g['claimed']:,} "
            f"running, {g['queued']:,} queued, {g['paused']:,} paused"
        )
    waiting = doc.get("waiting", {})
    if waiting:
        each = ", ".join(f"{agent} {n:,}" for agent, n in sorted(waiting.items()))
        out.append(f"waiting for other tasks (of the queued): {each}")
    for r in doc.get("schedules", []):
        last = cli.fmt_time(r["last_at"]) if r["last_at"] is not None else "never"
        out.append(
            f"schedule {r['name']} ({r['when']}, agent {r['agent']}): next "
            f"{cli.fmt_time(r['next_at'])}, last {last}"
        )
    used = doc["usage_today"]
    tokens = sum(u["tokens"] for u in used)
    cost = sum(u["cost"] for u in used)
    budget = f" of {settings.daily_token_budget:,}" if settings.daily_token_budget else ""
    cost_budget = f" of {settings.daily_cost_budget:g}" if settings.daily_cost_budget else ""
    out.append(f"\nusage today (UTC): {tokens:,} tokens{budget}, cost {cost:.4f}{cost_budget}")
    if used:
        out.append(
            cli.table(
                ["model", "calls", "tokens", "cost"],
                [[u["model"], u["calls"], u["tokens"], f"{u['cost']:.4f}"] for u in used],
            )
        )
    if doc.get("windows"):
        out.append(windows(doc["windows"]))
    if doc["circuits"]:
        out.append("\ncircuits:")
        out.append(
            cli.table(
                ["provider", "state", "failures in a row", "open until"],
                [
                    [
                        r["provider"],
                        r["state"],
                        r["consecutive_failures"],
                        cli.fmt_time(r["open_until"]) if r["open_until"] else "",
                    ]
                    for r in doc["circuits"]
                ],
            )
        )
    b = doc["budget"]
    if b["mode"] != "off":
        limit = f" of {b['budget']}" if b["budget"] else ""
        out.append(
            f"\nclient budget ({b['mode']}, {b['scope']}): {b['count']}{limit} reserved"
            + (f"; last refused: {', '.join(b['last_refused'])}" if b["last_refused"] else "")
        )
    if doc["workers"]:
        out.append("\nworkers:")
        out.append(
            cli.table(
                ["worker", "agent", "running", "tasks", "heartbeat", "backoff", "clock"],
                [
                    [
                        w["id"],
                        w["agent"],
                        f"{len(w['running'])}/{w['concurrency']}",
                        " ".join(str(i) for i in w["running"]),
                        f"{w['heartbeat_age']:.0f} s ago",
                        f"{w['backoff_left']:.0f} s" if w["backoff_left"] else "",
                        _clock(w["clock_offset"]),
                    ]
                    for w in doc["workers"]
                ],
            )
        )
    bad = doc["malformed"]
    if any(bad["counts"].values()):
        counted = ", ".join(f"{n} in {table}" for table, n in bad["counts"].items() if n)
        out.append(
            f"\nmalformed rows ({counted}): tasks the sweeper failed (their todo open), "
            "cooldowns and worker rows it deletes at its next pass"
        )
        out.append(
            cli.table(
                ["table", "key", "problem"],
                [[r["table"], r["key"], r["problem"]] for r in bad["rows"]],
            )
        )
    return "\n".join(out)


def _clock(offset: float) -> str:
    """A worker's host clock against the database's (the database's is the one used)."""
    return f"host {-offset:+.1f} s off" if abs(offset) > CLOCK_WARN_SEC else "ok"


def answer(detail: dict[str, Any]) -> str:
    """A completed task's answer besides its text: model, finish reason, tool calls, usage."""
    import json

    lines = [f"answered by: {detail.get('model', '-')}"]
    if detail.get("finish_reason") is not None:
        lines.append(f"finish reason: {detail['finish_reason']}")
    for call in detail.get("tool_calls") or ():
        arguments = call.get("arguments")
        shown = arguments if isinstance(arguments, str) else json.dumps(arguments)
        lines.append(f"tool call: {call.get('name')} {shown}")
    usage = detail.get("usage") or {}
    if usage:
        lines.append(
            f"usage: {usage.get('prompt_tokens', 0)} prompt + "
            f"{usage.get('completion_tokens', 0)} completion tokens"
        )
    return "\n".join(lines)


def refusals(by_candidate: dict[str, dict[str, Any]]) -> str:
    """Refusals (``{code, name, retry_after_ms, suggested_action, gate, detail}``) by candidate."""
    return cli.table(
        ["candidate", "code", "name", "gate", "retry after", "suggested action", "detail"],
        [
            [
                candidate,
                r["code"],
                r["name"],
                r["gate"],
                f"{r['retry_after_ms']} ms",
                r["suggested_action"],
                r["detail"],
            ]
            for candidate, r in by_candidate.items()
        ],
    )


def refusal_rows(rows: list[dict[str, Any]]) -> str:
    """Refusals, newest first, as ``busctl refusals`` prints them."""
    return cli.table(
        ["at", "agent", "task", "candidate", "code", "name", "gate", "retry after", "detail"],
        [
            [
                cli.fmt_time(r["at"]),
                r["agent"],
                r["task_id"] or "",
                r["candidate"],
                r["code"],
                r["name"],
                r["gate"],
                f"{r['retry_after_ms']} ms",
                r["detail"],
            ]
            for r in rows
        ],
    )


def routes(rows: list[dict[str, Any]]) -> str:
    """Routing decisions, newest first, as ``busctl routes`` prints them."""
    table = []
    for r in rows:
        refusal = r.get("refusal") or {}
        why = r["outcome"] or r["code"] or ""
        if r["retry_after"]:
            why += f" until {cli.fmt_time(r['retry_after'])}"
        table.append(
            [
                cli.fmt_time(r["at"]),
                r["task_id"],
                r["role"] or "",
                (r["fallback_from"] or "") and f"<- {r['fallback_from']}",
                r["provider"] or "",
                r["model"],
                r["account"] or "",
                r["decision"],
                why,
                refusal.get("code", ""),
                f"{refusal['retry_after_ms']} ms" if refusal else "",
                refusal.get("suggested_action", ""),
                r["prompt_tokens"] + r["completion_tokens"]
                if r["prompt_tokens"] is not None
                else "",
            ]
        )
    headers = ["at", "task", "role", "fallback", "provider", "model", "account", "decision"]
    return cli.table([*headers, "outcome", "code", "retry after", "action", "tokens"], table)


def windows(accounts: list[dict[str, Any]]) -> str:
    """The provider accounts' windows: used of the limit, and each agent's share of them
    (``*``: it waits for the account now). Account ``*`` is a provider's slots: its
    window ``concurrency`` counts the calls in flight now."""
    if not accounts:
        return "\nwindows: no provider account has an rpm, token or concurrency limit"
    seconds = accounts[0]["window_sec"]
    rows = []
    for a in accounts:
        name = f"{a['provider']}/{a['account'] or '-'}"
        for gate, w in a["windows"].items():
            learnt = " (learnt)" if w["learnt"] else ""
            rows.append([name, gate, f"{w['used']:,.0f} / {w['limit']:,}{learnt}"])
    agents = [
        [
            f"{a['provider']}/{a['account'] or '-'}",
            f"{g['agent']}{' *' if g['waiting'] else ''}",
            f"{g['share']:g}",
            ", ".join(f"{gate} {n:,.0f}" for gate, n in g["used"].items()),
        ]
        for a in accounts
        for g in a["agents"]
    ]
    slots = (
        " (account *: a provider's slots in flight now)"
        if any(a["account"] == "*" for a in accounts)
        else ""
    )
    text = f"\nwindows (the last {seconds:g} s){slots}:\n"
    text += cli.table(["account", "window", "used"], rows)
    if agents:
        text += "\n\nshares (* waits for the account):\n"
        text += cli.table(["account", "agent", "share", "used"], agents)
    return text
