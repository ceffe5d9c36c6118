"""What the HTTP providers share: the key, the POST, and what an answer's status means.

A subclass says where it posts (``path``), how it authenticates (``headers``),
what it sends (``body``) and how it reads a 200 (``answer``). The key is read
from the environment variable the config names, sent only in a header, and
masked in every detail this returns. Statuses: 429 rate-limited; 503 and 529
overloaded (both cool the model down, for the provider's ``retry-after`` when it
gives one); 408 and timeouts timed out; 401/403 a refused credential; other
5xx retryable; other 4xx permanent. A 200 whose rate-limit headers say nothing
is left carries how long (``Succeeded.limit_reset_sec``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, ClassVar

import httpx

from agentbus import masking
from agentbus.catalog import ProviderConfig
from agentbus.errors import InvalidTask
from agentbus.providers import CallRequest, chat
from agentbus.providers.outcomes import (
    AuthFailed,
    Failed,
    Outcome,
    RateLimited,
    Succeeded,
    TimedOut,
)
from agentbus.providers.ratelimits import announced, exhausted_for, retry_after

MAX_BODY = 65_536  # of an error answer, read for its detail
DETAIL_CHARS = 300


class HTTPProvider:
    path: ClassVar[str]

    def __init__(
        self,
        config: ProviderConfig,
        environ: Mapping[str, str],
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = config
        assert config.base_url is not None
        self._keys = {
            a.name: environ.get(a.key_env, "") if a.key_env else "" for a in config.accounts
        }
        self._env = {a.name: a.key_env for a in config.accounts}
        masking.register(self._keys.values())
        self._client = httpx.Client(base_url=config.base_url, transport=transport)

    def headers(self, key: str) -> dict[str, str]:
        raise NotImplementedError

    def body(self, request: CallRequest) -> dict[str, Any]:
        raise NotImplementedError

    def answer(self, data: Any) -> Succeeded:
        raise NotImplementedError

    def call(self, request: CallRequest) -> Outcome:
        account = request.account or self.config.accounts[0].name
        key = self._keys.get(account, "")
        if not key:
            return AuthFailed(
                f"${self._env.get(account)} is not set for provider {self.config.name}"
            )
        try:
            body = self.body(request)
        except chat.ChatError as exc:  # a row written by hand: enqueue would have refused it
            raise InvalidTask(str(exc)) from None
        timeout = self.config.timeout_sec or request.timeout_sec
        try:
            response = self._client.post(
                self.path, json=body, timeout=timeout, headers=self.headers(key)
            )
        except httpx.TimeoutException:
            return TimedOut(f"{self.config.name}: no answer within {timeout:g}s")
        except httpx.TransportError as exc:
            return Failed(
                masking.mask(f"{self.config.name}: {type(exc).__name__}: {exc}"), retryable=True
            )
        return self._classify(response)

    def _classify(self, response: httpx.Response) -> Outcome:
        status = response.status_code
        if status == 200:
            try:
                answered = self.answer(response.json())
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                return Failed(f"{self.config.name}: malformed answer", retryable=True)
            return learnt_from(answered, response.headers)
        # Masked whole, then cut: a key straddling the cut cannot leave a readable part.
        body = masking.mask(response.text[:MAX_BODY])
        detail = f"{self.config.name}: HTTP {status} {body}".strip()[:DETAIL_CHARS]
        return status_outcome(status, response.headers, detail)

    def close(self) -> None:
        self._client.close()


def learnt_from(answered: Succeeded, headers: Mapping[str, str]) -> Succeeded:
    """A success with what its rate-limit ``headers`` said: how long nothing is left (if
    so), and the token windows they announce."""
    reset = exhausted_for(headers)
    windows = windows_of(headers)
    if not reset and not windows:
        return answered
    return dataclasses.replace(answered, limit_reset_sec=reset, announced=windows)


def windows_of(headers: Mapping[str, str]) -> tuple[tuple[str, int, int | None], ...]:
    """The token windows ``headers`` announce, as an outcome carries them."""
    return tuple((gate, *said) for gate, said in announced(headers).items())


def status_outcome(status: int, headers: Mapping[str, str], detail: str) -> Outcome:
    """What an answer other than 200 means (``headers`` looked up by lower-case name)."""
    if status in (429, 503, 529):
        wait = retry_after(headers)
        return RateLimited(
            detail,
            retry_after_sec=wait if wait is not None else exhausted_for(headers),
            overloaded=status != 429,
            announced=windows_of(headers),
        )
    if status == 408:
        return TimedOut(detail)
    if status in (401, 403):
        return AuthFailed(detail)
    return Failed(detail, retryable=status >= 500)


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """One tool call in the shape every provider reports: arguments decoded when JSON."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # else kept as the model wrote it
            arguments = json.loads(arguments)
    return {"id": call_id, "name": name, "arguments": arguments}
