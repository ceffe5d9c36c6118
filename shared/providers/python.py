"""Your own Python function as a model: ``kind = "python"``, ``target = "pkg.mod:function"``.

The function (a ``def`` or an ``async def``) gets the ``CallRequest`` every provider
gets: ``task_id``, ``model``, ``upstream``, ``prompt``, ``payload``, ``params``, and
``system`` and ``messages`` as ``chat`` builds them. It returns the answer: a string,
or a dict that JSON can write (kept as its JSON text). It may raise:

- ``agentbus.errors.RateLimited``, ``Overloaded``, ``Retryable`` or ``Permanent``, to
  say what happened itself;
- an SDK's error that carries an HTTP status (``status_code``, or
  ``response.status_code``: openai, anthropic, httpx and litellm errors all do), which
  counts as the same answer from an HTTP provider would, its ``retry-after`` and
  rate-limit headers included (``http.status_outcome``);
- a timeout (``TimeoutError``, or an error class named ``…Timeout…``): timed out;
- a connection error (``ConnectionError``, ``httpx.TransportError``, an SDK's
  ``APIConnectionError``): retryable.

Anything else is a crash of the handler: the task ends in ``error``, its detail the
exception's type and message (masked). No SDK is imported here: errors are read by
their attributes and class names.

An ``async def`` runs on one event loop of the provider's own, in a thread of its
own, so that the clients it keeps (an ``AsyncOpenAI``) stay on one loop; a call that
outlasts its timeout is cancelled. A ``def`` runs in the worker's slot thread, and
keeps its own timeouts (an SDK's ``timeout=``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from agentbus import errors, masking
from agentbus.catalog import ProviderConfig
from agentbus.errors import ConfigError, InvalidTask
from agentbus.providers import CallRequest, chat
from agentbus.providers.base import HandlerCrashed
from agentbus.providers.outcomes import Failed, Outcome, RateLimited, Succeeded, TimedOut

DETAIL_CHARS = 300
CLOSE_WAIT_SEC = 5.0


def load(target: str, where: str) -> Callable[..., Any]:
    """The function ``target`` names (``package.module:function``), checked to take one
    argument; ConfigError, naming ``where``, when it does not import or cannot."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: target must look like package.module:function")
    cwd = os.getcwd()
    if cwd not in sys.path:  # as `python -m` would: the working directory's modules
        sys.path.append(cwd)
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error it raises at import
        raise ConfigError(
            f"{where}: target {target!r} does not import: {type(exc).__name__}: {exc}"
        ) from None
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ConfigError(f"{where}: target {target!r}: {module_name} has no {attr}")
    if not callable(found):
        raise ConfigError(f"{where}: target {target!r} is not callable")
    try:
        inspect.signature(found).bind(None)
    except TypeError:
        raise ConfigError(
            f"{where}: target {target!r} must take one argument, the request"
        ) from None
    except ValueError:  # a builtin without a signature: called and seen
        pass
    return found  # type: ignore[no-any-return]


class PythonProvider:
    def __init__(self, config: ProviderConfig, environ: Mapping[str, str]) -> None:
        self.config = config
        assert config.target is not None
        self.fn = load(config.target, f"[providers.{config.name}]")
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)  # noqa: B004 - an object whose call is async
        )
        masking.register(environ.get(a.key_env) for a in config.accounts if a.key_env)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, request: CallRequest) -> Outcome:
        try:
            request.messages  # noqa: B018 - a conversation that cannot be sent fails the task
        except chat.ChatError as exc:
            raise InvalidTask(str(exc)) from None
        timeout = self.config.timeout_sec or request.timeout_sec
        try:
            answer = self._await(request, timeout) if self.is_async else self.fn(request)
        except concurrent.futures.TimeoutError:
            return TimedOut(f"{self.config.name}: no answer within {timeout:g}s")
        except (InvalidTask, HandlerCrashed, errors.Refused):
            raise  # Refused: an inner permit refused, the runner pauses as for any refusal
        except (Exception, SystemExit, concurrent.futures.CancelledError) as exc:
            # SystemExit: a script's sys.exit() ends its call, not the worker.
            outcome = outcome_of(exc, self.config.name)
            if outcome is None:
                raise HandlerCrashed(_said(exc)) from None
            return outcome
        return self._answered(answer)

    def _answered(self, answer: Any) -> Outcome:
        if isinstance(answer, str):
            return Succeeded(answer)
        if isinstance(answer, dict):
            try:
                return Succeeded(json.dumps(answer, ensure_ascii=False, allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise HandlerCrashed(
                    f"{self.config.target} returned a dict JSON cannot write: {exc}"
                ) from None
        raise HandlerCrashed(
            f"{self.config.target} returned {type(answer).__name__}, not a string or a dict"
        )

    def _await(self, request: CallRequest, timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(self.fn(request), self._running_loop())
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=loop.run_forever, name=f"agentbus-{self.config.name}", daemon=True
                )
                self._thread.start()
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Stop the event loop: what still runs on it (a call given up on) is cancelled."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(CLOSE_WAIT_SEC)
        if self._thread.is_alive():  # a handler that blocks its loop: left to the process
            return
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def outcome_of(exc: BaseException, provider: str) -> Outcome | None:
    """What a handler's exception says of the call; None: nothing a model answers (a bug)."""
    from agentbus.providers.http import status_outcome

    said = f"{provider}: {_said(exc)}"
    match exc:
        case errors.RateLimited():
            return RateLimited(said, retry_after_sec=exc.retry_after)
        case errors.Overloaded():
            return RateLimited(said, retry_after_sec=exc.retry_after, overloaded=True)
        case errors.Retryable():
            return Failed(said, retryable=True)
        case errors.Permanent():
            return Failed(said, retryable=False)
    response = getattr(exc, "response", None)
    status = getattr(exc, "status_code", None)
    if not isinstance(status, int) or isinstance(status, bool):
        status = getattr(response, "status_code", None)
    if isinstance(status, int) and not isinstance(status, bool):
        headers = getattr(response, "headers", None) or getattr(exc, "headers", None) or {}
        try:
            lowered = {str(k).lower(): str(v) for k, v in dict(headers).items()}
        except (TypeError, ValueError):
            lowered = {}
        return status_outcome(status, lowered, said)
    names = [cls.__name__ for cls in type(exc).__mro__]
    if isinstance(exc, TimeoutError) or any("Timeout" in name for name in names):
        return TimedOut(said)
    if isinstance(exc, ConnectionError) or any(
        name in ("APIConnectionError", "TransportError") for name in names
    ):
        return Failed(said, retryable=True)
    return None


def _said(exc: BaseException) -> str:
    return masking.mask(f"{type(exc).__name__}: {exc}")[:DETAIL_CHARS]
