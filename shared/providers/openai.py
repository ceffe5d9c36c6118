"""Any OpenAI-compatible chat-completions endpoint, over httpx.

The key is read from the environment variable the config names, sent only
in the Authorization header, and masked in every detail this returns.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from typing import Any

import httpx

from agentbus import masking
from agentbus.catalog import ProviderConfig
from agentbus.providers import CallRequest
from agentbus.providers.outcomes import (
    AuthFailed,
    Failed,
    Outcome,
    RateLimited,
    Succeeded,
    TimedOut,
    Usage,
)

MAX_BODY = 65_536  # of an error answer, read for its detail
DETAIL_CHARS = 300


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the provider asks us to wait (``retry-after-ms``, else ``Retry-After``)."""
    if "retry-after-ms" in headers:
        try:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(raw) if raw.strip() else None
        if parsed is None:
            return None
        return max(0.0, parsed.timestamp() - (time.time() if now is None else now))


class OpenAIProvider:
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

    def call(self, request: CallRequest) -> Outcome:
        account = request.account or self.config.accounts[0].name
        key = self._keys.get(account, "")
        if not key:
            return AuthFailed(
                f"${self._env.get(account)} is not set for provider {self.config.name}"
            )
        body = {
            "model": request.upstream or request.model,
            "messages": [{"role": "user", "content": request.prompt}],
        }
        timeout = self.config.timeout_sec or request.timeout_sec
        try:
            response = self._client.post(
                "/chat/completions",
                json=body,
                timeout=timeout,
                headers={"Authorization": f"Bearer {key}"},
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
        # Masked whole, then cut: a key straddling the cut cannot leave a readable part.
        body = masking.mask(response.text[:MAX_BODY])
        detail = f"{self.config.name}: HTTP {status} {body}".strip()[:DETAIL_CHARS]
        if status == 200:
            try:
                data: dict[str, Any] = response.json()
                text = data["choices"][0]["message"]["content"] or ""
                usage = data.get("usage") or {}
                return Succeeded(
                    text,
                    Usage(
                        int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
                    ),
                )
            except (ValueError, KeyError, IndexError, TypeError):
                return Failed(f"{self.config.name}: malformed answer", retryable=True)
        if status in (429, 503, 529):
            return RateLimited(
                detail, retry_after_sec=retry_after(response.headers), overloaded=status != 429
            )
        if status == 408:
            return TimedOut(detail)
        if status in (401, 403):
            return AuthFailed(detail)
        return Failed(detail, retryable=status >= 500)

    def close(self) -> None:
        self._client.close()
