"""What a call spends of its account's token windows: estimated before, reported after.

A token window (``tpm``: input and output tokens, ``itpm``: input alone, ``otpm``:
output alone, per provider account and ``rpm_window_sec``) admits a call only if
the call's estimate fits beside the tokens of the calls already in it; the
answer's reported usage then replaces the estimate (``Admission.finish``).

The input estimate is the characters the call sends divided by
``CHARS_PER_TOKEN`` (the providers' own rule of thumb for English text), each
character that is not a letter or a space counting twice (digits and
punctuation make short tokens: JSON and code are otherwise underestimated by a
quarter), plus ``MESSAGE_TOKENS`` of framing per message; content that is not
text (tool calls, tool definitions, images) counts by its JSON. No tokenizer is
loaded: the estimate is what admission can afford on every call (~3 ms for
100 KB), and its error is held only until the answer reports the real figure
(``python scripts/bench.py tokens`` measures it). The output estimate is
what the call may answer at most: ``max_tokens`` (or ``max_completion_tokens``)
times ``n``, from the task's params over the model's, else the provider's
default.

The windows' SQL is here too: what each counts of a call (``TOKENS_OF``; a model's
own window, ``model_tpm`` …, its calls alone) and the call that must leave one
before another fits (``token_window_blocker``), which ``limits`` and ``slots``
build on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from agentbus.providers import chat
from agentbus.schema import call_slots

if TYPE_CHECKING:
    from agentbus.admission.routing import Candidate
    from agentbus.catalog import Catalog
    from agentbus.config import Settings

CHARS_PER_TOKEN = 4
#: Tokens each message costs besides its content (its role and separators).
MESSAGE_TOKENS = 4
#: Runs of what counts once: letters and spaces (the rest counts twice).
_ONCE = re.compile(r"[A-Za-z\s]+")
#: Each token window and what of a call it counts.
GATES = ("tpm", "itpm", "otpm")


@dataclass(frozen=True)
class Tokens:
    """A call's input and output tokens (estimated, or as the answer reported them)."""

    input: int
    output: int

    def of(self, gate: str) -> int:
        """What window ``gate`` counts of them (an account's or a model's: ``model_tpm``)."""
        gate = gate.removeprefix("model_")
        if gate == "itpm":
            return self.input
        if gate == "otpm":
            return self.output
        return self.input + self.output


@dataclass(frozen=True)
class Request:
    """What a task's call sends, as far as its estimate goes: the task text and payload."""

    text: str
    payload: Mapping[str, Any]


#: A call whose size is not known (an inner permit): it is admitted while the window
#: still has room, and counts what its answer reports, if anything.
UNKNOWN = Tokens(0, 0)


def estimate(
    text: str, payload: Mapping[str, Any], params: Mapping[str, Any], default_output: int
) -> Tokens:
    """The tokens a call of the task ``text`` with ``payload`` and ``params`` (the task's
    over the model's, ``chat.params_for``) spends at most, as far as admission knows."""
    output = _output(params, default_output)
    try:
        messages = chat.conversation(text, payload)
    except chat.ChatError:  # not a chat payload (a command's own): its whole JSON
        return Tokens(_capped(-(-_chars(text + _text(dict(payload))) // CHARS_PER_TOKEN)), output)
    sent = [chat.system_of(payload) or ""]
    for message in messages:
        sent.append(_text(message.get("content")))
        if message.get("tool_calls"):
            sent.append(_text(message["tool_calls"]))
    if params.get("tools"):
        sent.append(_text(params["tools"]))
    framing = MESSAGE_TOKENS * (len(messages) + 1)
    return Tokens(_capped(-(-_chars("".join(sent)) // CHARS_PER_TOKEN) + framing), output)


def of_call(catalog: Catalog, settings: Settings, c: Candidate, request: Request) -> Tokens:
    """The estimate of a task's call to candidate ``c``: the model's params under the
    task's, and the output the provider's kind assumes when they set no max_tokens."""
    kind = catalog.provider(c.provider).kind
    default = chat.DEFAULT_MAX_TOKENS.get(kind, settings.output_token_estimate)
    params = chat.params_for(catalog.model(c.model).params, request.payload)
    return estimate(request.text, request.payload, params, default)


def need_of(
    catalog: Catalog, settings: Settings, c: Candidate, request: Request | Tokens | None
) -> Tokens:
    """What a call to ``c`` holds of its token windows: what its caller said it uses
    (``Tokens``), the estimate of a task's call (``Request``), else nothing known."""
    if isinstance(request, Tokens):
        return request
    return UNKNOWN if request is None else of_call(catalog, settings, c, request)


def _chars(text: str) -> int:
    """The characters of ``text``, those neither a letter nor a space counted twice."""
    return len(text) + len(_ONCE.sub("", text))


def _text(content: Any) -> str:
    """A message's content as text: its text, else its JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return chat.joined_text(content)
    return json.dumps(content, separators=(",", ":"), default=str)


def _output(params: Mapping[str, Any], default: int) -> int:
    """``max_tokens`` (or ``max_completion_tokens``) times ``n``; a value that is not a
    whole number of at least 1 (a row written by hand) counts as not given."""
    most = _whole(params.get("max_tokens", params.get("max_completion_tokens"))) or default
    return _capped(most * (_whole(params.get("n")) or 1))


def _whole(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return value if ok else None


def _capped(tokens: int) -> int:
    return min(tokens, chat.MAX_COUNT)


# -- the windows in SQL: what counts a call, and the call that must leave first --

#: What each token window counts of a call.
TOKENS_OF = {
    "tpm": call_slots.c.tokens_in + call_slots.c.tokens_out,
    "itpm": call_slots.c.tokens_in,
    "otpm": call_slots.c.tokens_out,
}
TOKENS_OF |= {f"model_{gate}": counted for gate, counted in TOKENS_OF.items()}
#: The calls of one model (``p_model``): what a model's own token window counts.
OF_MODEL = call_slots.c.model == sa.bindparam("p_model", type_=sa.Text)


#: The calls of an account's token windows (``p_provider``, ``p_account``) admitted after
#: ``p_tokens_since``.
IN_TOKEN_WINDOW = sa.and_(
    call_slots.c.provider == sa.bindparam("p_provider", type_=sa.Text),
    call_slots.c.account == sa.bindparam("p_account", type_=sa.Text),
    call_slots.c.tokens_in.is_not(None),
    call_slots.c.admitted_at > sa.bindparam("p_tokens_since", type_=sa.Float),
)


def token_window_blocker(gate: str) -> Any:
    """SQL: when the newest call of the account's token window ``gate`` was admitted that
    must leave the window before a call fits (NULL: it fits now). Each call in the
    window is summed with the calls after it (newest first); the newest whose sum is
    above ``p_<gate>_room`` is the one: once it has left, what stays fits."""
    newer = (
        sa.func.sum(TOKENS_OF[gate])
        .over(order_by=(call_slots.c.admitted_at.desc(), call_slots.c.id.desc()))
        .label("newer")
    )
    in_window = (
        sa.select(call_slots.c.admitted_at.label("at"), newer)
        .where(IN_TOKEN_WINDOW, OF_MODEL if gate.startswith("model_") else sa.true())
        .subquery(f"{gate}_calls")
    )
    room = sa.bindparam(f"p_{gate}_room", type_=sa.BigInteger)
    return sa.select(sa.func.max(in_window.c.at)).where(in_window.c.newer > room)


def token_window_used(gate: str) -> Any:
    """SQL: the tokens the calls in the account's token window ``gate`` hold now."""
    counted = sa.func.coalesce(sa.func.sum(TOKENS_OF[gate]), 0)
    return sa.select(counted).where(
        IN_TOKEN_WINDOW, OF_MODEL if gate.startswith("model_") else sa.true()
    )
