"""The embedded amqtt broker that :class:`~shared.transport.local_broker.LocalBroker` runs
when Mosquitto is not installed: amqtt's broker on a daemon thread with its own event loop,
admitting every client as authenticated so durable sessions keep their queued messages (as
Mosquitto does). amqtt comes from the ``broker`` extra and is imported only when started.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Any

from shared.errors import TransportError

log = logging.getLogger(__name__)


class EmbeddedAmqtt:
    """amqtt's broker on a daemon thread running its own event loop."""

    def __init__(self, host: str, port: int) -> None:
        self._config: dict[str, Any] = {
            "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
            # Only our open auth: no $SYS publisher, no per-packet logging plugins.
            "plugins": {f"{__name__}.{_AMQTT_AUTH_PLUGIN}": {}},
        }
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, name=f"amqtt-{host}:{port}", daemon=True
        )
        self._broker: Any = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._broker is not None

    def start(self, timeout_s: float) -> None:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start_broker(), self._loop)
        try:
            future.result(timeout_s)
        except FutureTimeoutError:
            future.cancel()
            raise TransportError(f"did not start within {timeout_s:.1f}s") from None
        except Exception as exc:  # amqtt raises BrokerError, OSError, plugin errors
            raise TransportError(f"failed to start: {exc}") from exc

    async def _start_broker(self) -> None:
        from amqtt.broker import Broker

        broker = Broker(self._config)
        await broker.start()
        self._broker = broker

    def stop(self, timeout_s: float) -> None:
        if not self._thread.is_alive():
            return
        if self._broker is not None:
            future = asyncio.run_coroutine_threadsafe(self._broker.shutdown(), self._loop)
            try:
                future.result(timeout_s)
            except FutureTimeoutError:
                log.warning("amqtt did not shut down within %.1fs; stopping its loop", timeout_s)
            except Exception:
                log.warning("amqtt shutdown failed; stopping its loop", exc_info=True)
            self._broker = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("amqtt thread still alive after %.1fs (daemon; left behind)", timeout_s)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                gathered = asyncio.gather(*pending, return_exceptions=True)
                self._loop.run_until_complete(asyncio.wait_for(gathered, 2.0))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        except Exception:
            log.warning("amqtt event loop did not wind down cleanly", exc_info=True)
        finally:
            self._loop.close()


_AMQTT_AUTH_PLUGIN = "_AmqttOpenAuth"


@functools.cache
def _amqtt_open_auth() -> type:
    """amqtt auth plugin admitting every client as authenticated rather than anonymous.

    amqtt's own AnonymousAuthPlugin marks clients anonymous, and amqtt then neither queues
    QoS 1/2 messages for their offline durable sessions nor keeps those sessions; mosquitto
    does both, and the bus relies on it across short disconnects.
    """
    from amqtt.plugins.base import BaseAuthPlugin

    class _AmqttOpenAuth(BaseAuthPlugin):
        async def authenticate(self, *, session: Any) -> bool:
            return True

    return _AmqttOpenAuth


if not TYPE_CHECKING:  # hidden from mypy so it cannot mask typos in importers

    def __getattr__(name: str) -> Any:
        """amqtt loads plugins by dotted path; build ours on first lookup, not at import."""
        if name == _AMQTT_AUTH_PLUGIN:
            return _amqtt_open_auth()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
